"""DFlash, methods part (the models/ and decoding/ files of this name build the draft and decode with it):
``method=dflash``, the DFlash draft trained on a frozen target (z-lab, arXiv 2602.06036; SpecForge's and vLLM
speculators' trainers).

Every batch runs the frozen target once, without gradient, for its features at the draft's layers and its logits.
Per sequence, up to ``max_anchors`` random anchor positions a (each followed by an answer token) open one block each:
[token a, B - 1 mask slots] at positions a..a+B-1. All blocks of a batch go through the draft in one forward, under one
mask: a block sees the context strictly before its anchor and itself in both directions, never another block. Slot k
(1..B-1) is trained to give the target's own next token at position a + k (its argmax at a + k - 1, what greedy
verification accepts), by cross-entropy weighted

    w_k = exp(-(k - 1) / gamma)        (z-lab's decay: the first slots decide the accepted length; gamma 7 for B 16)

averaged over the counted slots (a + k inside the sequence and an answer position). Logged per slot k: ``acc`` (the
draft's top-1 is the target's token), and ``expected_tau`` = 1 + sum_d prod_{k<=d} acc_k, the τ of a chain of B - 1
if each slot's acceptance were independent. With ``data.base_states`` the target's states come from the cache (the
feature layers, then the last) instead of a forward per batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_spec.data import IGNORE_INDEX
from lit_spec.decoding.dflash import DFlashDecoder
from lit_spec.errors import ConfigError, check_count
from lit_spec.methods.frozen_base import FrozenBaseModule, check_cached_states
from lit_spec.models.dflash import DFlashDraft


def anchors_of(answer: torch.Tensor, valid: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` random anchors per row [B, count] (positions a >= 1 whose next token is an answer token, in
    ``valid``), and which of them are real ([B, count]: a row with fewer candidates pads)."""
    b, t = answer.shape
    position = torch.arange(t, device=answer.device)
    candidate = valid & (position >= 1) & (position + 1 < t)
    candidate[:, :-1] &= answer[:, 1:]
    scores = torch.rand(b, t, device=answer.device).masked_fill(~candidate, -1.0)
    top = scores.topk(min(count, t), dim=-1)
    return top.indices, top.values >= 0


def block_mask(anchors: torch.Tensor, real: torch.Tensor, valid: torch.Tensor, block: int) -> torch.Tensor:
    """[B, 1, Q, T + Q] (Q = anchors · block): a block's queries see the valid context before its anchor and their own
    block, never another block; a padding block sees only itself."""
    b, a = anchors.shape
    t = valid.size(1)
    context = (torch.arange(t, device=anchors.device) < anchors[..., None]) & valid[:, None] & real[..., None]
    context = context[:, :, None].expand(b, a, block, t).reshape(b, a * block, t)
    own = torch.arange(a, device=anchors.device).repeat_interleave(block)
    same = (own[:, None] == own[None]).expand(b, -1, -1)
    return torch.cat([context, same], dim=-1)[:, None]


class DFlashModule(FrozenBaseModule):
    """Args (besides ``MethodModule``'s): num_layers (draft layers), block_size (B), layers (the target layers whose
    outputs the draft reads; null: z-lab's, one per draft layer from 1 to n - 3), gamma (the slots' loss decay),
    max_anchors (blocks per sequence), mask_token_id (the id the export gives the mask slot), decoder (the ``dflash``
    decoder's settings the speedup callback measures: tree)."""

    def __init__(self, model_spec, num_layers: int = 1, block_size: int = 16, layers=None, gamma: float = 7.0,
                 max_anchors: int = 512, mask_token_id: int = 0, decoder: dict | None = None, **kwargs):
        check_count("method.num_layers", num_layers)
        check_count("method.block_size", block_size, minimum=2)
        check_count("method.max_anchors", max_anchors)
        if not gamma > 0:
            raise ConfigError(f"method.gamma={gamma}: the loss decay must be > 0 (z-lab: 7 for blocks of 16)")
        super().__init__(model_spec, num_layers=num_layers, block_size=block_size,
                         layers=None if layers is None else list(layers), gamma=gamma, max_anchors=max_anchors,
                         mask_token_id=mask_token_id, decoder=dict(decoder or {}), **kwargs)

    def build_trainable(self) -> DFlashDraft:
        hp = self.hparams
        draft = DFlashDraft.for_target(self.model.config, hp.num_layers, hp.block_size, hp.layers, hp.mask_token_id)
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        check_cached_states(getattr(datamodule, "base_states", None), draft.hidden_states,
                            self.model.config.num_hidden_layers, "dflash")
        return draft.init_from_base(self.model)

    def decoders(self, **sampling) -> dict:
        return {"dflash": DFlashDecoder(self.model, self.heads, **self.hparams.decoder, **sampling)}

    def _step(self, batch: dict, stage: str) -> torch.Tensor:
        hp, draft = self.hparams, self.heads
        ids, valid = batch["input_ids"], batch["attention_mask"].bool()
        answer = (batch["labels"] != IGNORE_INDEX) & valid
        features, logits = self.base_states(batch, draft.hidden_states)
        (b, t), n = ids.shape, hp.block_size
        anchors, real = anchors_of(answer, valid, hp.max_anchors)
        positions = anchors[..., None] + torch.arange(n, device=ids.device)                  # [B, A, n]
        tokens = torch.full_like(positions, -1)
        tokens[..., 0] = ids.gather(1, anchors)
        context = draft.context(features, torch.arange(t, device=ids.device).expand(b, -1))
        states = draft(tokens.flatten(1), positions.flatten(1), context, block_mask(anchors, real, valid, n))
        states = states.unflatten(1, (anchors.size(1), n))[:, :, 1:]                         # slots 1..n-1
        target = positions[..., 1:]
        inside = target < t
        target = target.clamp(max=t - 1)
        labels = logits.argmax(-1).gather(1, (target - 1).flatten(1)).view_as(target)     # the target's next token
        counted = real[..., None] & inside & answer.gather(1, target.flatten(1)).view_as(target)
        rows = counted.nonzero(as_tuple=True)
        student = draft.logits(states[rows]).float()
        slot = rows[2]                                                                        # k - 1
        weight = torch.exp(-slot.float() / hp.gamma)                                          # w_k
        loss = ((weight * F.cross_entropy(student, labels[rows], reduction="none")).sum() / weight.sum()
                if slot.numel() else states.sum() * 0.0)
        hit = (student.argmax(-1) == labels[rows]).float()
        accepted, tau = 1.0, 1.0
        for k in range(n - 1):
            at = slot == k
            acc = float(hit[at].mean()) if bool(at.any()) else 0.0
            accepted *= acc
            tau += accepted
            self.log(f"{stage}/slot{k + 1}/acc", acc, batch_size=max(int(at.sum()), 1), sync_dist=True)
        self.log(f"{stage}/expected_tau", tau, batch_size=b, sync_dist=True)
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=b, sync_dist=True)
        return loss
