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
import torch.nn.functional as F

from lit_spec.decoding.base import register
from lit_spec.decoding.cache import GrowingLayer
from lit_spec.decoding.draft_heads import _count_draft, load_draft
from lit_spec.decoding.draft_step import DraftStep, SteppedDraft
from lit_spec.decoding.state import DecodeState
from lit_spec.decoding.tree import TreeDecoder
from lit_spec.errors import ConfigError
from lit_spec.models.dflash import DFlashDraft


def draft_forward(draft: DFlashDraft, caches: list, features: torch.Tensor, context_positions: torch.Tensor,
                  block: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor | None, k: int) -> torch.Tensor:
    """Append the target's ``features`` [m, kH] at ``context_positions`` [m] to every layer's cache (``caches``), then
    run ``block`` [Q] (-1: a mask slot) at ``positions`` [Q], its rows seeing the caches' keys and the block where
    ``allowed`` [Q, keys + Q] (None: all): the top-``k`` target ids [Q - 1, k] of slots 1..Q-1. What ``DraftStep``
    compiles on the fast path."""
    context = [cache.update(*kv) for cache, kv in zip(caches, draft.context(features[None], context_positions[None]))]
    states = draft(block[None], positions[None], context, None if allowed is None else allowed[None, None])
    return draft.logits(states[0, 1:]).topk(k, dim=-1).indices


class DFlashCandidates:
    """One decode's drafting state: every draft layer's context keys and values of the verified prefix (``length``
    rows). Eager, they grow as the decode does; on the fast path they are static layers kept by the decoder, each
    forward's context and block padded to power-of-two widths (a pad row is seen by no real one, and the context's are
    rolled back) and run through the compiled ``step``. Each slot scores its ``k`` best tokens."""

    def __init__(self, draft: DFlashDraft, step: DraftStep, caches: list | None, k: int):
        self.draft, self.step, self.k = draft, step, k
        self.static = caches is not None
        self.kv = caches if self.static else [GrowingLayer() for _ in draft.layers]
        draft.rotary.on(draft.fc.weight.device)
        self.length = 0

    def __call__(self, state: DecodeState, depth: int, k: int) -> torch.Tensor:
        """The top-``k`` tokens [depth, k] of block slots 1..``depth``, after reading the last forward's features."""
        start = time.perf_counter()
        features = state.hidden[0]                                        # [m, kH]
        m, q, device = features.size(0), depth + 1, features.device
        context_positions = torch.arange(self.length, self.length + m, device=device)
        block = torch.full((q,), -1, dtype=torch.long, device=device)
        block[0] = state.pending[0]
        positions = torch.arange(self.length + m, self.length + m + q, device=device)
        context, width = self.step.width(m), self.step.width(q)
        allowed, keys = None, 0
        if self.static:           # of every key the caches hold: the valid context, and the block's real rows
            keys = self.kv[0].max_cache_len
            if self.length + context > keys:
                raise RuntimeError(f"dflash: {self.length + context} context rows in a cache of {keys}")
            allowed = torch.zeros(width, keys + width, dtype=torch.bool, device=device)
            allowed[:, : self.length + m] = True
            allowed[:, keys: keys + q] = True
            features = F.pad(features, (0, 0, 0, context - m))
            context_positions = F.pad(context_positions, (0, context - m))
            block, positions = F.pad(block, (0, width - q), value=-1), F.pad(positions, (0, width - q))
        top = self.step(f"{context}+{width}/top{self.k}@{keys}", self.kv, features, context_positions, block,
                        positions, allowed, self.k)
        if context > m:
            for cache in self.kv:
                cache.crop(m - context)
        self.length += m
        _count_draft(state, start, 1)
        return top[:depth, :k]


@register("dflash")
class DFlashDecoder(SteppedDraft, TreeDecoder):
    """Block drafting with a DFlash draft (``heads``: a ``DFlashDraft`` or a directory from ``save_heads``);
    ``tree``: top-k per slot (default: the chain of the draft's block, ``[1] * (block_size - 1)``) or paths."""

    needs_draft = False
    draft_forward = staticmethod(draft_forward)

    def __init__(self, model, heads, tree=None, **kwargs):
        self.draft = load_draft(heads, DFlashDraft, model)
        tree = [1] * (self.draft.block_size - 1) if tree is None else tree
        super().__init__(model, tree=tree, **kwargs)
        if self.spec.depth > self.draft.block_size - 1:
            raise ConfigError(f"tree of depth {self.spec.depth}: a block of {self.draft.block_size} drafts at most "
                              f"{self.draft.block_size - 1} tokens")
        self.record_hidden = self.draft.hidden_states

    def new_candidates(self, state: DecodeState) -> DFlashCandidates:
        """Eager: context caches that grow as the decode does. Fast: the decoder's static layers, one per draft layer
        (a step's context block padded past its tokens: up to twice the draft's block)."""
        caches = None if self.fast is None else self.static_layers(list(self.draft.layers), state,
                                                                   2 * self.draft.block_size)
        return DFlashCandidates(self.draft, self.step, caches, self.spec.top_k)
