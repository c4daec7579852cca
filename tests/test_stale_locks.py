"""What a killed process leaves behind does not stop the next run: a torch extension build lock (``FileBaton``) left
by a lit_spec process killed while loading a DeepSpeed op, on which DeepSpeed's own load would wait forever, is
removed. One that may be a live build of another node sharing the home directory (another host's record, or no
record at all) is left, with one warning saying how to remove it by hand."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.cpp_extension import _get_build_directory

from lit_spec.strategies import HOLDER, clear_stale_baton, load_ops

# each prints "loading" once past its imports (seconds), then takes the baton's path as its argument
WAIT = "from deepspeed.comm.torch import build_shm_op; print('loading', flush=True); build_shm_op()"   # DeepSpeed's
HOLD = ("import pathlib, sys, time; from lit_spec.strategies import holding_baton; build = pathlib.Path(sys.argv[1]); "
        "holding = holding_baton(build); holding.__enter__(); (build / 'lock').touch(); print('loading', flush=True); "
        "time.sleep(600)")   # lit_spec's record and the baton, held until the process is killed


@pytest.fixture
def op_build() -> Path:
    """The shared-memory op's build directory, the op built (a few seconds, once; then cached on disk), no baton."""
    load_ops(["ShareMemCommBuilder"])
    op_dir = Path(_get_build_directory("deepspeed_shm_comm", verbose=False))   # where DeepSpeed builds it too
    yield op_dir
    for name in ("lock", HOLDER):
        (op_dir / name).unlink(missing_ok=True)


def started(code: str, build: Path) -> subprocess.Popen:
    """A Python process running ``code``, returned once past its imports (DeepSpeed prints to stdout before)."""
    proc = subprocess.Popen([sys.executable, "-c", code, str(build)], stdout=subprocess.PIPE, text=True)
    assert "loading\n" in iter(proc.stdout.readline, ""), f"{code} ended before it loaded anything"
    return proc


def still_running(proc: subprocess.Popen, seconds: float = 5) -> bool:
    """``proc`` has not ended ``seconds`` after its imports (then it is killed)."""
    try:
        proc.wait(timeout=seconds)
        return False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return True


@pytest.mark.slow
def test_a_build_lock_left_by_a_killed_process_of_ours_is_removed_not_waited_on(op_build, caplog):
    build = op_build
    holder = started(HOLD, build)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (build / "lock").exists() and (build / HOLDER).read_text().split() == [socket.gethostname(),
                                                                                   str(holder.pid)]
    assert still_running(started(WAIT, build)), \
        "DeepSpeed's own load no longer waits on a stale lock: this test no longer tests anything"
    with caplog.at_level(logging.WARNING, logger="lit_spec.strategies"):
        load_ops(["ShareMemCommBuilder"])
    assert not (build / "lock").exists() and not (build / HOLDER).exists()
    assert f"removed {build / 'lock'}, a build lock left by pid {holder.pid} of this host" in caplog.text


@pytest.mark.parametrize("record, holder", [("node-b 4242", "pid 4242 on node-b"),
                                            (None, "no lit_spec process (no holder record)")])
def test_a_build_lock_another_node_may_hold_is_left_with_a_warning(tmp_path, caplog, record, holder):
    """Another host's record, or none (another program's build): it may be building now, under a shared home."""
    build = tmp_path
    (build / "lock").touch()
    if record:
        (build / HOLDER).write_text(record)
    with caplog.at_level(logging.WARNING, logger="lit_spec.strategies"):
        clear_stale_baton(build)          # load_ops' first step; its op.load() would then wait on the baton
    assert (build / "lock").exists()
    baton = build / "lock"
    assert caplog.messages == [f"waiting on {baton}, a torch build lock held by {holder}: if no build is running "
                               f"there, it is stale; remove it by hand (rm {baton})"]
