"""Executing model answers (issue #29): at every isolation level that claims to stop an attack, a program that tries it
does not reach outside. Each attacking program *passes* only if its attack worked, so ``passed`` is the breach.

The kernel levels run where the machine allows them (``bwrap``: bubblewrap installed; ``nobody``: tests run as root,
as CI does); the ``guard`` level is also run the way an ordinary user meets it, in a child process that drops to
``nobody`` first. The honest checks hold at each: HumanEval's canonical solutions pass, wrong answers fail.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from lit_spec.data import execution
from lit_spec.data.execution import ISOLATION, NOBODY, run_program, run_tests, works
from test_humaneval import problems  # noqa: F401  (HumanEval's 164 problems, a module fixture)


KERNEL_LEVELS = [pytest.param(level, marks=pytest.mark.skipif(not works(level), reason=f"{level} not available"))
                 for level in ("bwrap", "namespaces", "nobody")]
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")
# what the nobody level (root, no namespaces but the network's) lets through: world-writable directories,
# world-readable files and other processes' command lines; the other kernel levels let nothing through
NOBODY_GAPS = {f"write {d}" for d in WORLD_WRITABLE} | {"read a world-readable file", "see the caller's process"}


@pytest.fixture
def caller(tmp_path):
    """What the caller owns: a private directory (as pytest makes it), a 0600 secret in it, a world-readable file in a
    world-readable directory, a listener on loopback, its own process."""
    secret = tmp_path / "secret"
    secret.write_text("the caller's secret")
    secret.chmod(0o600)
    public = Path(tempfile.mkdtemp(dir="/var/tmp")) / "public"
    public.parent.chmod(0o755)
    public.write_text("the caller's notes")
    public.chmod(0o644)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    yield {"dir": tmp_path, "secret": secret, "public": public, "port": listener.getsockname()[1], "pid": os.getpid()}
    listener.close()
    shutil.rmtree(public.parent)


def attacks(caller: dict) -> dict[str, tuple[str, Path | None]]:
    """name -> (a program, the file it would leave outside). Without a file, the program ends normally only if the
    attack worked; with one, the file left outside is the breach."""
    out, token = caller["dir"], secrets.token_hex(4)
    writes = {f"write {d}": (f"import _io\n_io.FileIO('{d}/lit_spec_probe_{token}', 'w').write(b'x')\n",
                             Path(f"{d}/lit_spec_probe_{token}")) for d in WORLD_WRITABLE}
    return {
        "posix.system": (f"import posix\nassert posix.system('touch {out / 'system'}') == 0\n"
                         f"assert posix.stat({str(out / 'system')!r})\n", out / "system"),
        "_io.FileIO": (f"import _io\n_io.FileIO({str(out / 'fileio')!r}, 'w').write(b'x')\n", out / "fileio"),
        "fork+exec": (f"import posix\npid = posix.fork()\nif pid == 0:\n"
                      f"    posix.execv('/usr/bin/touch', ['touch', {str(out / 'forked')!r}])\n"
                      f"assert posix.waitpid(pid, 0)[1] == 0\nassert posix.stat({str(out / 'forked')!r})\n",
                      out / "forked"),
        **writes,
        "read a 0600 file": (f"assert open({str(caller['secret'])!r}).read() == \"the caller's secret\"\n", None),
        "read a world-readable file": (f"assert open({str(caller['public'])!r}).read() == \"the caller's notes\"\n",
                                       None),
        "see the caller's process": (f"assert open('/proc/{caller['pid']}/cmdline', 'rb').read()\n", None),
        "signal the caller": (f"import posix\nposix.kill({caller['pid']}, 0)\n", None),     # 0: may it signal?
        "connect to loopback": (f"import socket\nsocket.create_connection(('127.0.0.1', {caller['port']}), "
                                "timeout=2).close()\n", None),
    }


def breached(made: dict[str, tuple[str, Path | None]], passed: dict[str, bool]) -> set[str]:
    """The attacks of ``made`` that reached outside, given whether each program passed; their files removed."""
    through = {name for name, (_, left) in made.items() if (left.exists() if left is not None else passed[name])}
    for _, left in made.values():
        if left is not None:
            left.unlink(missing_ok=True)
    return through


def attempt(caller: dict, level: str) -> set[str]:
    """Every attack on ``caller`` at ``level``: the names of those that reached outside."""
    made = attacks(caller)
    return breached(made, {name: run_program(program, timeout=10, isolation=level).passed
                           for name, (program, _) in made.items()})


@pytest.mark.parametrize("level", KERNEL_LEVELS)
def test_a_program_cannot_reach_outside(level, caller):
    through = attempt(caller, level)
    assert through == (NOBODY_GAPS if level == "nobody" else set()), f"{level}: {sorted(through)} reached outside"
    assert caller["secret"].read_text() == "the caller's secret"


def test_the_guard_level_stops_none_of_it(caller):
    """The honest baseline: the Python guard is walked around (why the kernel levels exist), and the level says so."""
    through = attempt(caller, "guard")
    assert through == set(attacks(caller)), sorted(set(attacks(caller)) - through)     # every one of them
    assert ISOLATION["guard"].startswith("NOT ISOLATED") and "bubblewrap" in ISOLATION["guard"]


BOMBS = {
    "fork bomb": "import posix\nwhile True:\n    try:\n        posix.fork()\n    except OSError:\n        pass\n",
    "memory bomb": "chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))\n",
    "output flood": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
}


def _nobody_processes() -> int:
    out = subprocess.run(["ps", "-u", str(NOBODY), "-o", "pid="], capture_output=True, text=True).stdout
    return len(out.split())


@pytest.mark.slow
@pytest.mark.parametrize("level", KERNEL_LEVELS)
def test_bombs_end_with_the_program_and_leave_nothing_running(level):
    before = _nobody_processes()
    for name, program in BOMBS.items():
        start = time.perf_counter()
        result = run_program(program, timeout=5, memory_mb=512, isolation=level)
        assert not result.passed, name
        assert time.perf_counter() - start < 30, f"{name} outlived its timeout"
        deadline = time.monotonic() + 5                     # a killed process takes a moment to exit
        while _nobody_processes() > before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _nobody_processes() <= before, f"{level}: {name} left processes running"


def test_output_goes_to_size_limited_files(tmp_path):
    """A flood is cut at OUTPUT_BYTES by the file-size limit, whatever the level (Python ignores SIGXFSZ: the write
    fails with EFBIG): it ends there, not at its timeout, and nothing of it accumulates in the caller."""
    result = run_program(BOMBS["output flood"], timeout=20, isolation="guard")
    assert result.reason == "OSError"


def _honest(chosen: list[dict], level: str | None) -> tuple[int, int]:
    right = [f"```python\n{p['prompt']}{p['canonical_solution']}```" for p in chosen]
    wrong = [f"```python\ndef {p['entry_point']}(*args, **kwargs):\n    return None\n```" for p in chosen]
    return (sum(r.passed for r in run_tests(right, chosen, isolation=level)),
            sum(r.passed for r in run_tests(wrong, chosen, isolation=level)))


@pytest.mark.slow
def test_every_canonical_solution_passes_and_every_wrong_answer_fails_at_the_chosen_level(problems):  # noqa: F811
    assert _honest(problems, None) == (len(problems), 0), execution.describe_isolation()


@pytest.mark.parametrize("level", [*KERNEL_LEVELS, "guard"])
def test_honest_answers_are_judged_alike_at_every_level(level, problems):  # noqa: F811
    chosen = problems[::20]                       # 9 problems a level (the slow tier runs all 164 at one)
    assert _honest(chosen, level) == (len(chosen), 0)


@pytest.fixture
def users_caller(caller):
    """``caller`` as an ordinary user (``nobody``) owns it: a private directory and secret where that user can reach
    them (under /var/tmp), one of that user's processes."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    home = Path(tempfile.mkdtemp(dir="/var/tmp"))
    secret = home / "secret"
    secret.write_text("the caller's secret")
    secret.chmod(0o600)
    for path in (home, secret):
        os.chown(path, NOBODY, NOBODY)
    sleeper = subprocess.Popen(["sleep", "600"], user=NOBODY, group=NOBODY, extra_groups=[])
    yield {**caller, "dir": home, "secret": secret, "pid": sleeper.pid}
    sleeper.kill()
    sleeper.wait()
    shutil.rmtree(home)


def as_an_ordinary_user(caller: dict, namespaces: bool) -> tuple[dict, str]:
    """The attacks on ``caller``, honest answers and bombs run by the harness of this checkout as an ordinary user
    meets it: a child that drops to ``nobody`` first (neither bwrap nor the root route is open to it), on the system's
    python3. ``namespaces=False``: as on a kernel that allows no user namespaces (the launcher cannot start).
    Returns its report (level, breached attacks, honest results, bombs) and its stderr."""
    python = execution.sandbox_python(True)
    source = Path(execution.__file__).resolve().parents[2]
    if python is None or not execution._world_executable(python) or not all(
            os.stat(d).st_mode & 0o005 == 0o005 for d in (source, *source.parents)):
        pytest.skip("this checkout or a python3 is not readable by nobody")
    made = attacks(caller)
    code = textwrap.dedent(f"""
        import importlib.util, json, logging, os, shutil, sys
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        sys.path.insert(0, {str(source)!r})
        shutil.which = lambda name, *a, **k: None            # as on a machine without bubblewrap
        spec = importlib.util.spec_from_file_location("execution", {str(Path(execution.__file__))!r})
        ex = sys.modules["execution"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ex)
        if not {namespaces}:
            ex.NAMESPACES = "/nonexistent/namespaces.py"
        programs, bombs = {({n: p for n, (p, _) in made.items()})!r}, {BOMBS!r}
        print(json.dumps({{"level": ex.isolation_level(), "uid": os.getuid(),
                           "passed": {{n: ex.run_program(p, timeout=10).passed for n, p in programs.items()}},
                           "honest": [ex.run_program("assert 1 + 1 == 2").passed,
                                      ex.run_program("assert 1 + 1 == 3").passed],
                           "bombs": {{n: ex.run_program(p, timeout=5, memory_mb=512).passed for n, p in bombs.items()}}}}))
    """)
    done = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=300, cwd="/",
                          user=NOBODY, group=NOBODY, extra_groups=[])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["uid"] == NOBODY
    assert report["honest"] == [True, False]
    assert not any(report["bombs"].values()), report["bombs"]
    return {**report, "through": breached(made, report["passed"])}, done.stderr


@pytest.mark.slow
def test_an_ordinary_user_without_bubblewrap_gets_namespaces_and_nothing_reaches_outside(users_caller):
    report, _ = as_an_ordinary_user(users_caller, namespaces=True)
    assert report["level"] == "namespaces"
    assert report["through"] == set(), sorted(report["through"])
    assert users_caller["secret"].read_text() == "the caller's secret"


@pytest.mark.slow
def test_an_ordinary_user_without_namespaces_gets_the_guard_and_a_warning(users_caller):
    """Where the kernel allows no user namespace: the guard, said so; the attacks get through (they are real)."""
    report, stderr = as_an_ordinary_user(users_caller, namespaces=False)
    assert report["level"] == "guard"
    assert report["through"] == set(attacks(users_caller)), sorted(set(attacks(users_caller)) - report["through"])
    assert "without isolation" in stderr and "apt-get install bubblewrap" in stderr


@pytest.mark.slow
@pytest.mark.parametrize("level", KERNEL_LEVELS)
def test_a_fork_bomb_does_not_fail_the_answers_run_beside_it(level, problems):  # noqa: F811
    """The process limit is the uid's, shared by the programs running side by side: while a bomb holds it, the
    others wait for a sandbox (they never ran) instead of failing."""
    chosen = problems[:6]
    answers = [f"```python\n{BOMBS['fork bomb']}```"] + [f"```python\n{p['prompt']}{p['canonical_solution']}```"
                                                          for p in chosen[1:]]
    results = run_tests(answers, chosen, timeout=5, isolation=level, workers=2)
    assert not results[0].passed and [r.reason for r in results[1:]] == ["passed"] * 5


@pytest.mark.parametrize("level", [*KERNEL_LEVELS, "guard"])
def test_a_program_can_neither_forge_a_pass_nor_pose_as_a_broken_sandbox(level):
    """The nonce that marks a pass is not in the program's environment (/proc shows that), and a program that writes
    what bubblewrap writes when it cannot start is judged, not retried or raised."""
    steal = ("import os, sys\nenv = dict(v.split('=', 1) for v in open('/proc/self/environ').read().split('\\0') if v)\n"
             "print(*[v for v in env.values() if len(v) == 32], sep='\\n')\nsys.stdout.flush()\nos._exit(0)\n")
    assert run_program(steal, isolation=level).reason == "failed"
    pose = "import sys\nsys.stderr.write('bwrap: Resource temporarily unavailable\\n')\nsys.exit(1)\n"
    assert run_program(pose, isolation=level).reason == "failed"
