"""Atomic writes: work that matters is written under a temporary name, then renamed into place."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from lit_spec.errors import ConfigError

log = logging.getLogger(__name__)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; on success it replaces ``path`` in one rename.

    An interrupted writer leaves only a ``.tmp-*`` sibling behind, never a half-written ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def one_writer(path: str | os.PathLike, what: str, wait: bool = False) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created, holding the holder's pid) while writing ``what``.
    Another holder: wait for it (``wait``), or a ConfigError naming it. Only rank 0 of a multi-process launch
    locks (its other ranks write what rank 0 dealt them)."""
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))) != 0:
        yield
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "pid unknown"
            if not wait:
                raise ConfigError(f"{what} is being written by another process ({holder}); wait for it to finish, "
                                  "then rerun this command (it resumes or finds it done)") from None
            log.info("%s is being written by another process (%s): waiting for it", what, holder)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_writable(directory: str | os.PathLike, what: str) -> None:
    """A ConfigError naming ``what`` (the setting that chose ``directory``) when the directory cannot be created or
    written in: raised before work starts, not when its first output is due."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise ConfigError(f"{what}={directory}: cannot write there ({e.strerror or e}); choose a writable "
                          "directory") from None


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` atomically (temporary file in the same directory, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON atomically (temporary file + rename)."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")
