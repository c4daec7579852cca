"""The AR baseline, methods part (``decoding/ar.py`` decodes with it): ``method=ar``, next-token cross-entropy
fine-tuning of a causal LM, prompt tokens masked.

The "fine-tuned baseline" of the CLLM tables, and the stage that pretrains the tiny offline target.
"""

from __future__ import annotations

import torch

from lit_spec.data import IGNORE_INDEX
from lit_spec.methods.method_module import MethodModule


class ARModule(MethodModule):
    """Args (besides ``MethodModule``'s):
        mask_prompt: exclude prompt tokens from the loss (true for fine-tuning; false to pretrain from scratch).
    """

    def __init__(self, model_spec, mask_prompt: bool = True, **kwargs):
        super().__init__(model_spec, mask_prompt=mask_prompt, **kwargs)

    def _labels(self, batch: dict) -> torch.Tensor:
        if self.hparams.mask_prompt:
            return batch["labels"]
        return batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)

    def _loss(self, batch: dict) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          labels=self._labels(batch)).loss

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["input_ids"].size(0))
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        n = int((self._labels(batch)[:, 1:] != IGNORE_INDEX).sum())  # weight batches by their target tokens
        self.log("val/loss", self._loss(batch), prog_bar=True, sync_dist=True, batch_size=max(n, 1))
