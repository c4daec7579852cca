"""4D attention masks with explicit position ids, for every shape of block a decoder feeds the model.

A block of ``q`` new tokens attends to (a) the valid positions of the cache (``past_valid``: padding and holes left
by rejected tokens are False) and (b) the new tokens it may see (``visible``: [q, q] or [B, q, q] booleans). The
result is the additive float mask transformers accepts with ``position_ids`` ([B, 1, q, past + q], 0 or -inf).
Positions are ``start + depth``: tokens at the same depth (tree siblings, parallel branches) share a position.
``noise_aware`` is the training-side mask of Jacobi Forcing and packed CLLM: several streams packed in one
sequence.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=256)
def causal(q: int, device=None) -> torch.Tensor:
    """Each token sees itself and the tokens before it: a plain block (AR, speculative, Jacobi). Cached: read-only."""
    return torch.ones(q, q, dtype=torch.bool, device=device).tril()


def from_parents(parents: list[int], device=None) -> torch.Tensor:
    """Visibility of a token tree given each node's parent index (-1 for a root): a node sees its ancestors.

    Covers trees (Medusa-style), several candidate branches sharing positions, and lookahead's n-gram branches.
    """
    q = len(parents)
    visible = torch.eye(q, dtype=torch.bool, device=device)
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"parent {p} of node {i} must come before it")
        if p >= 0:
            visible[i] |= visible[p]
    return visible


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def attention_mask(past_valid: torch.Tensor, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, q, P + q] additive mask from ``past_valid`` [B, P] and ``visible`` [q, q] or [B, q, q]."""
    b, q = past_valid.size(0), visible.size(-1)
    visible = visible.expand(b, q, q) if visible.dim() == 2 else visible
    allowed = torch.cat([past_valid[:, None, :].expand(b, q, -1), visible], dim=-1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


CONTEXT, PADDING = 0, -1     # streams of ``noise_aware``: the shared context, padding
NOISY, CLEAN = 1, 2          # the packed blocks' two copies: a noisy state and the fixed point


def noise_aware(streams: torch.Tensor, positions: torch.Tensor, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Jacobi Forcing's noise-aware causal mask (paper Fig. 6: clean and noisy blocks packed in one sequence) as
    [B, L, L] booleans (query, key) from each token's stream and position id ([B, L] each): a token sees the context
    and its own stream up to its position; the context sees only itself (causal), padding only itself. So the clean
    stream is plain teacher-forced AR over the answer, and the noisy stream reads noisy blocks only.

    With ``blocks`` ([B, L]: each token's block), a noisy token reads the clean blocks before its own and its own
    noisy block instead: CLLM's student input c + y, every block of a record in one sequence (the authors' later
    CLLM trainer, JacobiForcing ``soft_flexattn_cllm_trainer.py``)."""
    query, key = streams[:, :, None], streams[:, None, :]
    earlier = positions[:, None, :] <= positions[:, :, None]
    same = (key == query) | ((key == CONTEXT) & (query != PADDING))
    visible = same & earlier
    if blocks is not None:
        own, before = blocks[:, None, :] == blocks[:, :, None], blocks[:, None, :] < blocks[:, :, None]
        reads = (key == CONTEXT) | ((key == NOISY) & own & earlier) | ((key == CLEAN) & before)
        visible = torch.where(query == NOISY, reads, visible)
    eye = torch.eye(streams.size(1), dtype=torch.bool, device=streams.device)
    return (visible & (query != PADDING)) | (eye & (query == PADDING))
