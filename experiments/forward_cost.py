"""What one target forward of a block of n tokens costs, against a one-token forward, with a KV cache behind it: the
hardware's side of every multi-token decoder's speedup (τ buys tokens per forward; this says what a forward of that
many tokens costs). Also the first use of each block size in a process, which the CPU kernels pay once per shape.

    python experiments/forward_cost.py +experiment=smollm2_humaneval [--dtypes float32 bfloat16] [--prefix 200]

The target is the config's ``model`` (its stages are built first), after a prefill of ``--prefix`` prompt tokens.
For each dtype and block size: the first forward of that size in this process, then the median of ``--repeats``
warm ones (the cache rolled back after each). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lit_spec.config import build, compose_config
from lit_spec.decoding.cache import crop, new_cache
from lit_spec.stages import ensure_stages

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 128)


def timed(model, block: torch.Tensor, cache, length: int) -> float:
    start = time.perf_counter()
    model(block, past_key_values=cache, use_cache=True)
    elapsed = time.perf_counter() - start
    crop(cache, length)
    return elapsed


@torch.inference_mode()
def measure(model, prefix: int, repeats: int, vocab: int) -> list[tuple[int, float, float]]:
    generator = torch.Generator().manual_seed(0)
    cache = new_cache(model)
    model(torch.randint(vocab, (1, prefix), generator=generator), past_key_values=cache, use_cache=True)
    rows = []
    for n in SIZES:
        block = torch.randint(vocab, (1, n), generator=generator)
        first = timed(model, block, cache, prefix)
        warm = statistics.median(timed(model, block, cache, prefix) for _ in range(repeats))
        rows.append((n, first, warm))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prefix", type=int, default=200, help="prompt tokens in the cache before each block")
    parser.add_argument("--repeats", type=int, default=7)
    args, overrides = parser.parse_known_args()
    cfg = compose_config(overrides, config_name="bench")
    ensure_stages(cfg.model)
    print(f"{cfg.model.name_or_path}, {torch.get_num_threads()} threads, {args.prefix} tokens in the cache\n")
    print("| dtype | n | first use (ms) | warm (ms) | warm / one-token warm | first / warm |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        cfg.model.dtype = dtype
        model = build(cfg.model).load_model().eval()
        rows = measure(model, args.prefix, args.repeats, model.config.vocab_size)
        one = rows[0][2]
        for n, first, warm in rows:
            print(f"| {dtype} | {n} | {first * 1e3:.1f} | {warm * 1e3:.1f} | {warm / one:.2f}× | {first / warm:.1f}× |")


if __name__ == "__main__":
    main()
