"""Every YAML under conf/ composes, resolves and names importable targets; strategy configs build on this machine."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.utils import _locate
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import UnsupportedInterpolationType

from lit_spec.config import compose_config, config_dir

CONF = config_dir()
# groups whose option is chosen on the command line as group=option (experiment is appended: +experiment=name)
# groups of another entry config than train.yaml (decoding belongs to bench.yaml; chosen as a list); an experiment
# that overrides one of them is composed with that entry config (_entry_config)
PRIMARY = {"decoding": "bench"}
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name not in {"hydra", "experiment"})
# configs that deliberately leave a value to the user (model=hf: name_or_path; decoding=chimera/medusa/
# hidden_transfer: the trained heads or maps)
MANDATORY = {("model", "hf"): {"model.name_or_path"}, ("model", "stage_export"): {"model.stage"},
             ("decoding", "chimera"): {"decoding.chimera.heads"},
             ("decoding", "medusa"): {"decoding.medusa.heads"},
             ("decoding", "hidden_transfer"): {"decoding.hidden_transfer.transfer"},
             ("decoding", "eagle3"): {"decoding.eagle3.heads"},
             ("decoding", "eagle3_chain"): {"decoding.eagle3_chain.heads"},
             ("decoding", "dflash"): {"decoding.dflash.heads"}}
# hydra.utils helpers whose `path` names a second thing to import
LOCATORS = {"hydra.utils.get_method", "hydra.utils.get_class", "hydra.utils.get_object"}


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml") if not p.name.startswith("_"))


def _entry_config(experiment: str) -> str:
    """The entry config an experiment is composed with: the one owning a group its defaults list overrides (an
    experiment that overrides /decoding is a benchmark, ``python -m lit_spec.bench +experiment=...``), else train."""
    defaults = OmegaConf.load(CONF / "experiment" / f"{experiment}.yaml").get("defaults") or []
    for entry in defaults:
        key = next(iter(entry)) if isinstance(entry, DictConfig) else str(entry)  # "override /decoding", "/model@x"
        group = key.split()[-1].lstrip("/").split("@")[0]
        if group in PRIMARY:
            return PRIMARY[group]
    return "train"


def _cases() -> list:
    cases = [pytest.param(f"{g}=[{o}]" if g in PRIMARY else f"{g}={o}", (g, o), id=f"{g}={o}")
             for g in GROUPS for o in _options(g)]
    cases += [pytest.param(f"+experiment={o}", ("experiment", o), id=f"experiment={o}")
              for o in _options("experiment")]
    return cases


def _composed(override: str, output_dir: Path, config_name: str = "train") -> DictConfig:
    cfg = compose_config([override], config_name=config_name)
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
    return cfg


def _resolve_all(node, path: str = "") -> tuple[list[str], list[str]]:
    """Resolve every value except ``${hydra:...}`` ones; returns (mandatory ``???`` keys, failures)."""
    missing, failures = [], []
    keys = range(len(node)) if isinstance(node, ListConfig) else list(node.keys())
    for key in keys:
        where = f"{path}.{key}" if path else str(key)
        if OmegaConf.is_missing(node, key):
            missing.append(where)
            continue
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)) and not OmegaConf.is_interpolation(node, key):
            m, f = _resolve_all(child, where)
            missing += m
            failures += f
            continue
        raw = child._value()
        if isinstance(raw, str) and "${hydra:" in raw:
            continue  # only a running Hydra app knows these
        try:
            node[key]
        except UnsupportedInterpolationType as e:
            if "hydra" not in str(e):
                failures.append(f"{where}: {e}")
        except Exception as e:  # noqa: BLE001 - report every unresolvable value at once
            failures.append(f"{where}: {type(e).__name__}: {e}")
    return missing, failures


def _targets(node, path: str = "") -> list[tuple[str, str]]:
    """(where, dotted name) for every ``_target_`` and every ``path`` of a hydra.utils.get_* node."""
    found = []
    if isinstance(node, DictConfig):
        target = node.get("_target_")
        if target is not None:
            found.append((f"{path}._target_", target))
            if target in LOCATORS and node.get("path"):
                found.append((f"{path}.path", node.path))
        for key in node.keys():
            if key != "_target_":
                found += _targets(node._get_node(key), f"{path}.{key}" if path else str(key))
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            found += _targets(node._get_node(i), f"{path}[{i}]")
    return found


def test_every_group_option_is_covered():
    """The discovery below is not vacuous: the groups train.yaml is built from are all there, with options."""
    assert {"model", "method", "data", "trainer", "strategy", "logger", "callbacks", "paths"} <= set(GROUPS)
    assert all(_options(g) for g in GROUPS + ["experiment"]), {g: _options(g) for g in GROUPS}
    assert "_prompt" not in _options("data") and "stdlib_code" in _options("data")


@pytest.mark.parametrize("override, choice", _cases())
def test_option_composes_resolves_and_targets_import(override, choice, tmp_path):
    group, option = choice
    cfg = _composed(override, tmp_path, _entry_config(option) if group == "experiment" else PRIMARY.get(group, "train"))

    missing, failures = _resolve_all(cfg)
    assert not failures, "\n".join(failures)
    assert set(missing) == MANDATORY.get(choice, set()), f"unexpected ??? values: {missing}"

    targets = _targets(cfg)
    assert targets, "a composed train config always builds something"
    bad = []
    for where, name in targets:
        try:
            _locate(name)
        except Exception as e:  # noqa: BLE001
            bad.append(f"{where}={name}: {type(e).__name__}: {e}")
    assert not bad, "\n".join(bad)

    # the option really was selected
    if group == "strategy":
        assert "strategy" in cfg.trainer and "strategy" not in cfg
    elif group in {"model", "method", "data", "trainer"}:
        raw = OmegaConf.load(CONF / group / f"{option}.yaml")
        if "_target_" in raw:
            assert cfg[group]._target_ == raw._target_
    elif group in {"logger", "callbacks"}:
        assert cfg[group], f"{override} composed an empty {group} group"
    elif group == "decoding":
        # a decoder is named by its package, `# @package decoding.<name>` (lookahead_tiny configures decoding.lookahead)
        header = (CONF / group / f"{option}.yaml").read_text().splitlines()[0]
        assert header.startswith("# @package decoding."), header
        name = header.removeprefix("# @package decoding.").strip()
        assert list(cfg.decoding) == [name] and cfg.decoding[name].method


@pytest.mark.parametrize("option", _options("experiment"))
def test_experiment_values_win(option, tmp_path):
    """An experiment is '# @package _global_' and is applied last: every value it sets is what the run sees."""
    cfg = _composed(f"+experiment={option}", tmp_path, _entry_config(option))
    assert "experiment" not in cfg, "missing '# @package _global_': the experiment landed under cfg.experiment"

    raw = OmegaConf.to_container(OmegaConf.load(CONF / "experiment" / f"{option}.yaml"), resolve=False)
    raw.pop("defaults", None)
    composed = OmegaConf.to_container(cfg, resolve=False)

    def leaves(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and v:
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    wrong = []
    for key, value in leaves(raw):
        node = composed
        for part in key.split("."):
            node = node.get(part, "<absent>") if isinstance(node, dict) else "<absent>"
        if node != value:
            wrong.append(f"{key}: experiment says {value!r}, composed {node!r}")
    assert not wrong, "\n".join(wrong)


def test_experiments_are_composed_with_their_entry_config():
    """The rule above is not vacuous: both kinds of experiment exist, and a bench experiment does not compose with
    train.yaml (which has neither the draft nor /decoding to override)."""
    kinds = {o: _entry_config(o) for o in _options("experiment")}
    assert kinds["ouroboros_gsm8k"] == "bench" and kinds["cllm_gsm8k"] == kinds["tiny_target"] == "train"
    assert {o for o, k in kinds.items() if k == "bench"} >= {f"ouroboros_{t}" for t in
                                                            ("gsm8k", "humaneval", "mbpp", "cnndm", "wmt16")}
    with pytest.raises(ConfigCompositionException, match="Could not override"):
        compose_config(["+experiment=ouroboros_gsm8k"], config_name="train")


def test_hydra_run_and_sweep_dirs():
    """conf/hydra: one directory per run under logs/<task_name>/runs; multirun jobs get <sweep dir>/<job number>."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["task_name=probe"], return_hydra_config=True)
    assert cfg.hydra.job.chdir is False
    run_dir = Path(cfg.hydra.run.dir)
    assert run_dir.parts[:3] == ("logs", "probe", "runs") and len(run_dir.parts) == 4
    assert Path(cfg.hydra.sweep.dir).parts[:3] == ("logs", "probe", "multiruns")
    assert OmegaConf.to_container(cfg.hydra.sweep, resolve=False)["subdir"] == "${hydra.job.num}"
    assert OmegaConf.to_container(cfg.paths, resolve=False)["output_dir"] == "${hydra:runtime.output_dir}"


# ---- strategies: each builds its Lightning object here, on a machine with no GPU -------------------------------

def _strategy(name: str, *overrides: str):
    cfg = compose_config([f"strategy={name}", *overrides])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = instantiate(cfg.trainer.strategy)
    hydra_deprecations = [str(w.message) for w in caught if "_target_" in str(w.message)]
    assert not hydra_deprecations, hydra_deprecations
    return strategy


@pytest.mark.parametrize("name, stage, offload", [("deepspeed_zero2", 2, False), ("deepspeed_zero3", 3, False),
                                                  ("deepspeed_zero3_offload", 3, True)])
def test_deepspeed_strategies_build(name, stage, offload):
    from lit_spec.strategies import DeepSpeedStrategy     # Lightning's, also on the CPU

    strategy = _strategy(name)
    assert isinstance(strategy, DeepSpeedStrategy)
    zero = strategy.config["zero_optimization"]
    assert zero["stage"] == stage
    assert zero.get("stage3_param_persistence_threshold") == (100_000 if stage == 3 else None)
    assert zero["allgather_bucket_size"] == zero["reduce_bucket_size"] == 200_000_000
    if offload:
        assert zero["offload_optimizer"]["device"] == "cpu"
        assert zero["offload_param"]["device"] == "cpu"
    else:
        assert "offload_optimizer" not in zero and "offload_param" not in zero


def test_fsdp_strategy_builds():
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = _strategy("fsdp", "trainer.devices=4")
    assert isinstance(strategy, ModelParallelStrategy)     # FSDP2: lit_spec.strategies.fully_shard_model shards
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (4, 1)   # data parallel over devices
    assert strategy._save_distributed_checkpoint


@pytest.mark.parametrize("name, start_method", [("ddp", "popen"), ("ddp_spawn", "spawn")])
def test_ddp_strategies_build(name, start_method):
    from lightning.pytorch.strategies import DDPStrategy

    strategy = _strategy(name)
    assert isinstance(strategy, DDPStrategy)
    assert strategy._start_method == start_method
    assert strategy._ddp_kwargs == {"find_unused_parameters": False}


def test_bench_default_composes_every_training_free_method_with_the_tiny_draft(tmp_path):
    from lit_spec.decoding import DECODERS

    cfg = _composed("bench.num_prompts=3", tmp_path, "bench")
    trained = {"chimera", "medusa", "hidden_transfer", "eagle3", "dflash"}    # heads a method=... run trains
    assert set(cfg.decoding) == set(DECODERS) - trained - {"ar"}    # ar: the baseline, always run
    assert cfg.decoding.speculative.needs_draft and cfg.draft.stage == "tiny_draft"
    assert cfg.model.stage == "tiny_target" and cfg.bench.num_prompts == 3
    missing, failures = _resolve_all(cfg)
    assert not missing and not failures, (missing, failures)


def test_offline_defaults_are_the_quickstarts_spelled_out(tmp_path):
    """`python -m lit_spec.train` is +experiment=cllm_quickstart and `python -m lit_spec.bench` has the CPU setting of
    +experiment=ouroboros_quickstart's lookahead, while method=cllm and decoding=[lookahead] keep the papers' values."""
    def plain(cfg):
        out = OmegaConf.to_container(cfg, resolve=False)
        return {k: v for k, v in out.items() if k not in {"paths", "task_name"}}

    assert plain(compose_config([])) == plain(compose_config(["+experiment=cllm_quickstart"]))
    bench = compose_config([], config_name="bench").decoding.lookahead
    quick = compose_config(["+experiment=ouroboros_quickstart"], config_name="bench").decoding.lookahead
    assert bench == quick and (bench.window, bench.ngram, bench.guesses) == (5, 4, 5)
    paper = compose_config(["decoding=[lookahead]"], config_name="bench").decoding.lookahead
    assert (paper.window, paper.ngram, paper.guesses) == (15, 5, 15)
    assert compose_config(["decoding=[jacobi]"], config_name="bench").decoding.keys() == {"jacobi"}
    assert compose_config(["decoding.lookahead.window=7"], config_name="bench").decoding.lookahead.window == 7
    paper, default = compose_config(["method=cllm"]).method, compose_config([]).method
    assert (paper.lr, paper.ar_teacher, paper.ar_weight) == (2e-5, "labels", 10.0)     # Table 6's L_GC + 10·L_AR
    assert (default.lr, default.ar_teacher, default.ar_weight) == (5e-4, "original", 5.0)    # the frontier's pick
    # both weigh their terms as the authors' code does; eq. 4 and 6 are one setting away
    assert (paper.consistency_reduction, paper.ar_sequence, paper.ar_prompt, paper.label_smoothing) == (
        "mean", "block", True, 0.1) == (default.consistency_reduction, default.ar_sequence, default.ar_prompt,
                                         default.label_smoothing)


def test_methods_share_one_optimizer_config():
    """The optimizer keys come from conf/method/_optim.yaml (each method overrides what its paper says): every method
    config lists it in its defaults (or builds on one that does) and composes all of its keys."""
    base = OmegaConf.load(CONF / "method" / "_optim.yaml")
    for option in _options("method"):
        defaults = [str(d) for d in OmegaConf.load(CONF / "method" / f"{option}.yaml").get("defaults") or []]
        assert "_optim" in defaults or set(defaults) & set(_options("method")), (option, defaults)
        method = compose_config([f"method={option}"]).method
        assert set(base) <= set(method) and not OmegaConf.is_missing(method, "lr"), option


def test_config_hash_ignores_null_options_and_sees_every_value():
    """Stage and collection caches are keyed by ``config_hash``: an option added with a null default must not move
    existing keys (no rebuild), while any real value, interpolation or nesting change must."""
    from lit_spec.config import config_hash

    def cfg(model=None, data=None):
        return OmegaConf.create({"model": model or {"hidden": 64, "seed": 0},
                                 "data": data or {"splits": ["train", "test"], "lr": "${x}"}})

    base = cfg()
    same = cfg({"hidden": 64, "seed": 0, "new_option": None}, {"splits": ["train", "test"], "lr": "${x}", "e": None})
    assert config_hash(base) == config_hash(same) == config_hash(OmegaConf.to_container(same))
    for other in (cfg({"hidden": 65, "seed": 0}), cfg({"hidden": 64, "seed": 0, "new_option": 0}),
                  cfg({"hidden": 64}), cfg(data={"splits": ["test", "train"], "lr": "${x}"}),
                  cfg(data={"splits": ["train", "test"], "lr": "${y}"})):
        assert config_hash(other) != config_hash(base), other


def test_an_empty_cache_dir_is_refused(monkeypatch, tmp_path):
    """LIT_SPEC_CACHE="" would resolve paths.cache_dir to "": refused before anything is built into the working
    directory."""
    from lit_spec.config import cache_entry
    from lit_spec.errors import ConfigError
    from lit_spec.stages import find_stages

    assert cache_entry("~/x", "stage-1") == Path.home() / "x" / "stage-1"
    monkeypatch.setenv("LIT_SPEC_CACHE", "")
    monkeypatch.chdir(tmp_path)
    cfg = compose_config(["model=tiny_target"])
    assert cfg.paths.cache_dir == ""
    with pytest.raises(ConfigError, match="LIT_SPEC_CACHE"):
        find_stages(cfg)
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_cache_dir_is_refused_before_any_stage(tmp_path):
    from lit_spec.errors import ConfigError
    from lit_spec.stages import ensure_stages

    (tmp_path / "a_file").write_text("")
    cfg = compose_config(["model=tiny_target", f"paths.cache_dir={tmp_path / 'a_file' / 'cache'}"])
    with pytest.raises(ConfigError, match=r"paths\.cache_dir \(LIT_SPEC_CACHE\)=.*cannot write there"):
        ensure_stages(cfg)


def test_the_deepspeed_internals_we_use_are_there():
    """``strategies.unpartitioned_init`` steps out of an open ``zero.Init`` through DeepSpeed's private module
    functions; pyproject pins DeepSpeed to the range tested. ``strategies.load_ops`` finds an op's build directory
    (where its build lock is) as torch does, through torch's private function. An upgrade that renames them fails
    here, loudly."""
    from deepspeed.runtime.zero import partition_parameters as zero
    from deepspeed.utils import safe_get_full_fp32_param   # noqa: F401  (strategies.full_precision)
    from torch.utils.cpp_extension import _get_build_directory   # noqa: F401  (torch's: strategies.load_ops)

    assert callable(zero.shutdown_init_context) and callable(zero.restore_init_context)
    assert hasattr(zero, "top_level_context")


def test_the_installed_deepspeed_recomputes_frozen_zero3_parameters_under_checkpointing():
    """LoRA (a frozen base) under ZeRO-3 with gradient checkpointing, as the 7B-70B configs set it: DeepSpeed before
    deepspeedai/DeepSpeed#8148 (0.19.3, pyproject's floor) partitions a frozen parameter again inside the
    non-reentrant recompute, whose tensors then differ from the saved ones (torch's CheckpointError). The fix keeps
    it with the module whose backward recomputes it (``update_recompute_parameters``); an older DeepSpeed has none."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

    assert callable(getattr(coordinator, "update_recompute_parameters", None)), \
        "DeepSpeed without #8148: install deepspeed>=0.19.3 (pyproject.toml)"


def test_a_kept_composition_is_a_copy_and_an_edited_config_composes_anew(monkeypatch, tmp_path):
    """``compose_config`` keeps compositions: each call gets its own copy, and a config edited on disk is read again."""
    import shutil

    import lit_spec.config as config

    first = compose_config(["method=ar"])
    first.method.lr = -1.0
    assert compose_config(["method=ar"]).method.lr == 1e-4
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    monkeypatch.setattr(config, "CONFIG_DIR", conf)
    assert compose_config(["method=ar"]).method.lr == 1e-4
    ar = conf / "method" / "ar.yaml"
    ar.write_text(ar.read_text().replace("lr: 1e-4", "lr: 2e-4"))
    assert compose_config(["method=ar"]).method.lr == 2e-4
