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

``reference_trajectories`` is the paper's algorithm at its plainest (one prompt, no KV cache): the throughput
baseline of experiments/collect_throughput.py and the tests' independent check of the engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from functools import partial
from pathlib import Path
from typing import Callable

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from omegaconf import DictConfig, OmegaConf, open_dict
from torch.utils.data import DataLoader
from transformers import AutoConfig

from lit_spec.config import build, cache_entry, compose_config, config_hash
from lit_spec.data.trajectories import (META, augment_states, done_batches, read_meta, read_records, write_meta,
                                        write_part)
from lit_spec.decoding.jacobi import INITS, JacobiDecoder
from lit_spec.decoding.state import eos_ids
from lit_spec.errors import ConfigError, DataError, check_count

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")


# ---- settings ---------------------------------------------------------------------------------------------------
def check_settings(c: DictConfig) -> None:
    """Bad ``collect.*`` values fail here, before any model or data is loaded."""
    for key in ("n_tokens", "max_new_tokens", "batch_size"):
        check_count(f"collect.{key}", c[key])
    if c.max_prompts is not None:
        check_count("collect.max_prompts", c.max_prompts)
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


def _first_difference(a, b, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{path}.{key}" if path else key)
    return f"{path}: {a!r} there, {b!r} now"


# ---- the collector ----------------------------------------------------------------------------------------------
def make_record(split: str, index: int, prompt_ids: list[int], reference_ids: list[int], trajectory: list,
                augment: dict, generator: torch.Generator, repetition_filter, tokenizer) -> dict:
    """One record of the format from a row's Jacobi trajectories (one list of states per block)."""
    blocks = [{"states": states, "augmented": augment_states(states, augment["copies"], augment["prob"], generator)}
              for states in trajectory]
    answer = [t for states in trajectory for t in states[-1]]
    reason = None
    if repetition_filter is not None:
        reason = repetition_filter.reason(answer, tokenizer.decode(answer, skip_special_tokens=True))
    return {"id": f"{split}/{index:06d}", "split": split, "prompt_ids": prompt_ids, "answer_ids": answer,
            "reference_ids": reference_ids, "blocks": blocks, "keep": reason is None, "drop_reason": reason}


class TrajectoryCollector(L.LightningModule):
    """Decodes one planned batch per ``predict_step`` and writes its part; the target loads in ``configure_model``."""

    def __init__(self, model_spec, tokenizer, out_dir: str, n_tokens: int, max_new_tokens: int, init: str,
                 seed: int, augment: dict, repetition_filter=None, on_done: Callable[[float], None] | None = None):
        super().__init__()
        self.model_spec, self.tokenizer, self.out_dir = model_spec, tokenizer, out_dir
        self.n_tokens, self.max_new_tokens, self.init, self.seed = n_tokens, max_new_tokens, init, seed
        self.augment, self.repetition_filter, self.on_done = augment, repetition_filter, on_done
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.model_spec.load_model().eval().requires_grad_(False)

    def on_predict_start(self) -> None:
        self.start = time.perf_counter()

    def on_predict_end(self) -> None:
        """Once every process's parts are on disk, rank zero gets the decoding time (spawned workers included: the
        launching process never sees it)."""
        self.trainer.strategy.barrier("collect")
        if self.trainer.is_global_zero and self.on_done is not None:
            self.on_done(time.perf_counter() - self.start)

    def predict_step(self, batch: dict) -> dict:
        split, b, prompts = batch["split"], batch["batch"], batch["prompt_ids"]
        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(prompts):  # left padding: every row's last prompt token in the last column
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        decoder = JacobiDecoder(self.model, self.n_tokens, self.init, seed=derive_seed(self.seed, split, b),
                                return_trajectory=True, align_blocks=True, pad_token_id=pad)
        out = decoder.generate(ids.to(self.device), self.max_new_tokens, self.tokenizer.eos_token_id,
                               mask.to(self.device))
        records = [make_record(split, i, prompts[r], batch["reference_ids"][r], out.extras["trajectories"][r],
                               self.augment, torch.Generator().manual_seed(derive_seed(self.seed, split, b, r)),
                               self.repetition_filter, self.tokenizer)
                   for r, i in enumerate(batch["index"])]
        write_part(self.out_dir, split, b, records)  # atomic; a batch dealt twice is written twice, identically
        return {"tokens": sum(len(r["answer_ids"]) for r in records)}


class TokensPerSecond(L.Callback):
    """``tok/s`` (answer tokens this process decoded per second) on the predict progress bar."""

    def on_predict_start(self, trainer, module) -> None:
        self.tokens, self.start = 0, time.perf_counter()

    def on_predict_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.tokens += outputs["tokens"]
        rate = f"{self.tokens / (time.perf_counter() - self.start):.0f}"
        bar = trainer.progress_bar_callback
        if isinstance(bar, TQDMProgressBar):
            bar.predict_progress_bar.set_postfix({"tok/s": rate})
        elif isinstance(bar, RichProgressBar) and bar.progress is not None and bar.predict_progress_bar_id is not None:
            # rich shows metrics during fit only: the rate goes into the bar's description
            bar.progress.update(bar.predict_progress_bar_id, description=f"{bar.predict_description} {rate} tok/s")


def _as_is(batch):
    return batch


# ---- the run ----------------------------------------------------------------------------------------------------
def collection_config(cfg: DictConfig, model_spec) -> dict:
    """What a collection's output depends on (stored in meta.json; a resume must match it)."""
    collect = OmegaConf.to_container(cfg.collect, resolve=True)
    collect.pop("out_dir")
    config = {"model": model_spec.to_dict(), "data": OmegaConf.to_container(cfg.data, resolve=True),
              "collect": collect}
    return json.loads(json.dumps(config))  # as it reads back from meta.json


def finish(out: Path, config: dict, plan: list[dict], todo: list[dict], seconds: float) -> dict:
    """Check every planned part, count, and mark the directory complete; ``seconds``: this run's decoding time."""
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
        "tokens_per_s": round(run_tokens / seconds, 1) if seconds > 0 else None}
    write_meta(out, config, complete=True, stats=stats)
    return stats


def run_collection(cfg: DictConfig) -> Path:
    """Collect (or resume, or find complete) the trajectories that ``cfg`` describes; return ``collect.out_dir``."""
    c = cfg.collect
    check_settings(c)
    out = Path(c.out_dir)
    repetition_filter = None if c.filter is None else build(c.filter)
    model_spec = build(cfg.model)
    config = collection_config(cfg, model_spec)
    if (out / META).is_file():
        meta = read_meta(out)
        if meta["config"] != config:
            raise ConfigError(f"collect.out_dir={out} holds a collection with other settings "
                              f"({_first_difference(meta['config'], config)}): set another collect.out_dir "
                              "or delete that directory")
        if meta["complete"]:
            log.info("%s: already complete (%s records), nothing to do", out, meta["stats"].get("records"))
            return out

    model_spec.prepare()
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
    trainer: L.Trainer = instantiate(cfg.trainer, _partial_=True)(callbacks=[TokensPerSecond()], logger=False)
    if trainer.is_global_zero:
        write_meta(out, config, complete=False)
        log.info("collecting %d batches of %d prompts (%d on disk already) into %s", len(todo),
                 c.batch_size, len(plan) - len(todo), out)
    on_done = partial(finish, out, config, plan, todo)
    if todo:
        collector = TrajectoryCollector(model_spec, tokenizer, str(out), c.n_tokens, c.max_new_tokens, c.init,
                                        c.seed, {"copies": c.augment.copies, "prob": float(c.augment.prob)},
                                        repetition_filter, on_done)
        trainer.predict(collector, dataloaders=DataLoader(todo, batch_size=None, collate_fn=_as_is),
                        return_predictions=False)
    elif trainer.is_global_zero:
        on_done(0.0)
    if trainer.is_global_zero:
        stats = read_meta(out)["stats"]
        log.info("collected %d records (%d kept, %d dropped by the repetition filter), %d answer tokens; this run: "
                 "%d batches in %.1f s, %s tok/s", stats["records"], stats["kept"], stats["dropped"],
                 stats["answer_tokens"], len(todo), stats["seconds"], stats["tokens_per_s"])
    return out


def trajectory_cache(overrides: list[str], cache_dir: str | Path) -> tuple[DictConfig, Path, bool]:
    """(collect config, directory, complete?) of the trajectories of ``conf/collect.yaml`` + ``overrides`` in
    ``cache_dir/trajectories-<hash of model, data, collect, seed>``: processes and strategy do not change the output,
    so they are not hashed."""
    cfg = compose_config(overrides, config_name="collect")
    hashed = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items()
              if k in ("model", "data", "collect", "seed")}
    hashed["collect"].pop("out_dir", None)
    out = cache_entry(cache_dir, f"trajectories-{config_hash(hashed)}")
    with open_dict(cfg):
        cfg.collect.out_dir = str(out)
        cfg.paths.output_dir = str(out)  # the trainer's default_root_dir (nothing is written there in predict)
    return cfg, out, (out / META).is_file() and bool(read_meta(out).get("complete"))


def cached_trajectories(overrides: list[str], cache_dir: str | Path) -> Path:
    """``trajectory_cache``'s directory, collected first when incomplete (an interrupted collection resumes)."""
    cfg, out, complete = trajectory_cache(overrides, cache_dir)
    return out if complete else run_collection(cfg)


# ---- the paper's reference algorithm ------------------------------------------------------------------------------
@torch.no_grad()
def reference_trajectories(model, prompt_ids: list[int], n_tokens: int, max_new_tokens: int,
                           eos_token_id: int | list[int] | None,
                           initial_guess: Callable[[list[int], int], list[int]]) -> list[list[list[int]]]:
    """CLLM Algorithm 1 for one prompt, no KV cache: every Jacobi iteration is a full forward of prompt + answer so
    far + the block's current state, whose argmax at every block position is the next state (eq. 3), until a fixed
    point; it joins the answer and the next block starts, until EOS or ``max_new_tokens``.

    ``initial_guess(context, size)`` guesses ``size`` tokens after ``context`` (e.g. a reset ``GuessMaker``). As in
    ``JacobiDecoder``, the first block's first token is the target's greedy token after the prompt (what any Jacobi
    iteration puts there) and only the rest is guessed, so with the same guesses both give the same trajectories.
    Returns per block its states, initial guess to fixed point; blocks cut by EOS are cut to the tokens output.
    """
    eos = eos_ids(eos_token_id)
    device = next(model.parameters()).device

    def argmax(tokens: list[int]) -> list[int]:
        return model(input_ids=torch.tensor([tokens], device=device)).logits[0].argmax(-1).tolist()

    context, blocks = list(prompt_ids), []
    while len(context) - len(prompt_ids) < max_new_tokens and not (blocks and context[-1] in eos):
        size = min(n_tokens, max_new_tokens - (len(context) - len(prompt_ids)))
        if blocks:
            state = initial_guess(context, size)
        else:
            first = argmax(context)[-1]
            state = [first] + initial_guess(context + [first], size - 1)
        states = [state]
        while True:
            state = argmax(context + state)[len(context) - 1: len(context) - 1 + size]
            if state == states[-1]:
                break
            states.append(state)
        cut = next((i + 1 for i, t in enumerate(state) if t in eos), size)
        blocks.append([s[:cut] for k, s in enumerate(states) if k == 0 or s[:cut] != states[k - 1][:cut]])
        context += state[:cut]
    return blocks
