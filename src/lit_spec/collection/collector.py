"""The collecting LightningModule: one planned batch per ``predict_step``, decoded with the engine's batched Jacobi
decoder (KV cache, blocks in phase), every block's trajectory kept (CLLM §3.2.1, Algorithm 1), augmented, filtered,
and written as one atomic part."""

from __future__ import annotations

import time
from typing import Callable

import lightning as L
import torch

from lit_spec.collection.plan import derive_seed
from lit_spec.data.trajectories import augment_states, write_part
from lit_spec.decoding.jacobi import JacobiDecoder

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


