"""What a checkpoint and an export weigh, and rank 0's peak RSS while exporting, on 2 CPU processes: AR (a full
fine-tune, whose export is the whole model) under ZeRO-3, and heads on a frozen base (Chimera under ZeRO-3, Medusa
under FSDP2), on the tiny target and on SmolLM2-135M. Each run trains 2 steps and checkpoints at step 2. Rank 0's
peak is the kernel's high-water mark from the end of fit (reset there through /proc/self/clear_refs) to the process's
exit: the export's own. Run it from a checkout to measure that checkout (a git worktree of an older commit: before).

    python experiments/export_cost.py --out /tmp/export_cost [overrides for every run ...]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L

RUNS = {"ar zero3": ["method=ar", "strategy=deepspeed_zero3"],
        "chimera zero3": ["method=chimera", "strategy=deepspeed_zero3"],
        "medusa fsdp": ["method=medusa", "strategy=fsdp"]}
MODELS = {"tiny target": ["model=tiny_target"], "SmolLM2-135M": ["model=smollm2_135m_instruct"]}
COMMON = ["data=stdlib_code", "trainer=cpu", "trainer.devices=2", "trainer.max_steps=2", "trainer.val_check_interval=2",
          "trainer.limit_val_batches=1", "callbacks=default", "callbacks.model_checkpoint.every_n_train_steps=2",
          "data.batch_size=2", "+callbacks.export_peak._target_=export_cost.ExportPeak"]


def _status_mb(field: str) -> float:
    line = next(line for line in open("/proc/self/status") if line.startswith(field))
    return int(line.split()[1]) / 1024


class ExportPeak(L.Callback):
    """At the end of fit (before the run's export, a later callback), reset this process's RSS high-water mark and,
    at exit, write it beside the RSS of that moment to ``export_peak.rank<r>.json``."""

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        path = Path(trainer.default_root_dir) / f"export_peak.rank{trainer.global_rank}.json"
        at_fit_end = _status_mb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        atexit.register(lambda: path.write_text(json.dumps({"rss_at_fit_end_mb": at_fit_end,
                                                            "peak_mb": _status_mb("VmHWM")})))


def size_mb(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args, overrides = parser.parse_known_args()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    print("| model | run | checkpoint MB | export MB | rank 0 RSS at fit end MB | rank 0 peak in export MB |\n"
          "|---|---|---|---|---|---|")
    for model, model_args in MODELS.items():
        for name, run_args in RUNS.items():
            run_dir = args.out / f"{model}_{name}".replace(" ", "_")
            args.out.mkdir(parents=True, exist_ok=True)
            with open(f"{run_dir}.log", "w") as log:
                done = subprocess.run([sys.executable, "-m", "lit_spec.train", *COMMON, *model_args, *run_args,
                                       *overrides, f"hydra.run.dir={run_dir}"], env=env, stdout=log,
                                      stderr=subprocess.STDOUT)
            if done.returncode:
                print(f"| {model} | {name} | failed (exit {done.returncode}, {run_dir}.log) | | | |", flush=True)
                continue
            peak = json.loads((run_dir / "export_peak.rank0.json").read_text())
            print(f"| {model} | {name} | {size_mb(run_dir / 'checkpoints' / 'step000002.ckpt'):.1f} | "
                  f"{size_mb(run_dir / 'export'):.1f} | {peak['rss_at_fit_end_mb']:.0f} | {peak['peak_mb']:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
