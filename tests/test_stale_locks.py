"""What a killed process leaves behind does not stop the next run: a torch extension build lock (``FileBaton``) left
by a process killed while loading a DeepSpeed op, on which DeepSpeed's own load would wait forever."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from torch.utils.cpp_extension import get_default_build_root

from lit_spec.strategies import load_ops

LOAD = "from lit_spec.strategies import load_ops; load_ops(['ShareMemCommBuilder'])"
WAIT = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"   # DeepSpeed's own load, for contrast


def test_a_build_lock_left_by_a_killed_process_is_removed_not_waited_on():
    load_ops(["ShareMemCommBuilder"])       # built once (a few seconds), then cached on disk
    (op_dir,) = Path(get_default_build_root()).glob("*/deepspeed_shm_comm")
    baton = op_dir / "lock"
    baton.touch()
    try:
        try:
            subprocess.run([sys.executable, "-c", WAIT], timeout=15, capture_output=True)
            waited = False
        except subprocess.TimeoutExpired:
            waited = True
        loaded = subprocess.run([sys.executable, "-c", LOAD], timeout=120, capture_output=True, text=True)
        left = baton.exists()
    finally:
        baton.unlink(missing_ok=True)
    assert waited, "DeepSpeed's own load no longer waits on a stale lock: this test no longer tests anything"
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert not left
    assert f"removed {baton}, a build lock left by a killed process" in loaded.stderr
