"""The collecting LightningModule: one planned batch per ``predict_step``, decoded with the engine's batched Jacobi
decoder (KV cache, blocks in phase), every block's trajectory kept (CLLM §3.2.1, Algorithm 1), augmented, filtered,
and written as one atomic part. ``collect.decoder=ar`` keeps the answers only, decoded with the batched AR decoder
(the target's own greedy answers as training data, the same tokens). ``collect.engine`` names the decoding engine:
eager, or the fast path's (a static cache for the batch, the forward compiled per width)."""

from __future__ import annotations

import time
from typing import Callable

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException
import torch

from lit_spec.collection.plan import derive_seed
from lit_spec.data.trajectories import augment_states, write_part
from lit_spec.decoding.ar import ARDecoder
from lit_spec.decoding.fast import FastForward
from lit_spec.decoding.jacobi import JacobiDecoder
from lit_spec.decoding.state import eos_ids, until_eos


def make_record(split: str, index: int, prompt_ids: list[int], reference_ids: list[int], answer: list[int],
                trajectory: list, augment: dict, generator: torch.Generator, repetition_filter, tokenizer) -> dict:
    """One record of the format from a row's answer and its Jacobi trajectories (one list of states per block; none
    for an answers-only collection)."""
    blocks = [{"states": states, "augmented": augment_states(states, augment["copies"], augment["prob"], generator)}
              for states in trajectory]
    reason = None
    if repetition_filter is not None:
        reason = repetition_filter.reason(answer, tokenizer.decode(answer, skip_special_tokens=True))
    return {"id": f"{split}/{index:06d}", "split": split, "prompt_ids": prompt_ids, "answer_ids": answer,
            "reference_ids": reference_ids, "blocks": blocks, "keep": reason is None, "drop_reason": reason}


class TrajectoryCollector(L.LightningModule):
    """Decodes one planned batch per ``predict_step`` and writes its part; the target loads in ``configure_model``."""

    def __init__(self, model_spec, tokenizer, out_dir: str, n_tokens: int, max_new_tokens: int, init: str,
                 seed: int, augment: dict, repetition_filter=None,
                 on_done: Callable[[float, float], None] | None = None, decoder: str | None = None,
                 engine: str | None = None, longest_prompt: int = 0):
        super().__init__()
        self.model_spec, self.tokenizer, self.out_dir, self.decoder = model_spec, tokenizer, out_dir, decoder
        self.engine, self.longest_prompt = engine or "eager", longest_prompt
        self.n_tokens, self.max_new_tokens, self.init, self.seed = n_tokens, max_new_tokens, init, seed
        self.augment, self.repetition_filter, self.on_done = augment, repetition_filter, on_done
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.model_spec.load_model().eval().requires_grad_(False)

    def on_predict_start(self) -> None:
        if self.engine != "eager":     # the static cache sized once for the longest prompt: no width compiles twice
            FastForward.of(self.model, self.engine).reserve(FastForward.positions(self.longest_prompt,
                                                                                  self.max_new_tokens))
        self.start = time.perf_counter()

    def on_predict_batch_start(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Stop at a batch boundary on SIGTERM, which Lightning's predict loop only notes (``run_collection`` says
        how to resume); every part on disk is whole."""
        if self.trainer.received_sigterm:
            raise SIGTERMException()

    def on_predict_end(self) -> None:
        """Once every process's parts are on disk, rank zero gets the decoding time and the seconds of it spent
        compiling the fast path's shapes (spawned workers included: the launching process never sees them)."""
        self.trainer.strategy.barrier("collect")
        if self.trainer.is_global_zero and self.on_done is not None:
            compiling = FastForward.of(self.model, self.engine).compile_time if self.engine != "eager" else 0.0
            self.on_done(time.perf_counter() - self.start, compiling)

    def decode(self, ids: torch.Tensor, mask: torch.Tensor, seed: int) -> tuple[list[list[int]], list[list]]:
        """Left-padded prompts -> every row's greedy answer (up to EOS) and its blocks' Jacobi trajectories (none
        with ``decoder=ar``)."""
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        if self.decoder == "ar":
            out = ARDecoder(self.model, pad_token_id=pad, engine=self.engine).generate(ids, self.max_new_tokens, eos,
                                                                                     mask)
            ends = eos_ids(eos)
            answers = [until_eos(row[ids.size(1):], ends) for row in out.sequences.tolist()]
            return answers, [[] for _ in answers]
        decoder = JacobiDecoder(self.model, self.n_tokens, self.init, seed=seed, return_trajectory=True,
                                align_blocks=True, pad_token_id=pad, engine=self.engine)
        trajectories = decoder.generate(ids, self.max_new_tokens, eos, mask).extras["trajectories"]
        return [[t for states in blocks for t in states[-1]] for blocks in trajectories], trajectories

    def predict_step(self, batch: dict) -> dict:
        split, b, prompts = batch["split"], batch["batch"], batch["prompt_ids"]
        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(prompts):  # left padding: every row's last prompt token in the last column
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        seed = derive_seed(self.seed, split, b)
        answers, trajectories = self.decode(ids.to(self.device), mask.to(self.device), seed)
        records = [make_record(split, i, prompts[r], batch["reference_ids"][r], answers[r], trajectories[r],
                               self.augment, torch.Generator().manual_seed(derive_seed(self.seed, split, b, r)),
                               self.repetition_filter, self.tokenizer)
                   for r, i in enumerate(batch["index"])]
        write_part(self.out_dir, split, b, records)  # atomic; a batch dealt twice is written twice, identically
        return {"tokens": sum(len(r["answer_ids"]) for r in records)}
