"""A rank that dies ends the run in one line. On the launching process (global rank 0 of a node, whose Lightning
launcher started the node's other ranks), from the moment they are started (so a death before the process group
forms counts too), one thread per started rank waits for its process; the moment one dies it
prints which rank, how it died, the step and the newest whole checkpoint to resume from, stops the node's other
ranks and exits 1. It must be quick: Lightning's own observer SIGKILLs the launcher (silently) within 5 s of a
child's death, and under NCCL the peers would otherwise wait for the collective timeout (``dist_timeout_s``). A rank
that learns of a lost peer from a failed collective instead (gloo: "Connection closed by peer"; another node's rank)
says so through ``lit_spec.errors.LostRank`` (``lit_spec.training``)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import lightning as L

from lit_spec.checkpoints import resume_hint

_report = threading.Lock()     # one line per process, from whichever path learns of the loss first
_started: list = []            # the node's ranks this process started (Popen), where RankWatch waits on them


def claim_report() -> bool:
    """True for the first caller only: it prints the line; a later one leaves the process to it."""
    return _report.acquire(blocking=False)


def after_a_lost_peer(seconds: float = 3.0) -> None:
    """On a failed collective: where RankWatch waits on this node's ranks, give it the time to name the dead one (it
    ends the process); then return to report it here (the ranks this process started are stopped: none is left
    waiting on a dead peer), or, if a report is under way, wait for it to end the process."""
    if _started:
        time.sleep(seconds)
    if not claim_report():
        threading.Event().wait()
    _stop(_started)


def _stop(procs: list) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()


def how_it_ended(returncode: int) -> str:
    """How a rank's process ended, as the line says it. SIGABRT is how NCCL's watchdog ends a rank whose collective
    waited past its timeout: a hang, which "died" would misname."""
    if returncode == -signal.SIGABRT:
        return ("hit a collective timeout (SIGABRT, how NCCL's watchdog ends a collective that waited past "
                "dist_timeout_s: a hang, not a crash)")
    if returncode < 0:
        return f"died (killed by {signal.Signals(-returncode).name})"
    return f"died (exit code {returncode})"


def is_lost_peer(error: BaseException) -> bool:
    """A collective that failed because a peer is gone: gloo's closed connection, NCCL's remote error or timeout."""
    text = str(error)
    return type(error).__name__ == "DistBackendError" or any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                      "remote process exited", "Timed out", "timed out"))


class RankWatch:
    """``with RankWatch(trainer, checkpoints): trainer.fit(...)``: while the fit runs, watch the ranks this process's
    launcher starts. ``checkpoints``: the directory whose newest whole checkpoint the line names."""

    def __init__(self, trainer: L.Trainer, checkpoints: str | Path):
        self.trainer, self.checkpoints, self.done = trainer, Path(checkpoints), threading.Event()

    def __enter__(self) -> "RankWatch":
        launcher = self.trainer.strategy.launcher
        if launcher is not None and hasattr(launcher, "procs") and self.trainer.num_devices > 1:
            threading.Thread(target=self._find, args=(launcher,), daemon=True, name="rank-watch").start()
        return self

    def __exit__(self, kind, error, trace) -> None:
        if error is None or not is_lost_peer(error):   # a lost peer: name the dead rank if it is one of ours
            self.done.set()                            # else: a stop (Ctrl-C kills the ranks) is not a death

    def _find(self, launcher) -> None:
        """Wait for the launcher to have started the node's other ranks (inside ``fit``), then watch each."""
        while not self.done.wait(0.05):
            procs = list(getattr(launcher, "procs", None) or [])
            if len(procs) == self.trainer.num_devices - 1:
                break
        else:
            return
        first = self.trainer.node_rank * self.trainer.num_devices
        _started[:] = procs
        for local_rank, proc in enumerate(procs, start=1):
            threading.Thread(target=self._wait, args=(procs, first + local_rank, proc), daemon=True,
                             name=f"rank-watch-{local_rank}").start()

    def _wait(self, procs: list, rank: int, proc) -> None:
        returncode = proc.wait()
        if returncode == 0 or self.done.is_set() or not claim_report():
            return
        print(f"error: rank {rank} (pid {proc.pid}) {how_it_ended(returncode)} at step "
              f"{self.trainer.global_step}, so the run stopped: {resume_hint(self.checkpoints)}", file=sys.stderr,
              flush=True)
        _stop(procs)
        os._exit(1)
