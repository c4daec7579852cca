"""Every paper experiment that targets GPUs, rehearsed on 2 CPU processes as the GPU would run it: the experiment's own
strategy, precision, gradient accumulation, validation interval, speedup callback with its decoders, logger (W&B,
offline), method settings and model dtype. Only what cannot run here is swapped: the model (a micro Llama in the
experiment's dtype; a draft student, transfer layers and a draft vocabulary sized to it), the data (stdlib-code, or written trajectories
of its block size), the accelerator (cpu), the sizes (steps, records, prompts decoded), and the strategy's teardown
for one that takes the model away as a GPU's does. Experiments that come out the same after the swaps but for their
names and W&B labels (the AR baselines of four datasets, whose data is what is swapped) are rehearsed by one run. An experiment added under conf/experiment/ with a GPU trainer is
rehearsed here without editing this file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from conftest import MICRO_MODEL, selects
from lit_spec.config import compose_config, config_dir
from lit_spec.data.trajectory_data import JacobiTrajectories
from test_cllm import write_trajectories
from test_draft_distill import STUDENT
from test_sharded_training import train_cli

pytestmark = pytest.mark.distributed

OFF_DEVICE = {"lit_spec.strategies.DeepSpeedStrategy": "sharded_checks.DeepSpeedTeardownOffDevice",
              "lightning.pytorch.strategies.DDPStrategy": "sharded_checks.DDPTeardownOffDevice",
              "lit_spec.strategies.FSDPStrategy": "sharded_checks.FSDPTeardownOffDevice"}
# what a GPU run printed and a user could do nothing about (issue: "a GPU log a user can read")
NOISE = ["sync_dist=True", "is not supported by the model summary", "FutureWarning", "eval mode at the start of",
         "does not have many workers", "FLOPs not found", "that has Tensor Cores"]


def gpu_experiments() -> list[str]:
    experiments = sorted(p.stem for p in (config_dir() / "experiment").glob("*.yaml"))
    return [name for name in experiments if _composed(name) is not None]


def rehearsed_alike() -> list[list[str]]:
    """The GPU experiments grouped by the run they rehearse as: their swapped configs, less their names and labels."""
    groups: dict[str, list[str]] = {}
    for name in gpu_experiments():
        cfg = compose_config([f"+experiment={name}", *swaps(name, Path("traj"))])
        run = OmegaConf.to_container(cfg)
        for key in ("task_name", "paths"):
            run.pop(key)
        for logger in (run.get("logger") or {}).values():
            for label in ("group", "tags", "name"):
                (logger or {}).pop(label, None)
        groups.setdefault(repr(run), []).append(name)
    return list(groups.values())


def _composed(name: str):
    """The experiment's train config when it is a training run on GPUs (a benchmark experiment does not compose
    with train.yaml; a CPU quickstart is run by the other tests)."""
    try:
        cfg = compose_config([f"+experiment={name}"])
    except Exception:
        return None
    return cfg if cfg.trainer.get("accelerator") in ("gpu", "cuda") else None


def swaps(name: str, traj: Path) -> list[str]:
    """The overrides that bring experiment ``name`` to this machine: model, data (trajectories: those ``traj`` holds),
    accelerator and sizes only. The micro model keeps the dtype the experiment gives its real one (a frozen bf16 base
    beside fp32 heads, say)."""
    cfg = _composed(name)
    run = [*MICRO_MODEL, f"model.dtype={cfg.model.dtype}", "trainer.accelerator=cpu", "trainer.devices=2",
           "trainer.max_steps=4", "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false"]
    if "speedup" in cfg.callbacks:
        run += ["callbacks.speedup.num_prompts=2", "callbacks.speedup.max_new_tokens=8"]
    if issubclass(get_class(cfg.data._target_), JacobiTrajectories):
        # CLLM and Jacobi Forcing: the micro model's trajectories, in blocks of 3 (method.n_tokens must fit them)
        run += [f"data.path={traj}", "method.n_tokens=3", "data.max_context_tokens=null", "data.collect=null"]
        if "noise_window" in cfg.data:
            run.append("data.noise_window=2")
    else:
        run += ["data=stdlib_code", "data.max_train_samples=64", "data.max_eval_samples=16",
                "data.max_prompt_tokens=64", "data.max_answer_tokens=32"]
        if "collect" in cfg.data:    # the target's own answers: what collecting them asks for goes with them
            run.append("~data.collect")
    strategy = cfg.trainer.strategy
    if not isinstance(strategy, str) and strategy._target_ in OFF_DEVICE:   # the GPU's teardown: the model moved away
        run.append(f"trainer.strategy._target_={OFF_DEVICE[strategy._target_]}")
    if "stage" in cfg.model:        # a round's model is the previous round's export: the micro model instead
        run.append("~model.stage")
    if "student" in cfg.method:
        run += STUDENT
    if cfg.method.get("layers"):     # transfer layers of the micro model's 2
        run.append(f"method.layers=[{','.join(str(min(t, 2)) for t in cfg.method.layers)}]")
    if "draft_vocab_size" in cfg.method:    # EAGLE-3's pruned vocabulary, within the micro model's 512 tokens
        run.append("method.draft_vocab_size=128")
    return run


def pytest_generate_tests(metafunc):
    """Composing every experiment takes seconds: only where this tier runs (not to collect the others)."""
    if "alike" in metafunc.fixturenames:
        metafunc.parametrize("alike", rehearsed_alike() if selects(metafunc.config, "distributed") else [],
                             ids="+".join)


def test_paper_experiment_runs_as_on_gpus(alike, tmp_path):
    name, run_dir = alike[0], tmp_path / "run"
    write_trajectories(tmp_path / "traj", train=8, validation=4)     # ids < 512: read where the data is swapped for them
    metrics = train_cli(run_dir, f"+experiment={name}", *swaps(name, tmp_path / "traj"))
    assert metrics["global_step"] >= 1
    cfg = _composed(name)
    if "speedup" in cfg.callbacks:
        assert "tokens_per_s/ar" in metrics, "the speedup callback measured after a validation"
    if "wandb" in cfg.logger:
        assert list(run_dir.rglob("*.wandb")), "the W&B run was written (offline)"
    log = (tmp_path / "run.log").read_text()
    assert not [line for line in log.splitlines() if any(n in line for n in NOISE)]
