"""DFlash, decoding part (the models/ and methods/ files of this name build and train the draft): ``dflash``, a whole
block drafted in one draft forward, verified by the target as a chain (or as a tree of each slot's top-k).

Each step the draft first turns what the target's last forward cached (the features of those positions,
``DecodeState.hidden`` at the draft's layers: no extra target forward) into every layer's context keys and values,
appended to its own cache. Then one forward of the block [pending token, B - 1 mask slots], at the positions after the
context, gives each slot's distribution over the token at its position; their argmax is the chain the target verifies
(``tree=[1] * (B - 1)``, the default). Lossless: greedy verification keeps the target's output whatever the draft
proposes; at temperature > 0 the tree decoders' rejection sampling (each draft a point mass, as vLLM samples DFlash).
"""

from __future__ import annotations

import time

import torch

from lit_spec.decoding.base import register
from lit_spec.decoding.cache import GrowingLayer
from lit_spec.decoding.draft_heads import _count_draft, load_draft
from lit_spec.decoding.state import DecodeState
from lit_spec.decoding.tree import TreeDecoder
from lit_spec.errors import ConfigError
from lit_spec.models.dflash import DFlashDraft


class DFlashCandidates:
    """One decode's drafting state: every draft layer's context keys and values of the verified prefix."""

    def __init__(self, draft: DFlashDraft):
        self.draft = draft
        self.kv = [GrowingLayer() for _ in draft.layers]
        self.length = 0

    def __call__(self, state: DecodeState, depth: int, k: int) -> torch.Tensor:
        """The top-``k`` tokens [depth, k] of block slots 1..``depth``, after reading the last forward's features."""
        start, draft = time.perf_counter(), self.draft
        features = state.hidden                                           # [1, m, kH]
        m, device = features.size(1), features.device
        positions = torch.arange(self.length, self.length + m, device=device)[None]
        context = [layer.update(*kv) for layer, kv in zip(self.kv, draft.context(features, positions))]
        self.length += m
        block = torch.full((1, depth + 1), -1, dtype=torch.long, device=device)
        block[0, 0] = state.pending[0]
        positions = torch.arange(self.length, self.length + depth + 1, device=device)[None]
        states = draft(block, positions, context, None)                   # the whole context, the block both ways
        top = draft.logits(states[0, 1:]).topk(k, dim=-1).indices
        _count_draft(state, start, 1)
        return top


@register("dflash")
class DFlashDecoder(TreeDecoder):
    """Block drafting with a DFlash draft (``heads``: a ``DFlashDraft`` or a directory from ``save_heads``);
    ``tree``: top-k per slot (default: the chain of the draft's block, ``[1] * (block_size - 1)``) or paths."""

    needs_draft = False

    def __init__(self, model, heads, tree=None, **kwargs):
        self.draft = load_draft(heads, DFlashDraft, model)
        tree = [1] * (self.draft.block_size - 1) if tree is None else tree
        super().__init__(model, tree=tree, **kwargs)
        if self.spec.depth > self.draft.block_size - 1:
            raise ConfigError(f"tree of depth {self.spec.depth}: a block of {self.draft.block_size} drafts at most "
                              f"{self.draft.block_size - 1} tokens")
        self.record_hidden = self.draft.hidden_states

    def new_candidates(self, state: DecodeState) -> DFlashCandidates:
        return DFlashCandidates(self.draft)
