"""A run's stages: what a run needs built before it starts, each cached under a hashed key, built once, in order.

``run_training``, ``run_collection`` and ``run_benchmark`` call ``ensure_stages(cfg)`` before they build anything. It
finds every stage the config names (a stage's own stages first), logs one line per stage (cached at PATH, or building
and why), builds what is missing, and writes each output path into the config (``model.name_or_path``,
``data.path``): model specs and datamodules only read paths. ``python -m lit_spec.stages`` does the same without a run.

The stages (each ``cache_dir/<name>-<key>``, the key a ``config_hash`` of what the output depends on, null-valued
options left out):

- ``tiny_base`` (``model=tiny``, ``TinyModelSpec``): a randomly initialised tiny Llama and a BPE tokenizer trained on
  stdlib-code; keyed by the architecture.
- ``<experiment>`` (``StageModelSpec``: ``model=tiny_target``, ``tiny_draft``): the model that ``+experiment=<stage>``
  trains and exports; keyed by that composed config's model, data, method, trainer and seed. Built by
  ``run_training`` in ``cache_dir/runs/<name>-<key>``, where an interrupted build resumes from its last checkpoint.
- ``gguf`` (any model config with ``gguf_file``, e.g. ``model=smollm2_135m_instruct``): the GGUF de-quantised once
  by transformers into a ``save_pretrained`` directory in the config's dtype; keyed by the file's sha256 (a hub file:
  by id, file and revision) and the dtype.
- ``trajectories`` (``data=trajectories`` or ``noisy_trajectories`` with ``data.path`` null): Jacobi trajectories
  collected by ``run_collection`` with ``conf/collect.yaml`` + ``data.collect``; keyed by its model, data, collect and seed
  (processes and strategy do not change the output); resumable.
- ``answers`` (``data=self_distilled`` with ``data.path`` null): the target's own greedy answers, the same collection
  with ``collect.decoder=ar`` (answers only), keyed and resumable the same way.
- ``base_states`` (``data=self_distilled`` with ``data.base_states.enabled=true``): the frozen base's last hidden states
  (or those of ``data.base_states.layers``) and greedy next tokens of every answer (``lit_spec/data/base_states.py``); keyed by the model, the answers and how
  they are cut.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import hydra
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf, open_dict

from lit_spec.config import build, cache_entry, compose_config, config_dir, config_hash
from lit_spec.data.trajectories import META, read_meta
from lit_spec.data.base_states import FILE as BASE_STATES_FILE, BaseStates, build_base_states
from lit_spec.data.self_distilled import SelfDistilledDataModule
from lit_spec.data.trajectory_data import JacobiTrajectories
from lit_spec.errors import ConfigError, one_line_errors
from lit_spec.io import check_writable, file_sha256, one_writer, set_aside
from lit_spec.models import HFModelSpec, StageModelSpec, TinyModelSpec
from lit_spec.models.gguf import dequantize_gguf, gguf_path
from lit_spec.models.spec import damaged_weights
from lit_spec.models.tiny import build_tiny_model

log = logging.getLogger(__name__)

EXPERIMENT_GROUPS = ("model", "data", "method", "trainer", "seed")   # what an experiment stage's key hashes
COLLECT_GROUPS = ("model", "data", "collect", "seed")                # what a trajectory collection's key hashes
# collect.* that change where a collection goes or how much of it is checked, not what it holds: left out of its key
# and of the settings a resume must match (collection/run.py)
NOT_COLLECTED = ("out_dir", "engine_check")


@dataclass
class Stage:
    """One cached build: ``name`` (``<kind>-<key>``), the config that builds it (null for a leaf), its output
    directory, how to build it, whether it is there (``built``) or half there (``started``: a resumed build), and
    what must hold before it is built (``check``: raises, before any stage is built). ``damage``: why a built
    output cannot be read (a model stage's truncated weights), else None; a damaged output is set aside (with the
    ``workdir`` it was built in) and built again."""

    name: str
    config: DictConfig | None
    output: Path
    build: Callable[[], object]
    built: Callable[[], bool]
    started: Callable[[], bool]
    check: Callable[[], None] = lambda: None
    damage: Callable[[], str | None] = lambda: None
    workdir: Path | None = None
    needs: list[Path] = field(default_factory=list)    # the outputs of the stages it is built from

    def status(self) -> str:
        return "cached" if self.built() else "interrupted earlier: resuming" if self.started() else "not cached"


# ---- the three kinds of stage ---------------------------------------------------------------------------------------
def tiny_model_stage(node: DictConfig) -> Stage:
    spec = build(node)
    out = cache_entry(node.cache_dir, f"tiny_base-{config_hash(spec.architecture())}")
    return Stage(out.name, None, out, partial(build_tiny_model, spec, out), (out / "config.json").is_file,
                 lambda: False, damage=partial(damaged_weights, out))


def experiment_stage(node: DictConfig) -> Stage:
    seed = [] if node.get("seed") is None else [f"model.seed={node.seed}"]
    cfg = compose_config([f"+experiment={node.stage}", f"paths.cache_dir={node.cache_dir}", *seed])
    out = cache_entry(node.cache_dir, f"{node.stage}-{config_hash(OmegaConf.masked_copy(cfg, list(EXPERIMENT_GROUPS)))}")
    runs = out.parent / "runs" / out.name
    with open_dict(cfg):
        cfg.paths.output_dir, cfg.export_dir = str(runs), str(out)
    return Stage(out.name, cfg, out, partial(run_training_stage, cfg), (out / "config.json").is_file,
                 lambda: newest_checkpoint(runs) is not None, damage=partial(damaged_weights, out), workdir=runs)


def collection_stage(kind: str, node: DictConfig) -> Stage:
    """``trajectories`` or ``answers``: a collection by ``run_collection``."""
    if not node.get("collect"):
        raise ConfigError(f"the {kind} data: set data.path (a collected directory) or data.collect (overrides "
                          "for conf/collect.yaml)")
    overrides = list(node.collect)
    # the collection's model stages share this run's cache (a command-line paths.cache_dir, not only LIT_SPEC_CACHE)
    cfg = compose_config([*overrides, f"paths.cache_dir={node.cache_dir}"], config_name="collect")
    hashed = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k in COLLECT_GROUPS}
    for key in NOT_COLLECTED:
        hashed["collect"].pop(key, None)
    out = cache_entry(node.cache_dir, f"{kind}-{config_hash(hashed)}")
    with open_dict(cfg):
        cfg.collect.out_dir = str(out)
        cfg.paths.output_dir = str(out)  # the trainer's default_root_dir (nothing is written there in predict)
        if node.get("engine"):   # set after hashing: vLLM's greedy answers are lit_spec's (checked), the same stage
            cfg.collect.engine = node.engine
    meta = out / META
    return Stage(out.name, cfg, out, partial(run_collection_stage, cfg), lambda: _complete(out), meta.is_file,
                 partial(_one_process, cfg, overrides))


def base_states_stage(node: DictConfig) -> Stage:
    what = OmegaConf.to_container(node, resolve=True)
    for key in ("_target_", "enabled", "path", "cache_dir"):
        what.pop(key)
    what["model"].pop("cache_dir", None)
    out = cache_entry(node.cache_dir, f"base_states-{config_hash(what)}")
    return Stage(out.name, None, out, partial(build_base_states_stage, node, out), (out / BASE_STATES_FILE).is_file,
                 lambda: False)


def build_base_states_stage(node: DictConfig, out: Path) -> None:
    states = build(node)
    answers = SelfDistilledDataModule(path=states.answers, max_answer_tokens=states.max_answer_tokens,
                                      max_train_records=states.max_train_records)
    build_base_states(states.model, answers.records(), states.dtype, out, states.layers)


def gguf_stage(node: DictConfig) -> Stage:
    source, file = node.name_or_path, node.gguf_file
    local = gguf_path(source, file)          # None for a hub id: keyed by id, file and revision
    what = {"sha256": file_sha256(local)} if local else {"hub_id": source, "file": file, "revision": node.revision}
    out = cache_entry(node.cache_dir, f"gguf-{config_hash({**what, 'dtype': node.dtype})}")
    return Stage(out.name, None, out, partial(dequantize_gguf, source, file, out, node.dtype),
                 (out / "config.json").is_file, lambda: False, damage=partial(damaged_weights, out))


KINDS: dict[type, Callable[[DictConfig], Stage]] = {
    TinyModelSpec: tiny_model_stage, StageModelSpec: experiment_stage, HFModelSpec: gguf_stage,
    JacobiTrajectories: partial(collection_stage, "trajectories"),
    SelfDistilledDataModule: partial(collection_stage, "answers"), BaseStates: base_states_stage}
OUTPUT_KEY = {JacobiTrajectories: "path", SelfDistilledDataModule: "path", BaseStates: "path"}  # models: name_or_path


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The latest checkpoint a run directory holds (interrupted.ckpt or last.ckpt, by time), else None."""
    found = [p for p in (run_dir / "checkpoints").glob("*.ckpt") if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def run_training_stage(cfg: DictConfig) -> None:
    """Train the stage's experiment in its run directory: resumed from its newest checkpoint when an earlier build
    was interrupted; from scratch otherwise (what an earlier build left there without a checkpoint is removed)."""
    from lit_spec.training import run_training

    run_dir = Path(cfg.paths.output_dir)
    resume = newest_checkpoint(run_dir)
    if resume is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    with open_dict(cfg):
        cfg.ckpt_path = str(resume) if resume else None
    run_training(cfg)


def run_collection_stage(cfg: DictConfig) -> None:
    from lit_spec.collection import run_collection

    run_collection(cfg)


def _one_process(cfg: DictConfig, overrides: list[str]) -> None:
    """A collection inside another command runs in its one process; a multi-process one is a job of its own."""
    trainer, processes = cfg.trainer, int(os.environ.get("WORLD_SIZE", "1"))
    if trainer.get("devices", 1) != 1 or trainer.get("num_nodes", 1) != 1 or processes > 1:
        raise ConfigError(
            f"the trajectories of data.collect={overrides} are not collected yet, and this run would collect them "
            f"with several processes (collect devices={trainer.get('devices')}, num_nodes={trainer.get('num_nodes')};"
            f" training processes: {processes}); collect them first with\n  python -m lit_spec.collect "
            f"{' '.join(overrides)} collect.out_dir={cfg.collect.out_dir}\n(resumable), then run this command again: "
            "it finds them there")


def _complete(out: Path) -> bool:
    return (out / META).is_file() and bool(read_meta(out).get("complete"))


# ---- finding and building ---------------------------------------------------------------------------------------------
def _kind(node: DictConfig) -> type | None:
    """The stage kind a config node builds (by its ``_target_``); a data node with a path is no stage."""
    target = node.get("_target_")
    if not isinstance(target, str) or not target.startswith("lit_spec."):
        return None
    cls = get_object(target)
    kind = next((k for k in KINDS if isinstance(cls, type) and issubclass(cls, k)), None)
    if kind in OUTPUT_KEY and node.get(OUTPUT_KEY[kind]) is not None:     # a given collection
        return None
    if kind is HFModelSpec and not node.get("gguf_file"):
        return None
    if kind is BaseStates and not node.get("enabled"):
        return None
    return kind


def _target_paths(tree, path: str = "") -> list[str]:
    """Dotted paths of every node with a ``_target_`` in a plain (unresolved) config tree, parents first."""
    if not isinstance(tree, dict):
        return []
    here = [path.rstrip(".")] if "_target_" in tree else []
    return here + [p for key, value in tree.items() if key != "hydra" for p in _target_paths(value, f"{path}{key}.")]


def find_stages(cfg: DictConfig, named: list[Path] | None = None) -> list[Stage]:
    """Every stage ``cfg`` (a whole config, or one node of it such as ``cfg.model``) names, each once, a stage's own
    stages before it; each stage's output path is written into its node (``open_dict``), so what ``cfg`` builds
    afterwards reads the cached output. ``named`` receives the outputs of the stages ``cfg`` itself names."""
    stages: dict[Path, Stage] = {}
    for path in _target_paths(OmegaConf.to_container(cfg, resolve=False)):
        node = OmegaConf.select(cfg, path) if path else cfg
        kind = _kind(node)
        if kind is None:
            continue
        stage = KINDS[kind](node)          # the key is computed before nested stages fill in their paths
        upstream = find_stages(stage.config, stage.needs) if stage.config is not None else []
        for found in [*upstream, stage]:
            stages.setdefault(found.output, found)
        if named is not None:
            named.append(stage.output)
        with open_dict(node):
            node[OUTPUT_KEY.get(kind, "name_or_path")] = str(stage.output)
            if kind is HFModelSpec:
                node.gguf_file = None             # the de-quantised directory is a plain checkpoint
    return list(stages.values())


def needed(stages: list[Stage], named: list[Path]) -> list[Stage]:
    """The stages a run needs: those it names, and the stages a missing one is built from (a cached stage needs
    nothing upstream)."""
    wanted = set(named)
    for stage in reversed(stages):          # a stage's own stages come before it
        if stage.output in wanted and not stage.built():
            wanted.update(stage.needs)
    return [stage for stage in stages if stage.output in wanted]


def build_stages(stages: list[Stage], named: list[Path] | None = None) -> list[Stage]:
    """Build every stage that is not cached, in order, logging one line per stage; every missing stage's check runs
    before the first build. ``named``: the stages the run names (``find_stages``); upstream of a cached one is
    skipped."""
    if named is not None:
        stages = needed(stages, named)
    for stage in stages:
        damage = stage.built() and stage.damage()
        if damage:
            aside = [set_aside(path) for path in (stage.output, stage.workdir) if path is not None and path.exists()]
            log.warning("stage %s: the cached output at %s is damaged (%s): set aside as %s; building it again",
                        stage.name, stage.output, damage, " and ".join(map(str, aside)))
    missing = [stage for stage in stages if not stage.built()]
    for stage in missing:
        stage.check()
    for stage in missing:
        check_writable(stage.output.parent, "paths.cache_dir (LIT_SPEC_CACHE)")
    for stage in stages:
        if stage not in missing:
            log.info("stage %s: cached at %s", stage.name, stage.output)
            continue
        with one_writer(stage.output.parent / f".{stage.name}.lock", f"stage {stage.name}", wait=True):
            if stage.built():               # by another process while this one waited
                log.info("stage %s: built by another process at %s", stage.name, stage.output)
                continue
            log.info("stage %s: building into %s (%s)", stage.name, stage.output, stage.status())
            stage.build()
    return stages


def ensure_stages(cfg: DictConfig) -> list[Stage]:
    """``cfg``'s stages found (paths filled in) and built where missing."""
    named: list[Path] = []
    return build_stages(find_stages(cfg, named), named)


def describe(stages: list[Stage]) -> str:
    return "\n".join(f"{s.name:<32} {s.status():<30} {s.output}" for s in stages) or "(no stages)"


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def main(cfg: DictConfig) -> None:
    """``python -m lit_spec.stages [overrides]``: list a config's stages, then build the missing ones (``+list=true``:
    list only). ``--config-name bench`` or ``collect`` for those commands' configs."""
    with one_line_errors():
        named: list[Path] = []
        stages = find_stages(cfg, named)
        print(describe(stages))
        if not cfg.get("list"):
            build_stages(stages, named)
            print(describe(stages))


if __name__ == "__main__":
    main()
