"""A rank that dies mid-run, on 2 CPU processes (DDP, gloo) launched as a user launches them: SIGKILL rank 1 once a
periodic checkpoint exists; the launching rank ends within 60 s with one ``error:`` line naming the dead rank, how it
died and the checkpoint to resume from, and that checkpoint resumes (marked ``distributed``); and how the line names a
rank that NCCL's watchdog ended."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import MICRO_RUN
from lit_spec.rank_watch import how_it_ended

RUN = [*MICRO_RUN, "strategy=ddp", "trainer.devices=2", "trainer.val_check_interval=1000",
       "callbacks.model_checkpoint.every_n_train_steps=2", "callbacks.model_checkpoint.monitor=null"]


def train(run_dir: Path, *overrides: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "lit_spec.train", *RUN, *overrides, f"hydra.run.dir={run_dir}"],
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=out,
                                start_new_session=True)


def rank_one(launcher: int) -> int:
    """The training process the launcher (rank 0) started for rank 1."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    (pid,) = [int(c) for c in children if b"lit_spec.train" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return pid


@contextlib.contextmanager
def reaped(proc: subprocess.Popen):
    """A run that outlives its test is killed, with its ranks."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def last_line(proc: subprocess.Popen, log: Path) -> str:
    """The run ended with exit 1 and no traceback: its last line on stderr."""
    err = log.read_text()
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    return [line for line in err.splitlines() if line.strip()][-1]


@pytest.mark.distributed
def test_a_killed_rank_ends_the_run_in_one_line_that_names_it_and_the_checkpoint(tmp_path):
    run, log = tmp_path / "run", tmp_path / "run.err"
    with reaped(train(run, "trainer.max_steps=100000", log=log)) as proc:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "last.ckpt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(2)                                     # mid-run, between checkpoints
        dead = rank_one(proc.pid)
        os.kill(dead, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=60)
        assert time.monotonic() - killed < 60
    line = last_line(proc, log)
    checkpoint = run / "checkpoints" / "last.ckpt"
    assert line.startswith(f"error: rank 1 (pid {dead}) died (killed by SIGKILL) at step "), line
    assert line.endswith(f"so the run stopped: resume with ckpt_path={checkpoint}"), line
    assert not (run / "checkpoints" / "interrupted.ckpt").exists()

    step = torch.load(checkpoint, weights_only=False, map_location="cpu")["global_step"]
    resumed = train(run, f"trainer.max_steps={step + 2}", f"ckpt_path={checkpoint}", log=tmp_path / "resumed.err")
    assert resumed.wait(timeout=300) == 0, (tmp_path / "resumed.err").read_text()[-3000:]


@pytest.mark.distributed
def test_a_rank_killed_as_it_starts_ends_the_run_in_one_line(tmp_path):
    """Before the process group forms (Lightning's own observer would SIGKILL the launcher, silently, within 5 s)."""
    run, log = tmp_path / "run", tmp_path / "run.err"
    with reaped(train(run, "trainer.max_steps=4", log=log)) as proc:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            with contextlib.suppress(ValueError, FileNotFoundError):
                dead = rank_one(proc.pid)
                break
            time.sleep(0.05)
        os.kill(dead, signal.SIGKILL)
        proc.wait(timeout=60)
    assert last_line(proc, log) == (f"error: rank 1 (pid {dead}) died (killed by SIGKILL) at step 0, so the run "
                                    "stopped: rerun it (no checkpoint was written)")


def test_a_rank_ended_by_sigabrt_is_named_a_collective_timeout_not_a_death():
    """NCCL's watchdog ends a collective that waited past the timeout by aborting its rank: SIGABRT is a hang."""
    assert how_it_ended(-signal.SIGABRT) == ("hit a collective timeout (SIGABRT, how NCCL's watchdog ends a collective "
                                             "that waited past dist_timeout_s: a hang, not a crash)")
    assert how_it_ended(-signal.SIGKILL) == "died (killed by SIGKILL)"
    assert how_it_ended(3) == "died (exit code 3)"
