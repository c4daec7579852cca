"""What the speedup callback costs per measurement, on 1 CPU process and on 2: the same experiment, model, prompts and
precision on one process, and on 2 (each decoding and scoring its share of the prompts and records) under DDP, ZeRO-3
decoding a plain copy of the gathered weights (``decode_copy=true``, the default where it fits) and ZeRO-3 decoding
the sharded model collectively through DeepSpeed's hooks (``decode_copy=false``). Prints one row per run: the
callback's wall time per measurement (``time/measure_s``, median over the measurements and ranks), AR's tokens/s
inside it, and the ratio to one process's time.

    python experiments/callback_cost.py --out /tmp/callback_cost [overrides for every run ...]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
from pathlib import Path

RUNS = {"1 process": ["trainer.devices=1"],
        "2, ddp": ["strategy=ddp"],
        "2, zero3 copy": ["strategy=deepspeed_zero3", "callbacks.speedup.decode_copy=true"],
        "2, zero3 collective": ["strategy=deepspeed_zero3", "callbacks.speedup.decode_copy=false"]}
COMMON = ["+experiment=cllm_quickstart", "trainer.devices=2", "trainer.precision=bf16-mixed", "trainer.max_steps=4",
          "trainer.val_check_interval=2", "callbacks.speedup.num_prompts=8", "callbacks.speedup.max_new_tokens=32"]


def column(run_dir: Path, key: str) -> list[float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args, overrides = parser.parse_known_args()
    rows = {}
    for name, strategy in RUNS.items():
        run_dir = args.out / "".join(c if c.isalnum() else "_" for c in name)
        subprocess.run([sys.executable, "-m", "lit_spec.train", *COMMON, *strategy, *overrides,
                        f"hydra.run.dir={run_dir}"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        rows[name] = (statistics.median(column(run_dir, "time/measure_s")[1:]),   # the first warms up
                      statistics.median(column(run_dir, "tokens_per_s/ar")))
    print("| processes, strategy | callback s per measurement | × 1 process's | AR tok/s inside it |\n|---|---|---|---|")
    for name, (seconds, tokens) in rows.items():
        print(f"| {name} | {seconds:.1f} | {seconds / rows['1 process'][0]:.2f} | {tokens:.0f} |")


if __name__ == "__main__":
    main()
