"""Trajectory collection throughput: our collector vs the paper's reference algorithm, on the same prompts.

    LIT_SPEC_CACHE=/tmp/default_cache1 python experiments/collect_throughput.py [--prompts 128] [hydra overrides...]

(a) ``python -m lit_spec.collect``'s path (``run_collection``: Lightning predict, batched ``JacobiDecoder`` with KV
cache, records written), timed from the start to the end of its predict loop (no start-up or model loading);
(b) ``reference_trajectories``: CLLM Algorithm 1 one prompt at a time, a full forward over prompt + answer + state per
Jacobi iteration. Both decode the same train prompts of conf/collect.yaml's data with the same n and N; the fixed
points (answers) must agree. Throughput is answer tokens (the fixed points) per second. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from omegaconf import open_dict

from lit_spec.collection import reference_trajectories, run_collection
from lit_spec.config import build, compose_config
from lit_spec.stages import ensure_stages
from lit_spec.data.trajectories import read_meta, read_records
from lit_spec.decoding.guesses import GuessMaker


def collect(overrides: list[str]) -> tuple[dict, list[dict]]:
    """(a): one collection into a fresh directory; its stats (decoding time: the predict loop) and records."""
    with tempfile.TemporaryDirectory() as out:
        cfg = compose_config(overrides, config_name="collect")
        with open_dict(cfg):
            cfg.collect.out_dir = cfg.paths.output_dir = out
        run_collection(cfg)
        return read_meta(out)["stats"], read_records(out, include_dropped=True)


def reference(model, tokenizer, c, records: list[dict]) -> tuple[float, int, int]:
    """(b): the paper's algorithm on the same prompts, one at a time; (seconds, answer tokens, same answers)."""
    same = tokens = 0
    start = time.perf_counter()
    for r in records:
        guess = GuessMaker(model, c.init, None, tokenizer.pad_token_id, c.seed)
        guess.reset()
        blocks = reference_trajectories(model, r["prompt_ids"], c.n_tokens, c.max_new_tokens,
                                        tokenizer.eos_token_id, guess)
        answer = [t for states in blocks for t in states[-1]]
        same += answer == r["answer_ids"]
        tokens += len(answer)
    return time.perf_counter() - start, tokens, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--n-tokens", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=None, help="default: conf/collect.yaml's")
    parser.add_argument("--repeats", type=int, default=2, help="alternate (a) and (b) this often; report the best")
    parser.add_argument("overrides", nargs="*", help="conf/collect.yaml overrides, e.g. model=hf model.name_or_path=DIR")
    args = parser.parse_args()
    overrides = [*args.overrides, "collect.splits=[train]", f"collect.max_prompts={args.prompts}",
                 *([f"collect.batch_size={args.batch_size}"] if args.batch_size else []), f"collect.n_tokens={args.n_tokens}",
                 f"collect.max_new_tokens={args.max_new_tokens}", "collect.augment.copies=0",
                 "trainer.enable_progress_bar=false"]
    cfg = compose_config(overrides, config_name="collect")
    ensure_stages(cfg)
    spec = build(cfg.model)
    model, tokenizer = spec.load_model().eval(), spec.load_tokenizer()

    ours, theirs, first = [], [], None
    for _ in range(args.repeats):  # alternated: a busy machine slows both alike; the best run is the least disturbed
        stats, records = collect(overrides)
        first = first or records
        assert records == first, "collections of the same config differ"
        ours.append(stats["seconds"])
        theirs.append(reference(model, tokenizer, cfg.collect, records))
    ref_seconds, tokens, same = min(theirs)
    our_tokens, our_seconds = stats["answer_tokens"], min(ours)
    ref_rate, our_rate = tokens / ref_seconds, our_tokens / our_seconds

    c = cfg.collect
    print(f"\nmodel {spec.name_or_path} | {len(first)} train prompts | n={c.n_tokens} N={c.max_new_tokens} | "
          f"torch threads {torch.get_num_threads()} | best of {args.repeats} | same fixed points: "
          f"{same}/{len(first)}\n")
    print("| path | batch | KV cache | answer tokens | seconds | tok/s | vs reference |")
    print("|---|---|---|---|---|---|---|")
    print(f"| reference (CLLM Alg. 1, full forward per iteration) | 1 | no | {tokens} | {ref_seconds:.1f} | "
          f"{ref_rate:.1f} | 1.0× |")
    print(f"| `lit_spec.collect` (batched JacobiDecoder) | {c.batch_size} | yes | {our_tokens} | "
          f"{our_seconds:.1f} | {our_rate:.1f} | {our_rate / ref_rate:.1f}× |")
    ratios = sorted(t[0] / o for t, o in zip(theirs, ours))
    print(f"\nall runs, seconds: reference {[round(t[0], 1) for t in theirs]}, ours {ours}; "
          f"ratio per alternated pair {[round(r, 1) for r in ratios]} (median {statistics.median(ratios):.1f}×)")
    if same != len(first) or tokens != our_tokens:
        raise SystemExit("the two paths disagree on some fixed points")


if __name__ == "__main__":
    main()
