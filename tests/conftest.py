"""Shared fixtures: a private stage cache, composed configs with a temporary output dir, a micro tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import DictConfig, open_dict

# No network in tests, and W&B never goes online: set before transformers/datasets/wandb read them at import. One torch
# thread per process: the unit tier runs 2 workers on 2 cores, the other tiers 2-process runs, and micro models' small
# matmuls slow down many times over when threads outnumber the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ.pop("WANDB_API_KEY", None)

from lit_spec.config import compose_config  # noqa: E402

# A micro Llama (tiny.yaml shape, shrunk) and a small data budget: each training test runs in seconds.
MICRO_MODEL = ["model=tiny", "model.vocab_size=512", "model.hidden_size=32", "model.intermediate_size=64",
               "model.num_hidden_layers=2", "model.num_attention_heads=2", "model.num_key_value_heads=2"]
# the AR baseline on stdlib-code (the default is CLLM on collected trajectories; tests/test_cllm.py runs that)
MICRO_RUN = MICRO_MODEL + ["method=ar", "data=stdlib_code", "callbacks=default", "data.max_train_samples=64",
                           "data.max_eval_samples=16", "data.batch_size=8", "data.max_prompt_tokens=64",
                           "data.max_answer_tokens=64", "trainer.max_steps=8", "trainer.val_check_interval=4", "trainer.num_sanity_val_steps=0",
                           "trainer.enable_progress_bar=false", "method.lr=3e-3", "callbacks.throughput.window_size=2"]


def selects(config, marker: str) -> bool:
    """Whether the run's ``-m`` expression selects tests marked ``marker`` (and nothing else)."""
    from _pytest.mark.expression import Expression     # how pytest itself evaluates -m

    expression = config.option.markexpr
    return not expression or Expression.compile(expression).evaluate(lambda name, **_: name == marker)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The slow and serving tiers run without xdist workers: their tests start processes of their own (sandboxes
    counted machine-wide, vLLM). The distributed tier keeps 2 workers, handed tests one at a time (not a module per
    worker: nearly all are in one): a 2-rank run keeps about one core busy (each rank's imports run alone, then the
    ranks wait on each other), so two at once took 188 s where one at a time took 264 s (10 bf16 cases, 2 cores)."""
    if not hasattr(config.option, "numprocesses"):
        return
    if any(selects(config, tier) for tier in ("slow", "serving")):
        config.option.numprocesses = 0
    elif selects(config, "distributed") and config.option.numprocesses:
        config.option.dist = "worksteal"


@pytest.fixture(scope="session", autouse=True)
def stage_cache(tmp_path_factory) -> Path:
    """Every test builds stages (tiny model, tiny target) into one private cache, never the user's, and ``datasets``
    caches what it reads or generates (the stdlib corpus, parsed once a run) in another: in this process and in every
    process a test starts."""
    import datasets

    cache = tmp_path_factory.mktemp("lit_spec_cache")
    os.environ["LIT_SPEC_CACHE"] = str(cache)
    # one datasets cache for the run's xdist workers: the stdlib corpus is parsed once, not once a worker (datasets
    # locks a cache entry while it is written, so a second worker waits and reads it)
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    (shared / "hf_datasets").mkdir(exist_ok=True)
    os.environ["HF_DATASETS_CACHE"] = str(shared / "hf_datasets")
    datasets.config.HF_DATASETS_CACHE = Path(os.environ["HF_DATASETS_CACHE"])
    return cache


def make_config(output_dir: Path, overrides=()) -> DictConfig:
    """``conf/train.yaml`` composed with overrides, writing into ``output_dir`` (no Hydra run dir outside an app)."""
    cfg = compose_config(list(overrides))
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
    return cfg


@pytest.fixture
def micro_config(tmp_path):
    """Factory: a micro AR run's config in ``tmp_path/run``, plus any overrides."""

    def build(*overrides: str, output_dir: Path | None = None) -> DictConfig:
        return make_config(output_dir or tmp_path / "run", [*MICRO_RUN, *overrides])

    return build


def hold_lock(path: Path, seconds: float) -> subprocess.Popen:
    """Another process holding ``one_writer``'s lock on ``path`` for ``seconds`` (returns once it holds it)."""
    code = (f"import time\nfrom lit_spec.io import one_writer\nwith one_writer({str(path)!r}, 'x'):\n"
            f"    print('held', flush=True)\n    time.sleep({seconds})\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


# ---- decoding tests -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    """One small random model per architecture (tests/random_models.py), shared by a test module."""
    from random_models import ARCHS, random_model

    return {arch: random_model(arch) for arch in ARCHS}


def built_spec(overrides=(), config_name: str = "train"):
    """The model spec of a composed config, the model's stages (the tiny model, ...) built first."""
    from lit_spec.config import build
    from lit_spec.stages import ensure_stages

    cfg = compose_config(list(overrides), config_name)
    ensure_stages(cfg.model)
    return build(cfg.model)


@pytest.fixture(scope="session")
def micro_dirs():
    """Target and draft: two micro tiny models (same tokenizer, different seeds and sizes), built into the cache."""
    target, draft = built_spec(MICRO_MODEL), built_spec([*MICRO_MODEL, "model.seed=1", "model.num_hidden_layers=1"])
    return target.name_or_path, draft.name_or_path


# ---- method modules without a trainer ------------------------------------------------------------------------------
def built_method(cfg: DictConfig):
    """The method module of a run config (model loaded by ``configure_model``) and its set-up datamodule."""
    from lit_spec.config import build
    from lit_spec.stages import ensure_stages

    ensure_stages(cfg)
    spec = build(cfg.model)
    datamodule = build(cfg.data, tokenizer=spec.load_tokenizer())
    datamodule.setup("fit")
    module = build(cfg.method, model_spec=spec)
    module.configure_model()
    return module, datamodule


def heads_training_step(module, batch: dict) -> tuple[float, list[bool]]:
    """One AdamW step of a frozen-base method (``module.heads`` trainable, ``module.model`` frozen): checks that only
    the heads can train and that the base, embeddings included, got no gradient and did not change; returns the loss
    and, per heads tensor, whether it changed."""
    import torch

    module.train()
    assert not module.model.training                      # the frozen base runs without dropout
    base = {k: v.clone() for k, v in module.model.state_dict().items()}
    heads = {k: v.clone() for k, v in module.heads.state_dict().items()}
    trainable = [p for p in module.parameters() if p.requires_grad]
    assert trainable and all(any(p is q for q in module.heads.parameters()) for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    loss = module.training_step(batch, 0)
    loss.backward()
    optimizer.step()
    assert all(p.grad is None for p in module.model.parameters())
    assert all(torch.equal(v, base[k]) for k, v in module.model.state_dict().items())
    return loss.item(), [not torch.equal(v, heads[k]) for k, v in module.heads.state_dict().items()]


def draft_step_on(fn, draft, engine: str):
    """A draft's ``DraftStep`` (EAGLE-3's, DFlash's) on ``engine``; ``padded`` runs the fast path's padded widths
    through a step whose compiling is skipped (the real compile runs in the slow tier)."""
    from lit_spec.decoding.draft_step import DraftStep
    step = DraftStep(fn, draft, "compiled" if engine == "padded" else engine, draft.kind)
    if engine == "padded":
        step._run = fn
    return step


def static_draft_layers(draft, attentions) -> list:
    """The fast path's static layers of 256 positions for a draft's attention modules."""
    from lit_spec.decoding import cache as kv
    return [kv.static_layer(attention, 256, next(draft.parameters())) for attention in attentions]
