"""User-facing errors: raised before work starts, printed as one line by the entry points."""

import errno
import os
import shutil
import signal
import sys
from contextlib import contextmanager
from pathlib import Path


class LitSpecError(Exception):
    """A problem the user can fix (bad path, bad field, missing hardware). The message says what and how."""

    exit_code = 2


class Interrupted(LitSpecError):
    """Work stopped by a signal (SIGTERM from ``kill``, ``timeout`` or a scheduler; SIGINT from Ctrl-C) before it
    finished: what is on disk stays valid and the message says how to resume. Exits 128 + the signal's number."""

    def __init__(self, message: str, signal_name: str):
        super().__init__(f"{message} ({signal_name})")
        self.exit_code = 128 + signal.Signals[signal_name].value


def signal_of(stop: SystemExit) -> str:
    """The signal behind Lightning's way out of a loop: ``SIGTERMException`` for SIGTERM, ``sys.exit(1)`` after a
    KeyboardInterrupt for SIGINT."""
    return "SIGTERM" if type(stop).__name__ == "SIGTERMException" else "SIGINT"


@contextmanager
def one_line_errors():
    """What every entry point does with a ``LitSpecError``, or with a full disk met anywhere: one line on stderr and
    its exit code, no traceback."""
    try:
        yield
    except Exception as e:
        if is_disk_full(e):
            e = DiskFull.of(e)
        if not isinstance(e, LitSpecError):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


class DiskFull(LitSpecError):
    """A write that found its device full. Nothing is lost by it: every file that matters is written beside its
    target and renamed into place, so the target is the last whole one or absent. ``where``: what was written where;
    ``then``: what to do (by default, rerun). Exits 1."""

    exit_code = 1
    ERRNOS = (errno.ENOSPC, errno.EDQUOT)
    RERUN = "free space there, then rerun the command (it keeps what was written whole: stages, collected parts)"

    def __init__(self, where: str, then: str | None = None):
        super().__init__(f"{where}: {then or self.RERUN}")
        self.where = where

    @classmethod
    def writing(cls, path, needed: int | None = None) -> "DiskFull":
        path = Path(path)
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
        size = f", needs about {needed / 2**20:.1f} MB" if needed else ""
        return cls(f"no space left on the device of {path.parent} writing {path.name} ({free / 2**20:.1f} MB free"
                   f"{size})")

    @classmethod
    def of(cls, error: BaseException) -> "DiskFull":
        """``error`` (a full disk, ``is_disk_full``) as a ``DiskFull``; one that is not names the writer's message."""
        if isinstance(error, DiskFull):
            return error
        return cls(f"no space left on a device ({(str(error).strip().splitlines() or [''])[0][:200]})")


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error``, or one it came from, is a full device: an ``OSError`` with ENOSPC or EDQUOT, or a writer's
    own error that says so (safetensors' and others' carry the OS message, not the errno)."""
    marks = tuple(os.strerror(n) for n in DiskFull.ERRNOS) + ("os error 28",)
    while error is not None:
        if isinstance(error, DiskFull) or (isinstance(error, OSError) and error.errno in DiskFull.ERRNOS) or any(
                mark in str(error) for mark in marks):
            return True
        error = error.__cause__ or error.__context__
    return False


class LostRank(LitSpecError):
    """A rank of a multi-process run died (or its connection did): the run stops, saying where to resume. Exits 1."""

    exit_code = 1


class ConfigError(LitSpecError):
    """A config value that cannot work."""


class DataError(LitSpecError):
    """A dataset that is missing, empty or lacks the columns its template needs."""


def check_count(name: str, value, minimum: int = 1, optional: bool = False) -> int | None:
    """An integer setting >= ``minimum`` (bools, strings and non-integral floats refused; null too unless
    ``optional``), or a ConfigError naming it."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < minimum:
        raise ConfigError(f"{name}={value!r}: must be an integer >= {minimum}" + (" (or null)" if optional else ""))
    return int(value)
