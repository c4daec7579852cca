"""Runs beyond one plain process: DDP over 2 CPU processes (gloo), and Weights & Biases with no account (offline)."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import multiprocessing
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lit_spec.loggers import wandb_logger
from lit_spec.training import run_training


class _NoStdin:
    """Stands in for stdin: any attempt to prompt fails the test instead of waiting for an answer."""

    def __getattr__(self, name):
        raise AssertionError(f"something tried to use stdin ({name}): a prompt")


@contextlib.contextmanager
def _kill_workers_after(seconds: float):
    """A hung DDP run must fail the test, not hang the suite: past ``seconds`` the spawned workers (this process's
    multiprocessing children) are killed as they appear, and the launcher, which joins them, raises."""
    done, late = threading.Event(), threading.Event()

    def watchdog():
        if done.wait(seconds):
            return
        late.set()
        while not done.wait(0.5):
            for child in multiprocessing.active_children():
                child.kill()

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        yield
    except Exception:
        if late.is_set():
            pytest.fail(f"the DDP run did not finish in {seconds} s: its workers were killed")
        raise
    finally:
        done.set()
    if late.is_set():
        pytest.fail(f"the DDP run took more than {seconds} s")


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """W&B with no account: no key, WANDB_MODE unset; its settings and caches in tmp_path, never ~/."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    monkeypatch.setenv("NETRC", str(tmp_path / "no.netrc"))
    monkeypatch.setattr(sys, "stdin", _NoStdin())
    return tmp_path


@pytest.mark.slow
def test_ddp_spawn_on_two_cpu_processes(micro_config):
    cfg = micro_config("trainer.devices=2", "strategy=ddp_spawn")
    with _kill_workers_after(240):
        metrics = run_training(cfg)
    run = Path(cfg.paths.output_dir)

    assert metrics["global_step"] == 8, metrics
    assert json.loads((run / "metrics.json").read_text()) == metrics
    assert math.isfinite(metrics["val/loss"])

    # the data really was split over 2 ranks: an epoch took half the batches one process needs
    model_spec = instantiate(cfg.model, _convert_="all")
    datamodule = instantiate(cfg.data, _partial_=True, _convert_="all")(tokenizer=model_spec.load_tokenizer())
    datamodule.setup("fit")
    per_rank = math.ceil(math.ceil(len(datamodule.splits["train"]) / 2) / cfg.data.batch_size)
    one_process = len(datamodule.train_dataloader())
    assert 7 // per_rank != 7 // one_process, "the micro data no longer tells 1 process from 2"
    with open(run / "csv" / "metrics.csv") as f:
        last_val = [r for r in csv.DictReader(f) if r.get("val/loss")][-1]
    assert int(last_val["step"]) == 7 and int(last_val["epoch"]) == 7 // per_rank, (last_val, per_rank)
    assert torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 8

    # the export holds the trained weights (they lived only in the spawned workers) and plain transformers loads it
    export = Path(cfg.export_dir)
    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 2
    trained, initial = load_file(export / "model.safetensors"), load_file(Path(model_spec.name_or_path) /
                                                                          "model.safetensors")
    assert trained.keys() == initial.keys()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained), "exported the untrained weights"
    ids = torch.tensor([[1, 5, 9, 13]])
    assert model(input_ids=ids).logits.shape == (1, 4, model.config.vocab_size)


@pytest.mark.slow
def test_wandb_without_an_account_runs_offline(micro_config, wandb_home):
    import wandb

    cfg = micro_config("logger=wandb")
    metrics = run_training(cfg)
    assert metrics["global_step"] == 8

    runs = sorted((Path(cfg.paths.output_dir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    logs = list(runs[0].glob("run-*.wandb"))
    assert len(logs) == 1, list(runs[0].iterdir())
    # the log is written by wandb's own service process, which may still be flushing it for a moment after
    # wandb.finish() returns on a loaded machine (seen once in CI: only the header was there yet)
    deadline = time.monotonic() + 30
    while b"val/loss" not in logs[0].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"val/loss" in logs[0].read_bytes(), "the run's metrics are in the offline log, ready for `wandb sync`"
    assert wandb.run is None, "the run was finished"


def test_wandb_logger_goes_online_only_with_a_key(monkeypatch, tmp_path):
    """The decision alone: no run is started (WandbLogger creates its run lazily), nothing goes online."""
    import wandb

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)

    def decide(**kwargs):
        logger = wandb_logger(project="lit_spec", save_dir=str(tmp_path), log_model=True, **kwargs)
        assert logger._experiment is None and wandb.run is None
        return logger._offline, logger._log_model

    assert decide() == (True, False), "no key: offline, and no model upload (W&B refuses it offline)"
    monkeypatch.setenv("WANDB_MODE", "online")
    assert decide() == (True, False), "WANDB_MODE=online without a key would prompt for a login"

    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    assert decide() == (False, True), "with a key: online, the model upload as configured"
    for mode in ("offline", "disabled"):
        monkeypatch.setenv("WANDB_MODE", mode)
        assert decide() == (True, False), f"WANDB_MODE={mode} wins over the key"

    monkeypatch.delenv("WANDB_MODE")
    assert decide(offline=True) == (True, False), "an explicit logger.wandb.offline=true wins"
    assert list(tmp_path.iterdir()) == [], "deciding wrote nothing"
