"""Runs in vLLM's own environment (``serving/install_vllm_cpu.sh``), started by ``lit_spec.serving.vllm_runner``: it
imports vLLM and the standard library only. It reads a request (JSON) and decodes, greedily unless the request
samples, with ``vllm.LLM``, the engine in this process (no engine or worker processes to start), in one of two modes:

- ``runs``: one or more runs, each a model with an optional ``speculative_config``, over the same prompts, one
  prompt at a time; per run and prompt the new token ids and seconds, with vLLM's own speculative-decoding counters
  (drafts, draft tokens, accepted tokens, accepted per position) from ``LLM.get_metrics()``, in RESULT.json;
- ``batches``: one model's answers to batches of prompts, each batch decoded together (vLLM's continuous batching)
  and written as ``RESULT/<batch>.json`` the moment it is done, so the caller keeps every finished batch.

Usage: python vllm_worker.py REQUEST.json RESULT
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


def engine(model: str, request: dict, max_num_seqs: int, speculative_config: dict | None = None,
           enforce_eager: bool = True):
    from vllm import LLM

    return LLM(model=model, tokenizer=model, dtype=request.get("dtype", "float32"), seed=request.get("seed", 0),
               max_model_len=request.get("max_model_len", 2048), enforce_eager=enforce_eager,
               speculative_config=speculative_config, disable_log_stats=False, max_num_seqs=max_num_seqs,
               distributed_executor_backend="uni")


def sampling_params(request: dict):
    """Greedy, or the request's ``sampling`` (temperature, top_p; a seed per request, so that a run is repeatable)."""
    from vllm import SamplingParams

    sampling = request.get("sampling") or {}
    return SamplingParams(temperature=sampling.get("temperature", 0.0), top_p=sampling.get("top_p", 1.0),
                          seed=sampling.get("seed"), max_tokens=request["max_tokens"])


def prompts_of(ids_list: list) -> list:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=ids) for ids in ids_list]


def run(run: dict, request: dict) -> dict:
    llm = engine(run["model"], request, 1, run.get("speculative_config"), run.get("enforce_eager", True))
    params, prompts = sampling_params(request), prompts_of(request["prompts"])
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


def answer_batches(request: dict, result_dir: str) -> None:
    batches = request["batches"]
    llm = engine(request["model"], request, max(map(len, batches)))
    params = sampling_params(request)
    for index, batch in zip(request["indices"], batches):
        outs = llm.generate(prompts_of(batch), params, use_tqdm=False)
        write_json(os.path.join(result_dir, f"{index}.json"), [list(o.outputs[0].token_ids) for o in outs])


def write_json(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def main(request_path: str, result_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # the engine in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")            # GiB: the default takes most of the memory
    # every core, as lit_spec's torch uses them (vLLM's default keeps one core back for its own processes)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    request = json.load(open(request_path))
    if "batches" in request:
        answer_batches(request, result_path)
    else:
        write_json(result_path, {r["name"]: run(r, request) for r in request["runs"]})


if __name__ == "__main__":
    main(*sys.argv[1:3])
