"""``speculative``: a draft model proposes ``gamma`` tokens, the target verifies them in one forward (Leviathan et al.
2023, Chen et al. 2023). Greedy (temperature 0) is lossless: the output equals the target's greedy decode. Sampling
(temperature > 0, optional top_k / top_p) uses rejection sampling, which leaves the target's distribution exactly
unchanged.

Target and draft keep their own KV caches (``DecodeState`` and ``DraftRunner``); after each verification both are
rolled back to the accepted prefix. Batch size 1.
"""

from __future__ import annotations

import torch

from lit_spec.decoding.base import Decoder, register
from lit_spec.decoding.draft import check_context, check_draft, draft_runner
from lit_spec.decoding.masks import causal
from lit_spec.decoding.state import DecodeState
from lit_spec.decoding.verify import Sampling, greedy_accept_length, speculative_accept
from lit_spec.errors import check_count


@register("speculative")
class SpeculativeDecoder(Decoder):
    def __init__(self, model, draft_model=None, gamma: int = 4, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, **kwargs):
        super().__init__(model, **kwargs)
        check_draft(model, draft_model, "speculative")
        self.draft_model, self.gamma = draft_model, check_count("gamma", gamma)
        self.sampling = Sampling(temperature, top_p, top_k, seed, model.device)

    def pick(self, logits: torch.Tensor) -> int:
        """The token drawn from ``logits`` [V] (target and draft alike): the argmax, or a sample."""
        return int(self.sampling.pick(logits))

    def _decode(self, state: DecodeState) -> None:
        state.require_single_row(self.name)
        check_context(self.draft_model, state, self.name)
        draft = draft_runner(self.draft_model, state)
        prompt = state.prompt[0][state.prompt_mask[0].bool()].tolist()
        state.commit([[self.pick(state.prefill()[0])]], advance=[0])
        device = state.pending.device
        while not state.finished:
            # never draft beyond what can still be committed (n accepted + 1 extra <= room)
            gamma = min(self.gamma, state.max_new_tokens - len(state.out[0]) - 1)
            forwards, seconds = draft.forwards, draft.seconds
            drafts, draft_logits = draft.propose(prompt + state.out[0], gamma, self.pick)
            block = torch.tensor([[int(state.pending[0])] + drafts], device=device)
            logits = state.forward(block, causal(gamma + 1, device))[0]          # [gamma + 1, V]
            if self.sampling.temperature == 0:
                target = logits.argmax(-1).tolist()
                n = greedy_accept_length(drafts, target)
                extra = target[n]
            else:
                n, extra = speculative_accept(block[0, 1:], self.sampling.probs(draft_logits),
                                              self.sampling.probs(logits), self.sampling.generator)
            state.keep_prefix(gamma + 1, [n + 1])
            stats = state.stats
            stats.draft_forwards += draft.forwards - forwards
            stats.draft_time += draft.seconds - seconds
            state.commit([drafts[:n] + [extra]], advance=[n + 1], drafted=[gamma])
