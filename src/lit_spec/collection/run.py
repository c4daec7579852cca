"""Jacobi trajectory collection (CLLM §3.2.1, Algorithm 1) behind ``python -m lit_spec.collect`` (conf/collect.yaml).

The target decodes every prompt of the chosen splits greedily with Jacobi decoding, n tokens at a time
(``JacobiDecoder``: KV cache, whole batches of prompts), and every block's trajectory is kept: its states from the
initial guess to the fixed point. The fixed points concatenated are the answer, token-identical to greedy AR
decoding. Records (format: ``lit_spec.data.trajectories``) get augmented states (§3.2.1 "data augmentation") and are
marked by the repetition filter (§3.2.1 "data post-processing").

Batches are formed before any process starts: per split, the prompts sorted by length (stable) and cut into
``collect.batch_size`` chunks, so batch b holds the same prompts whatever the number of processes. Lightning's
predict loop deals the batches not yet on disk to the processes (``trainer.devices`` + ``strategy``); each batch is
written as one part, atomically, so a killed run keeps whole parts only and the same command resumes it. Every random
choice (initial guesses, augmentation) is seeded from (``collect.seed``, split, batch[, row]): the output does not
depend on the number of processes or on interruptions.

The run's parts: ``plan`` (settings, batches, seeds), ``collector`` (the LightningModule), ``progress`` (tok/s on the
bar); ``reference`` is the paper's algorithm at its plainest. Trajectories cached for a training run are a stage
(``lit_spec.stages``).
"""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path

import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from transformers import AutoConfig

from lit_spec.checks import check_trainer
from lit_spec.collection.collector import TrajectoryCollector
from lit_spec.collection.plan import check_settings, plan_batches
from lit_spec.collection.progress import TokensPerSecond
from lit_spec.collection.vllm_answers import check_against_generate, collect_with_vllm
from lit_spec.config import build, without_nulls
from lit_spec.data.trajectories import (LOCK, META, check_parts, done_batches, part_checksums, read_meta, read_records,
                                        write_meta)
from lit_spec.errors import ConfigError, DataError, Interrupted, signal_of
from lit_spec.io import check_writable, one_writer
from lit_spec.stages import NOT_COLLECTED, build_stages, find_stages

log = logging.getLogger(__name__)


def _as_is(batch):
    return batch


def _first_difference(a, b, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{path}.{key}" if path else key)
    return f"{path}: {a!r} there, {b!r} now"


def collection_config(cfg: DictConfig, model_spec) -> dict:
    """What a collection's output depends on (stored in meta.json; a resume must match it). Not the engine: vLLM's
    answers are lit_spec's, so a collection begun by one resumes in the other."""
    collect = OmegaConf.to_container(cfg.collect, resolve=True)
    for key in (*NOT_COLLECTED, "engine"):
        collect.pop(key, None)
    config = {"model": model_spec.to_dict(), "data": OmegaConf.to_container(cfg.data, resolve=True),
              "collect": collect}
    return json.loads(json.dumps(config))  # as it reads back from meta.json


def finish(out: Path, config: dict, plan: list[dict], todo: list[dict], seconds: float,
           compiling: float = 0.0) -> dict:
    """Check every planned part, count, and mark the directory complete; ``seconds``: this run's decoding time,
    ``compiling`` of it the fast path's compiles (``collect.engine``)."""
    done = {split: done_batches(out, split) for split in {p["split"] for p in plan}}
    missing = [f"{p['split']}-{p['batch']}" for p in plan if p["batch"] not in done[p["split"]]]
    if missing:
        raise DataError(f"{out}: parts {missing[:5]} are missing after the run; rerun the same command to finish")
    records = read_records(out, include_dropped=True, require_complete=False)
    new_ids = {f"{p['split']}/{i:06d}" for p in todo for i in p["index"]}

    def count(rs: list[dict]) -> dict:
        return {"records": len(rs), "kept": sum(r["keep"] for r in rs), "dropped": sum(not r["keep"] for r in rs),
                "answer_tokens": sum(len(r["answer_ids"]) for r in rs),
                "states": sum(len(b["states"]) for r in rs for b in r["blocks"]),
                "augmented_states": sum(len(b["augmented"]) for r in rs for b in r["blocks"])}

    run_tokens = sum(len(r["answer_ids"]) for r in records if r["id"] in new_ids)
    stats = count(records) | {
        "splits": {s: count([r for r in records if r["split"] == s]) for s in config["collect"]["splits"]},
        "batches": len(plan), "batches_this_run": len(todo), "seconds": round(seconds, 3),
        "compile_seconds": round(compiling, 3),
        "tokens_per_s": round(run_tokens / seconds, 1) if seconds > 0 else None}
    write_meta(out, config, complete=True, stats=stats, parts=part_checksums(out))
    return stats


def run_collection(cfg: DictConfig) -> Path:
    """Collect (or resume, or find complete) the trajectories that ``cfg`` describes; return ``collect.out_dir``."""
    c = cfg.collect
    check_settings(c)
    check_trainer(cfg.trainer)
    out = Path(c.out_dir)
    check_writable(out, "collect.out_dir")
    with one_writer(out / LOCK, f"collect.out_dir={out}"):      # one collector per directory, whatever its settings
        return _collect(cfg, out)


def _collect(cfg: DictConfig, out: Path) -> Path:
    c = cfg.collect
    repetition_filter = None if c.filter is None else build(c.filter)
    stages = find_stages(cfg)  # the model's path (part of the settings), built below only if work is left
    model_spec = build(cfg.model)
    config = collection_config(cfg, model_spec)
    if (out / META).is_file():
        meta = read_meta(out)
        there, here = without_nulls(meta["config"]), without_nulls(config)   # a new null option changes nothing
        if there != here:
            raise ConfigError(f"collect.out_dir={out} holds a collection with other settings "
                              f"({_first_difference(there, here)}): set another collect.out_dir "
                              "or delete that directory")
        if meta["complete"] and not check_parts(out, meta):     # a damaged part is set aside and redone below
            log.info("%s: already complete (%s records), nothing to do", out, meta["stats"].get("records"))
            return out

    build_stages(stages)
    model_spec.validate()
    tokenizer = model_spec.load_tokenizer()
    datamodule = build(cfg.data, tokenizer=tokenizer)
    datamodule.setup("predict")
    plan = plan_batches(datamodule.splits, c.splits, c.batch_size, c.max_prompts)
    limit = getattr(AutoConfig.from_pretrained(model_spec.name_or_path, trust_remote_code=model_spec.trust_remote_code,
                                               revision=model_spec.revision), "max_position_embeddings", None)
    longest = max((len(p) for b in plan for p in b["prompt_ids"]), default=0)
    if limit is not None and longest + c.max_new_tokens > limit:
        raise ConfigError(f"the longest prompt ({longest} tokens) + collect.max_new_tokens ({c.max_new_tokens}) "
                          f"exceeds the model's context of {limit}: lower data.max_prompt_tokens or max_new_tokens")

    done = {split: done_batches(out, split) for split in c.splits}
    todo = [b for b in plan if b["batch"] not in done[b["split"]]]
    if c.get("engine") == "vllm":
        return _collect_with_vllm(cfg, out, config, plan, todo, model_spec, tokenizer, repetition_filter)
    devices = cfg.trainer.get("devices")
    if isinstance(devices, int) and 0 < len(todo) < devices:     # the predict loop gives each process a batch or fails
        log.info("%d batches left: collecting with %d processes, not %d", len(todo), len(todo), devices)
        devices = len(todo)
    trainer: L.Trainer = instantiate(cfg.trainer, _partial_=True)(devices=devices, callbacks=[TokensPerSecond()],
                                                                   logger=False)
    if trainer.is_global_zero:
        write_meta(out, config, complete=False)
        log.info("collecting %d batches of %d prompts (%d on disk already) into %s", len(todo),
                 c.batch_size, len(plan) - len(todo), out)
    on_done = partial(finish, out, config, plan, todo)
    if todo:
        collector = TrajectoryCollector(model_spec, tokenizer, str(out), c.n_tokens, c.max_new_tokens, c.init,
                                        c.seed, {"copies": c.augment.copies, "prob": float(c.augment.prob)},
                                        repetition_filter, on_done, c.get("decoder"), c.get("engine"), longest)
        try:
            trainer.predict(collector, dataloaders=DataLoader(todo, batch_size=None, collate_fn=_as_is),
                            return_predictions=False)
        except SystemExit as stop:              # SIGTERM / Ctrl-C, at a batch boundary
            on_disk = sum(len(done_batches(out, split)) for split in c.splits)
            raise Interrupted(f"collection stopped with {on_disk} of {len(plan)} batches on disk in {out}; rerun "
                              "the same command to resume", signal_of(stop)) from None
    elif trainer.is_global_zero:
        on_done(0.0)
    if trainer.is_global_zero:
        _log_stats(out, len(todo))
    return out


def _collect_with_vllm(cfg: DictConfig, out: Path, config: dict, plan: list[dict], todo: list[dict], model_spec,
                       tokenizer, repetition_filter) -> Path:
    """``collect.engine=vllm`` (``vllm_answers.py``): one process, vLLM's batches instead of the predict loop."""
    c = cfg.collect
    write_meta(out, config, complete=False)
    log.info("collecting %d batches of %d prompts with vLLM (%d on disk already) into %s", len(todo), c.batch_size,
             len(plan) - len(todo), out)
    seconds = collect_with_vllm(model_spec, tokenizer, out, todo, c, repetition_filter) if todo else 0.0
    new = {f"{b['split']}/{i:06d}" for b in todo for i in b["index"]}
    collected = [r for r in read_records(out, include_dropped=True, require_complete=False) if r["id"] in new]
    check_against_generate(model_spec, tokenizer, collected[: c.engine_check], c.max_new_tokens)
    finish(out, config, plan, todo, seconds)
    _log_stats(out, len(todo))
    return out


def _log_stats(out: Path, batches: int) -> None:
    stats = read_meta(out)["stats"]
    log.info("collected %d records (%d kept, %d dropped by the repetition filter), %d answer tokens; this run: "
             "%d batches in %.1f s (%.1f s of it compiling), %s tok/s", stats["records"], stats["kept"],
             stats["dropped"], stats["answer_tokens"], batches, stats["seconds"], stats.get("compile_seconds", 0.0),
             stats["tokens_per_s"])
