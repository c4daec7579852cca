"""A checkpoint that another supersedes is deleted where no rank waits on it: renamed aside at once, then deleted in a
thread of rank 0, after the last barrier of the save that replaced it (a sharded checkpoint, ``WholeDirectorySave``)
or as Lightning's ModelCheckpoint removes an older top-k or last one (``AtomicCheckpointIO.remove_checkpoint``). At
70B under ZeRO-3 it is terabytes on a shared filesystem, which every other rank would otherwise wait on at a barrier
or its next collective, up to the collective timeout."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import lit_spec.io
from lit_spec.checkpoints import AtomicCheckpointIO, WholeDirectorySave
from lit_spec.io import wait_for_removals


class Writer:
    """What a sharded strategy's own save does: every rank writes its part of the directory."""

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        Path(filepath).mkdir()
        (Path(filepath) / "shard").write_text(checkpoint["step"])


class Rank0(WholeDirectorySave, Writer):
    """Rank 0 of a sharded strategy, recording what the checkpoint directory holds at each barrier."""

    is_global_zero = True

    def __init__(self, directory: Path):
        self.directory, self.barriers = directory, {}

    def broadcast(self, obj):
        return obj

    def barrier(self, name: str) -> None:
        self.barriers[name] = {p.name: (p / "shard").read_text() for p in self.directory.iterdir()}


@pytest.fixture
def held_deletion(monkeypatch):
    """Deleting an ``.old-*`` path blocks until the event is set (5 s at most): whoever deletes it is held there."""
    release, remove = threading.Event(), lit_spec.io._remove

    def held(path: Path) -> None:
        if path.name.startswith(".old-") and path.exists():
            release.wait(timeout=5)
        remove(path)

    monkeypatch.setattr(lit_spec.io, "_remove", held)
    yield release
    release.set()
    wait_for_removals()


def test_a_sharded_save_deletes_the_checkpoint_it_replaces_after_its_last_barrier_in_a_thread(tmp_path,
                                                                                             held_deletion):
    rank0 = Rank0(tmp_path)
    rank0.save_checkpoint({"step": "2"}, tmp_path / "last.ckpt")
    rank0.save_checkpoint({"step": "4"}, tmp_path / "last.ckpt")
    # at the last barrier the new one is in place and the old one whole beside it, not being deleted
    assert rank0.barriers["checkpoint: in place"] == {"last.ckpt": "4", ".old-last.ckpt": "2"}
    assert (tmp_path / ".old-last.ckpt").exists(), "deleted before the save returned: Lightning's barrier waits on it"
    held_deletion.set()
    wait_for_removals()
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    assert (tmp_path / "last.ckpt" / "shard").read_text() == "4"


def test_lightnings_removal_of_a_superseded_checkpoint_sets_it_aside_and_deletes_it_in_a_thread(tmp_path,
                                                                                               held_deletion):
    """ModelCheckpoint removes an older top-k checkpoint on rank 0 (``Strategy.remove_checkpoint``), between the
    save's barrier and the other ranks' next collective (the next save's broadcast)."""
    (tmp_path / "step000002.ckpt").mkdir()
    (tmp_path / "step000002.ckpt" / "shard").write_text("2")
    AtomicCheckpointIO().remove_checkpoint(tmp_path / "step000002.ckpt")
    assert [p.name for p in tmp_path.iterdir()] == [".old-step000002.ckpt"], "set aside, its deletion under way"
    held_deletion.set()
    wait_for_removals()
    assert list(tmp_path.iterdir()) == []
