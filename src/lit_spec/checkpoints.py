"""How checkpoints reach the disk: whole or not at all. A ``.ckpt`` file is written beside its target and renamed
into place (``AtomicCheckpointIO``, the trainer's checkpoint plugin: Lightning's own goes through an fsspec
transaction whose temporary file lives in /tmp, so its final move can cross filesystems, a copy that a full disk
leaves truncated). A sharded checkpoint directory (DeepSpeed's, FSDP's) is written by every rank under a temporary
name and put in place by rank 0 once all have written (``WholeDirectorySave``). A superseded checkpoint is renamed
aside at once and deleted in a thread of rank 0, so no rank waits on its deletion at a collective. A full disk is one
``DiskFull`` line.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lit_spec.errors import DiskFull, is_disk_full
from lit_spec.io import atomic_file, move_old_aside, remove_in_background, swap_in


def newest_checkpoint(directory: Path) -> Path | None:
    """The newest of ``interrupted.ckpt`` and ``last.ckpt`` in ``directory`` (whole: both are written atomically)."""
    found = [p for p in (directory / "interrupted.ckpt", directory / "last.ckpt") if p.exists()]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def resume_hint(directory: Path) -> str:
    """What to do after a stop, given the run's checkpoint directory."""
    newest = newest_checkpoint(directory)
    return f"resume with ckpt_path={newest}" if newest else "rerun it (no checkpoint was written)"


def checkpoint_size(directory: Path) -> int | None:
    """The size of the largest checkpoint already in ``directory`` (what the next one will need), if any."""
    sizes = [sum(f.stat().st_size for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
             for p in directory.glob("*.ckpt")] if directory.is_dir() else []
    return max(sizes, default=None)


def _raise_if_full(error: Exception, path: Path) -> None:
    """A checkpoint write that failed on a full device is a ``DiskFull`` naming the size of the checkpoints already
    there (what this one needed). torch's own writer (DeepSpeed's files) says only "file write failed", so a device
    left with under 1 MB free counts as full too."""
    if is_disk_full(error) or shutil.disk_usage(path.parent).free < 1 << 20:
        raise DiskFull.writing(path, checkpoint_size(path.parent)) from None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO``, writing each local checkpoint file atomically (``atomic_file``)."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None or "://" in str(path):    # remote storage: Lightning's own writer
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        try:
            with atomic_file(path) as tmp, open(tmp, "wb") as f:
                torch.save(checkpoint, f)   # through a Python file: a full disk is ENOSPC, not torch's own error
        except Exception as e:
            _raise_if_full(e, path)
            raise

    def remove_checkpoint(self, path) -> None:
        """Lightning's removal of a superseded checkpoint (top-k, last), on rank 0 while the other ranks go on to their
        next collective: set aside at once, deleted in a thread (``remove_in_background``)."""
        if "://" in str(path):
            return super().remove_checkpoint(path)
        old = move_old_aside(Path(path))
        if old is not None:
            remove_in_background(old)


class WholeDirectorySave:
    """For a strategy whose checkpoint is a directory written by every rank: write it as a hidden sibling, then
    (every rank done) rank 0 renames it into place (``swap_in``), and deletes the one it replaces after the last
    barrier, in a thread. A failed or interrupted save leaves the earlier checkpoint of that name whole, and only a
    ``.tmp-*`` or ``.old-*`` directory, removed by the next save of that name."""

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        path = Path(self.broadcast(str(filepath)))
        written = path.with_name(f".tmp-{path.name}")
        if self.is_global_zero and written.exists():
            shutil.rmtree(written)
        self.barrier("checkpoint: begin")
        try:
            super().save_checkpoint(checkpoint, written, storage_options)
        except Exception as e:
            _raise_if_full(e, path)
            raise
        self.barrier("checkpoint: written")
        old = swap_in(written, path) if self.is_global_zero else None
        self.barrier("checkpoint: in place")
        if old is not None:   # in a thread: Trainer.save_checkpoint's own barrier follows this at once
            remove_in_background(old)
