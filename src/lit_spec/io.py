"""Atomic writes: work that matters is written under a temporary name, then renamed into place; what it replaces is
renamed aside first, and deleted then or, where others must not wait on it, in a thread (``remove_in_background``)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator

from lit_spec.errors import ConfigError, DiskFull, is_disk_full

log = logging.getLogger(__name__)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; once written it is fsynced and renamed onto ``path`` (one
    rename within its directory: readers find the old file or the new one, never part of one). On any failure it is
    deleted; a full device raises ``DiskFull`` naming the directory."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
        os.close(fd)
    except OSError as e:
        _raise_disk_full(e, path)
        raise
    try:
        yield Path(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:
        _raise_disk_full(e, path)
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _raise_disk_full(error: Exception, path: Path) -> None:
    if is_disk_full(error) and not isinstance(error, DiskFull):
        raise DiskFull.writing(path) from None


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; on success it replaces ``path`` (``replace_dir``).

    An interrupted writer leaves only a ``.tmp-*`` sibling behind, never a half-written ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    try:
        yield tmp
        replace_dir(tmp, path)
    except Exception as e:
        _raise_disk_full(e, path)
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(written: Path, path: Path) -> None:
    """Put ``written`` (a whole directory, or file, beside ``path``) in place of ``path`` (``swap_in``), then delete
    the old one."""
    old = swap_in(written, path)
    if old is not None:
        _remove(old)


def swap_in(written: Path, path: Path) -> Path | None:
    """Put ``written`` in place of ``path`` by renames only, so ``path`` is at every moment the old one, absent for an
    instant, or the new one, never a mix. Returns where the old one now is (``move_old_aside``), for the caller to
    delete."""
    old = move_old_aside(path)
    os.replace(written, path)
    return old


def move_old_aside(path: Path) -> Path | None:
    """Rename ``path`` to its hidden sibling ``.old-<name>`` (one rename, however large it is) and return that; None
    where there is no ``path``. An earlier ``.old-<name>`` is deleted first (this process may still be deleting it:
    waited for; else a killed process left it)."""
    old = path.with_name(f".old-{path.name}")
    deleting = _deleting.pop(os.path.abspath(old), None)
    if deleting is not None:
        deleting.join()
    _remove(old)
    if not (path.exists() or path.is_symlink()):
        return None
    os.replace(path, old)
    return old


_deleting: dict[str, threading.Thread] = {}    # what remove_in_background is deleting: its absolute path -> thread


def remove_in_background(path: Path) -> None:
    """Delete ``path`` in a thread: a superseded sharded checkpoint is terabytes at 70B, which the other ranks would
    wait on at their next collective, up to its timeout. Not a daemon: the process ends once it is deleted."""
    thread = threading.Thread(target=_remove_or_warn, args=(path,), name=f"remove {path.name}")
    _deleting[os.path.abspath(path)] = thread
    thread.start()


def wait_for_removals() -> None:
    """Return once every ``remove_in_background`` of this process has ended."""
    while _deleting:
        _deleting.popitem()[1].join()


def _remove_or_warn(path: Path) -> None:
    try:
        _remove(path)
    except OSError as error:     # in a thread: a warning, not a traceback
        log.warning("could not delete %s (%s): delete it by hand", path, error)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def launch_rank() -> int:
    """This process's rank in a multi-process launch (torchrun's RANK, Lightning's LOCAL_RANK for the processes it
    starts); 0 alone."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


@contextlib.contextmanager
def one_writer(path: str | os.PathLike, what: str, wait: bool = False,
               advice: str = "wait for it to finish, then rerun this command (it resumes or finds it done)"
               ) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created, holding the holder's pid) while writing ``what``.
    Another holder: wait for it (``wait``), or a ConfigError naming it and giving ``advice``. Only rank 0 of a
    multi-process launch locks (its other ranks write what rank 0 dealt them)."""
    if launch_rank() != 0:
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
                raise ConfigError(f"{what} is being written by another process ({holder}); {advice}") from None
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


def set_aside(path: str | os.PathLike) -> Path:
    """Rename ``path`` to ``<name>.damaged`` (``.damaged-1``, ... if taken), keeping it for inspection."""
    path = Path(path)
    aside, n = path.with_name(f"{path.name}.damaged"), 0
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.damaged-{n}")
    os.replace(path, aside)
    return aside


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_writable(directory: str | os.PathLike, what: str) -> None:
    """A ConfigError naming ``what`` (the setting that chose ``directory``) when the directory cannot be created or
    written in: raised before work starts, not when its first output is due. Creates nothing: the nearest existing
    directory on the path is tried with a temporary file."""
    directory = Path(directory).expanduser().absolute()
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{existing} is a file")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"{what}={directory}: cannot write there ({e.strerror or e}); choose a writable "
                          "directory") from None


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` atomically (``atomic_file``)."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON atomically (temporary file + rename)."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")
