"""A full disk, met by a run as a user runs it (``python -m lit_spec.train`` on a small tmpfs): one ``error:`` line
naming the directory and the checkpoint to resume from, a non-zero exit, and no truncated or temporary file left
where a resume would look; and a checkpoint write that fails for any reason leaves the earlier file and no temporary.
The same at a DeepSpeed checkpoint on 2 processes, and while building a stage. Mounting a tmpfs needs root: CI runs
as root; elsewhere the tmpfs tests skip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import MICRO_RUN
from lit_spec.checkpoints import AtomicCheckpointIO, checkpoint_size

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"),
                                reason="mounting a small tmpfs needs root (CI runs as root)")
# a checkpoint at every second step, the newest one kept (with last.ckpt beside it)
RUN = [*MICRO_RUN, "callbacks.model_checkpoint.every_n_train_steps=2", "callbacks.model_checkpoint.monitor=null",
       "trainer.val_check_interval=8"]


def train(run_dir: Path, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", **env)
    return subprocess.run([sys.executable, "-m", "lit_spec.train", *RUN, *overrides, f"hydra.run.dir={run_dir}"],
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def checkpoint_bytes(tmp_path_factory) -> int:
    """The size of one of this run's checkpoints, from a run on a roomy disk."""
    run = tmp_path_factory.mktemp("roomy") / "run"
    assert train(run, "trainer.max_steps=2").returncode == 0
    return (run / "checkpoints" / "last.ckpt").stat().st_size


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs, and a way to fill it up to ``free`` bytes left."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode:             # root without CAP_SYS_ADMIN (a container)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")

    def leave(free: int) -> Path:
        (disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(disk).free - free))
        return disk / "run"

    yield leave
    subprocess.run(["umount", "-l", str(disk)], check=False)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines and lines[-1].startswith("error: "), result.stderr[-3000:]
    return lines[-1]


def check_left_whole(checkpoints: Path) -> list[str]:
    """No temporary file, and every checkpoint there loads: what is left is what a resume can use."""
    names = sorted(p.name for p in checkpoints.iterdir())
    assert not [n for n in names if n.startswith((".tmp-", ".old-"))], names
    for name in names:
        assert torch.load(checkpoints / name, weights_only=False, map_location="cpu")["global_step"] > 0, name
    return names


@pytest.mark.slow
@needs_root
def test_a_full_disk_at_the_first_checkpoint_is_one_line_and_leaves_nothing_truncated(small_disk, checkpoint_bytes):
    run = small_disk(free=checkpoint_bytes // 2 + 200_000)        # the logs fit; a checkpoint does not
    result = train(run, "trainer.max_steps=4")
    assert result.returncode == 1
    line = one_error_line(result)
    assert line.startswith(f"error: no space left on the device of {run / 'checkpoints'} writing step000002.ckpt"), line
    assert "at step 2" in line and "rerun it (no checkpoint was written)" in line
    assert check_left_whole(run / "checkpoints") == []
    assert not (run / "checkpoints" / "interrupted.ckpt").exists(), "no interrupted checkpoint on a full disk"


@pytest.mark.slow
@needs_root
def test_a_full_disk_later_names_the_last_whole_checkpoint_and_it_resumes(small_disk, checkpoint_bytes, tmp_path):
    run = small_disk(free=int(checkpoint_bytes * 2.5) + 200_000)  # step 2's checkpoint and last.ckpt fit; step 4's not
    result = train(run, "trainer.max_steps=6")
    assert result.returncode == 1
    line = one_error_line(result)
    assert "writing step000004.ckpt" in line and f"needs about {checkpoint_bytes / 2**20:.1f} MB" in line, line
    assert line.endswith(f"at step 4: free space there, then resume with ckpt_path={run / 'checkpoints' / 'last.ckpt'}")
    assert check_left_whole(run / "checkpoints") == ["last.ckpt", "step000002.ckpt"]

    moved = tmp_path / "moved"            # space freed elsewhere: the named checkpoint resumes the run
    shutil.copytree(run, moved)
    resumed = train(moved, "trainer.max_steps=6", f"ckpt_path={moved / 'checkpoints' / 'last.ckpt'}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]


@pytest.mark.slow
@needs_root
def test_a_full_disk_while_building_a_stage_is_one_line_and_caches_nothing(small_disk, tmp_path):
    """The tiny model's stage, written by transformers and safetensors (whose error carries the OS message only)."""
    cache = small_disk(free=40_000) / "cache"
    result = train(tmp_path / "run", "trainer.max_steps=2", LIT_SPEC_CACHE=str(cache))
    assert result.returncode == 1
    line = one_error_line(result)
    assert line.startswith(f"error: no space left on the device of {cache} writing tiny_base-"), line
    assert line.endswith("free space there, then rerun the command (it keeps what was written whole: stages, "
                         "collected parts)"), line
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []    # no stage, no temporary


def test_a_checkpoint_write_that_fails_leaves_the_earlier_file_and_no_temporary(tmp_path):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 1}, path)
    with pytest.raises(Exception):                   # a lambda cannot be pickled: torch.save fails mid-write
        AtomicCheckpointIO().save_checkpoint({"global_step": 2, "broken": lambda: None}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


SHARDED = ["strategy=deepspeed_zero2", "trainer.devices=2"]


@needs_root
@pytest.mark.distributed
def test_a_full_disk_at_a_deepspeed_checkpoint_ends_every_rank_in_its_line(small_disk, tmp_path):
    """A directory checkpoint that every rank writes (torch's own writer: no errno, only "file write failed"): each
    rank ends with the line, none waits on the others until the collective timeout, and the last whole checkpoint is
    left in place."""
    roomy = train(tmp_path / "roomy", *SHARDED, "trainer.max_steps=2")
    assert roomy.returncode == 0, roomy.stderr[-3000:]
    size = checkpoint_size(tmp_path / "roomy" / "checkpoints")
    run = small_disk(free=int(size * 2.5) + 300_000)              # step 2's checkpoint and last.ckpt fit; step 4's not
    result = train(run, *SHARDED, "trainer.max_steps=6")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = {line for line in result.stderr.splitlines() if line.startswith("error: ")}
    assert len(lines) == 1, lines                                  # the same line, from each rank that met it
    line = lines.pop()
    assert line.startswith(f"error: no space left on the device of {run / 'checkpoints'} writing step000004.ckpt")
    assert line.endswith(f"at step 4: free space there, then resume with ckpt_path={run / 'checkpoints' / 'last.ckpt'}")
    assert (run / "checkpoints" / "last.ckpt" / "latest").read_text() == (run / "checkpoints" / "step000002.ckpt"
                                                                          / "latest").read_text()
