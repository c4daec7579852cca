"""Runs in vLLM's own environment (``serving/install_vllm_cpu.sh``), started by ``lit_spec.serving.vllm_runner``: it imports
vLLM and the standard library only. It reads a request (JSON: prompts as token ids, the number of new tokens, and one
or more runs, each a model with an optional ``speculative_config``), decodes greedily with one ``vllm.LLM`` per run,
one prompt at a time, and writes per run and prompt the new token ids and seconds, with vLLM's own speculative-decoding
counters (drafts, draft tokens, accepted tokens, accepted per position) read from ``LLM.get_metrics()``. The engine
runs in this process (no engine or worker processes to start), so several runs share one start-up.

Usage: python vllm_worker.py REQUEST.json RESULT.json
"""

import gc
import json
import os
import sys
import time


def counters(llm) -> dict:
    """vLLM's spec-decode counters, summed over its label sets; per-position acceptance as a list."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_position": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_position"] = [int(v) for v in metric.values]
    return out


def run(run: dict, request: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=run["model"], tokenizer=run.get("tokenizer") or run["model"],
              dtype=request.get("dtype", "float32"), seed=request.get("seed", 0),
              max_model_len=request.get("max_model_len", 2048), enforce_eager=request.get("enforce_eager", True),
              speculative_config=run.get("speculative_config"), disable_log_stats=False, max_num_seqs=1,
              distributed_executor_backend="uni")
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    for prompt in prompts[: request.get("warmup", 1)]:        # vLLM's first call pays for setting up
        llm.generate([prompt], params, use_tqdm=False)
    before = counters(llm)
    tokens, seconds = [], []
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        tokens.append(list(out[0].outputs[0].token_ids))
    after = counters(llm)
    spec = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}
    spec["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"],
                                                           before["accepted_per_position"] or
                                                           [0] * len(after["accepted_per_position"]))]
    del llm
    gc.collect()
    return {"tokens": tokens, "seconds": seconds, "spec": spec}


def main(request_path: str, result_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the engine in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")            # GiB: the default takes most of the memory
    request = json.load(open(request_path))
    results = {r["name"]: run(r, request) for r in request["runs"]}
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f)
    os.replace(tmp, result_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
