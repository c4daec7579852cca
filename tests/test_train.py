"""The AR method end to end on the micro model: training, checkpoint resume, export."""

from __future__ import annotations

import csv
import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_spec.decoding import generate
from lit_spec.errors import ConfigError, Interrupted
from lit_spec.training import run_training


def _logged(run_dir: Path, key: str) -> list[tuple[int, float]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return [(int(r["step"]), float(r[key])) for r in csv.DictReader(f) if r.get(key)]


def test_ar_loss_goes_down_and_export_loads(micro_config, tmp_path):
    """... with a strategy whose teardown takes the model away, as a GPU's moves it to the CPU: the export is taken
    while the strategy still holds it."""
    cfg = micro_config("trainer.max_steps=24", "trainer.val_check_interval=8", "method.lr=1e-2",
                       "trainer.log_every_n_steps=1",
                       "trainer.strategy={_target_: sharded_checks.SingleDeviceTeardownOffDevice, device: cpu}")
    metrics = run_training(cfg)
    run = Path(cfg.paths.output_dir)

    train = _logged(run, "train/loss")
    val = _logged(run, "val/loss")
    assert train[0][0] == 0 and len(train) == 24
    assert len(val) == 3 and val[-1][1] <= val[0][1], val
    assert val[-1][1] < train[0][1] - 0.5, (train[0], val)  # from ~ln(vocab) at step 0 to well below
    assert metrics["global_step"] == 24
    assert any(_logged(run, "train/device/items_per_sec")), "throughput (tokens/s) is logged"

    # the export is a plain transformers checkpoint in safetensors, of the trained weights (last.ckpt: step 24's)
    export = Path(cfg.export_dir)
    exported = load_file(export / "model.safetensors")
    state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert exported and all(torch.equal(v, state[f"model.{k}"]) for k, v in exported.items())
    model = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    ids = tokenizer("def add(a, b):", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=5, do_sample=False)    # transformers' greedy, as our engine's
    assert torch.equal(out, generate(model, ids, "ar", max_new_tokens=5, eos_token_id=tokenizer.eos_token_id).sequences)



def test_the_export_is_in_export_dtype_and_loads_in_it(micro_config, tmp_path):
    """``export_dtype`` sets the export's dtype (the default, the model's own, is the test above's fp32): the weights
    are cast, and plain transformers loads them in that dtype (config.json records it)."""
    cfg = micro_config("trainer.max_steps=2", "trainer.val_check_interval=2", "export_dtype=bfloat16")
    run_training(cfg)
    exported = load_file(Path(cfg.export_dir) / "model.safetensors")
    state = torch.load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, state[f"model.{k}"].bfloat16()) for k, v in exported.items())
    assert AutoModelForCausalLM.from_pretrained(cfg.export_dir, dtype="auto").dtype == torch.bfloat16

def test_resume_continues_at_the_right_step(micro_config, tmp_path):
    first = micro_config("trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.log_every_n_steps=1",
                         "method.lr=1e-2", "callbacks.model_checkpoint.every_n_train_steps=3",
                         output_dir=tmp_path / "a")
    run_training(first)
    last = Path(first.paths.output_dir) / "checkpoints" / "last.ckpt"
    assert last.is_file()
    assert torch.load(last, weights_only=True, map_location="cpu")["global_step"] == 6
    (tmp_path / "notes.ckpt").write_text("not a checkpoint")
    for overrides, message in [(["trainer.max_steps=6"], "already at step 6, and trainer.max_steps=6"),
                               (["method=medusa"], "a checkpoint of ARModule, but this run trains MedusaModule"),
                               ([f"ckpt_path={tmp_path / 'notes.ckpt'}"], "not a readable checkpoint")]:
        with pytest.raises(ConfigError, match=message):
            run_training(micro_config(f"ckpt_path={last}", *overrides, output_dir=tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()

    second = micro_config("trainer.max_steps=10", "trainer.val_check_interval=5", f"ckpt_path={last}",
                          "trainer.log_every_n_steps=1", "method.lr=1e-2", output_dir=tmp_path / "b")
    metrics = run_training(second)
    assert metrics["global_step"] == 10
    resumed = _logged(Path(second.paths.output_dir), "train/loss")
    assert len(resumed) == 4, f"resumed run trained {len(resumed)} steps, expected the 4 from step 6 to 10"
    # the weights were restored, not re-initialised: the first resumed step starts far below the initial loss
    initial = _logged(Path(first.paths.output_dir), "train/loss")[0][1]
    assert resumed[0][1] < initial - 0.3, (initial, resumed)


def _deepspeed_dir(path: Path, **state) -> Path:
    """A DeepSpeed checkpoint directory as Lightning writes it (``latest`` naming the tag ``checkpoint``), with the
    Lightning state DeepSpeed keeps beside rank 0's module states."""
    (path / "checkpoint").mkdir(parents=True)
    (path / "latest").write_text("checkpoint")
    torch.save(state, path / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    return path


def test_a_checkpoint_of_another_strategy_or_world_size_is_refused_before_work(micro_config, tmp_path):
    ar = ["ARModule"]
    zero = _deepspeed_dir(tmp_path / "zero", method=ar, global_step=2, dp_world_size=2)
    fsdp = tmp_path / "fsdp"
    fsdp.mkdir()
    torch.save({"method": ar, "global_step": 2}, fsdp / "meta.pt")
    single = tmp_path / "single.ckpt"
    torch.save({"method": ar, "global_step": 2}, single)
    (tmp_path / "empty").mkdir()
    cases = [
        (zero, [], "is a DeepSpeed checkpoint directory .* but this run's strategy resumes from a .ckpt file"),
        (fsdp, [], "is an FSDP checkpoint directory"),
        (single, ["strategy=deepspeed_zero2"], "is a .ckpt file, but this run's strategy resumes from a DeepSpeed"),
        (zero, ["strategy=fsdp", "trainer.devices=2"], "but this run's strategy resumes from an FSDP checkpoint"),
        (zero, ["strategy=deepspeed_zero3"], r"written by 2 processes.*resume with trainer.devices=2"),
        (zero, ["strategy=deepspeed_zero3", "trainer.devices=2", "method=medusa"],
         "a checkpoint of ARModule, but this run trains MedusaModule"),
        (zero, ["strategy=deepspeed_zero3", "trainer.devices=2", "trainer.max_steps=2"], "already at step 2"),
        (tmp_path / "empty", [], "a directory that holds no checkpoint"),
    ]
    for path, overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            run_training(micro_config(f"ckpt_path={path}", *overrides, output_dir=tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()


def test_errors_raised_while_building_from_config_are_not_wrapped(micro_config):
    """Hydra wraps exceptions of a ``_target_`` in InstantiationException; the user must see our message."""

    with pytest.raises(ConfigError, match="model.dtype='int8'"):
        run_training(micro_config("model.dtype=int8"))
    with pytest.raises(ConfigError, match="hub id"):
        run_training(micro_config("data=gsm8k", "data.source.hub_id=null"))


@pytest.mark.parametrize("override,message", [
    ("method.lr=-1e-3", "method.lr=-0.001: must be a number > 0"),
    ("method.betas=[0.9,1.5]", "method.betas=1.5: must be a number in"),
    ("method.scheduler=cosin", "method.scheduler='cosin': choose one of"),
    ("method.warmup_steps=-5", "method.warmup_steps=-5"),
])
def test_optimizer_settings_are_checked_when_the_method_is_built(micro_config, override, message):
    from lit_spec.config import build

    cfg = micro_config(override)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        build(cfg.method, model_spec=build(cfg.model))


class CrashAt(L.Callback):
    """Kills training at a given step, as a crash would (built from the config: ``test_train.CrashAt``)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("crash")


class TerminateAt(L.Callback):
    """Sends this process a real SIGTERM after a given step (built from the config: ``test_train.TerminateAt``)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow      # end to end: train, a real SIGTERM, resume
def test_sigterm_stops_training_non_zero_and_the_resumed_run_is_the_same_run(micro_config, tmp_path):
    """A real SIGTERM mid-epoch: training exits 143 with how to resume (no export, no metrics.json); resuming from
    its checkpoint trains on the same batches as an uninterrupted run, through the epoch boundary (8 batches an
    epoch here), so every later step's loss is the uninterrupted run's."""
    common = ["trainer.max_steps=12", "trainer.log_every_n_steps=1"]
    whole = micro_config(*common, output_dir=tmp_path / "whole")
    run_training(whole)
    cfg = micro_config(*common, "+callbacks.terminate._target_=test_train.TerminateAt",
                       "+callbacks.terminate.step=3", output_dir=tmp_path / "terminated")
    with pytest.raises(Interrupted, match=r"training stopped at step 3, before its end .*resume with "
                                          r"ckpt_path=.*interrupted\.ckpt \(SIGTERM\)") as stopped:
        run_training(cfg)
    assert stopped.value.exit_code == 143
    run = Path(cfg.paths.output_dir)
    assert not (run / "metrics.json").exists() and not (run / "export").exists()
    ckpt = run / "checkpoints" / "interrupted.ckpt"
    resumed = micro_config(*common, f"ckpt_path={ckpt}", output_dir=tmp_path / "resumed")
    assert run_training(resumed)["global_step"] == 12
    after = _logged(Path(resumed.paths.output_dir), "train/loss")
    assert [step for step, _ in after] == list(range(3, 12))
    expected = dict(_logged(Path(whole.paths.output_dir), "train/loss"))
    assert [loss for _, loss in after] == pytest.approx([expected[step] for step, _ in after], rel=1e-6)


def test_interrupted_run_leaves_a_usable_checkpoint(micro_config, tmp_path):
    crashed = micro_config("trainer.max_steps=10", "trainer.val_check_interval=5",
                           "+callbacks.crash._target_=test_train.CrashAt", "+callbacks.crash.step=7",
                           output_dir=tmp_path / "crashed")
    with pytest.raises(RuntimeError, match="crash"):
        run_training(crashed)
    ckpts = Path(crashed.paths.output_dir) / "checkpoints"
    interrupted = ckpts / "interrupted.ckpt"
    assert interrupted.is_file() and not list(ckpts.glob(".*")) and not list(ckpts.glob("*.tmp*"))
    assert torch.load(interrupted, weights_only=True, map_location="cpu")["global_step"] == 7
    assert not (Path(crashed.paths.output_dir) / "export").exists(), "no export of an unfinished run"

    resumed = micro_config("trainer.max_steps=10", "trainer.val_check_interval=5", f"ckpt_path={interrupted}",
                           output_dir=tmp_path / "resumed")
    assert run_training(resumed)["global_step"] == 10


def test_entry_points_exit_with_the_errors_code_and_one_line(capsys):
    from lit_spec.errors import one_line_errors

    for error, code in [(ConfigError("method.lr=-1: must be > 0"), 2),
                        (Interrupted("training stopped", "SIGTERM"), 143),
                        (Interrupted("collection stopped", "SIGINT"), 130)]:
        with pytest.raises(SystemExit) as stop, one_line_errors():
            raise error
        assert stop.value.code == code
        assert capsys.readouterr().err == f"error: {error}\n"
