"""What a collection decodes, fixed before any process starts: the settings checked, the batches planned (per split,
prompts sorted by length and cut into ``collect.batch_size`` chunks, so batch b holds the same prompts whatever the
number of processes) and the seeds derived from (``collect.seed``, split, batch[, row])."""

from __future__ import annotations

import hashlib

from omegaconf import DictConfig

from lit_spec.decoding.fast import ENGINES as FAST_ENGINES
from lit_spec.decoding.guesses import INITS
from lit_spec.errors import ConfigError, check_count

SPLITS = ("train", "validation", "test")
DECODERS = (None, "jacobi", "ar")        # collect.decoder: null = jacobi (trajectories), ar = answers only
ENGINES = (None, *FAST_ENGINES, "vllm")  # collect.engine: null = eager; the fast path's; vLLM's (answers only)


def check_settings(c: DictConfig) -> None:
    """Bad ``collect.*`` values fail here, before any model or data is loaded."""
    for key in ("n_tokens", "max_new_tokens", "batch_size"):
        check_count(f"collect.{key}", c[key])
    if c.max_prompts is not None:
        check_count("collect.max_prompts", c.max_prompts)
    if c.get("decoder") not in DECODERS:
        raise ConfigError(f"collect.decoder={c.decoder!r}: choose jacobi (null; Jacobi trajectories) or ar (answers "
                          "only)")
    if c.get("engine") not in ENGINES:
        raise ConfigError(f"collect.engine={c.engine!r}: choose null (lit_spec's eager engine), one of its fast path's "
                          f"{[e for e in ENGINES if e]} or vllm")
    if c.get("engine") == "vllm" and c.get("decoder") != "ar":
        raise ConfigError("collect.engine=vllm collects answers only (vLLM has no Jacobi decoding): set "
                          "collect.decoder=ar, or collect.engine=null for Jacobi trajectories")
    if c.get("engine") == "vllm":
        check_count("collect.engine_check", c.engine_check, minimum=0)
    if c.init not in INITS:
        raise ConfigError(f"collect.init={c.init!r}: choose one of {list(INITS)}")
    if not c.splits or any(s not in SPLITS for s in c.splits):
        raise ConfigError(f"collect.splits={list(c.splits or [])}: give one or more of {list(SPLITS)}")
    check_count("collect.augment.copies", c.augment.copies, minimum=0)
    prob = c.augment.prob
    if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
        raise ConfigError(f"collect.augment.prob={prob!r}: must be a probability in [0, 1]")


def derive_seed(*parts) -> int:
    """A stable seed from e.g. (seed, split, batch, row): the same in every process (unlike ``hash(str)``)."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def plan_batches(splits: dict, names, batch_size: int, max_prompts: int | None) -> list[dict]:
    """Every batch of the collection, in a fixed order: per split, prompts sorted by length, cut into chunks."""
    plan = []
    for split in names:
        ds = splits[split]
        rows = ds[: len(ds) if max_prompts is None else min(max_prompts, len(ds))]
        prompts, answers = rows["prompt_ids"], rows["answer_ids"]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # stable: ties keep dataset order
        for b, start in enumerate(range(0, len(order), batch_size)):
            index = order[start: start + batch_size]
            plan.append({"split": split, "batch": b, "index": index,
                         "prompt_ids": [list(prompts[i]) for i in index],
                         "reference_ids": [list(answers[i]) for i in index]})
    return plan
