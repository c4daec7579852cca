"""Hidden Transfer, decoding part (the models/ and methods/ files of this name build and train its maps):
``hidden_transfer``, tree decoding whose drafts come out of the verification forward itself (Hidden Transfer §3.4).

Each step feeds [pending token + tree nodes] and, for every one of them, k pseudo tokens (``transfer_block``'s
layout); the transfer hooks (``models.hidden_transfer``) turn those into the pseudo states of the k tokens after
their anchor. The tree is verified as by ``tree`` (greedy: lossless), the pseudo entries are dropped from the cache
with the rejected nodes, and the pseudo tokens anchored at the last accepted node give the top-k candidates of the
next tree: no draft model and no extra forward. The first step after the prefill has no candidates yet: it feeds
the pending token and its pseudo tokens only (an AR step that also drafts).
"""

from __future__ import annotations

import torch

from lit_spec.decoding.base import register
from lit_spec.decoding.draft_heads import check_depth, load_draft
from lit_spec.decoding.state import DecodeState
from lit_spec.decoding.tree import TreeDecoder, TreeSpec, commit_tree
from lit_spec.models.hidden_transfer import HiddenTransfer, transfer_block


@register("hidden_transfer")
class HiddenTransferDecoder(TreeDecoder):
    """``transfer``: a ``HiddenTransfer`` or a directory from ``save_heads`` (method=hidden_transfer's export)."""

    # the final (normed) states of the forward: only the k pseudo tokens of the accepted node get the LM head
    needs_draft, record_hidden = False, True
    hooked_forward = True   # the transfer maps are pre-hooks on the target's layers (models.hidden_transfer)

    def __init__(self, model, transfer, tree=(2, 1, 1), **kwargs):
        self.transfer = load_draft(transfer, HiddenTransfer, model).init_from_base(model)
        super().__init__(model, tree=tree, **kwargs)
        self.lm_head = model.get_output_embeddings()
        check_depth(self.transfer, self)
        self._blocks: dict[TreeSpec, tuple[torch.Tensor, torch.Tensor]] = {}

    def _block(self, spec: TreeSpec, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Visibility and positions of [tree + pseudo tokens] for ``spec`` (cached)."""
        if spec not in self._blocks:
            self._blocks[spec] = tuple(x.to(device) for x in transfer_block(
                spec.block_visible, spec.block_depths, self.transfer.num_heads, self.transfer.masked))
        return self._blocks[spec]

    @torch.no_grad()
    def _decode(self, state: DecodeState) -> None:
        state.require_single_row(self.name)
        self.commit_first(state)
        device, k = state.pending.device, self.transfer.num_heads
        candidates = None                                   # [k, top-k] from the last step's pseudo tokens
        while not state.finished:
            spec = self.spec_for(state) if candidates is not None else self.spec.truncated(0)
            real = torch.cat([state.pending[:1], spec.build_candidates(candidates[: spec.depth]).to(device)
                              if len(spec) else state.pending.new_empty(0)])
            visible, depth = self._block(spec, device)
            block = real.repeat(1 + k)[None]                # pseudo inputs: placeholders, replaced by the hooks
            anchors = torch.arange(real.numel(), device=device)
            with self.transfer.planned(real.numel(), anchors):   # logits of the tree only; the pseudo tokens'
                logits = state.forward(block, visible, depth, logits_at=anchors)[0]   # final states are kept
            hidden = state.hidden[0]
            step = commit_tree(state, spec.block_parents, spec.depth, real.tolist(), logits, block.size(1),
                               self.sampler)
            last = step.path[-1] + 1 if step.path else 0    # block index of the last accepted token
            pseudo = self.lm_head(hidden[real.numel() + last:: real.numel()][:k])   # its pseudo tokens, steps 1..k
            candidates = pseudo.topk(self.spec.top_k, dim=-1).indices
