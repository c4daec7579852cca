"""``prompt_lookup``: prompt lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding; in
transformers as ``generate(..., prompt_lookup_num_tokens=)``). Speculative decoding whose draft is no model but a
string match: the tokens that followed the latest earlier occurrence of the last n tokens of prompt + output
(``phrases.ngram_continuation``, n from ``max_ngram`` down to ``min_ngram``), up to ``num_draft_tokens`` of them,
verified in one target forward like greedy speculative decoding (the longest prefix equal to the target's argmax,
plus the target's own next token); the KV cache is rolled back to the accepted prefix. With no match the step is a
plain one-token step. Lossless: greedy, or at temperature > 0 rejection sampling with the drafts as point masses
(``verify.RejectionSampling``, as vLLM samples its n-gram drafts); batch size 1. Pays off where the output copies its
input (summaries, code edits, document QA) or repeats itself.
"""

from __future__ import annotations

import torch

from lit_spec.decoding.base import Decoder, register
from lit_spec.decoding.masks import causal
from lit_spec.decoding.phrases import ngram_continuation
from lit_spec.decoding.state import DecodeState
from lit_spec.decoding.verify import draw, greedy_accept_length, rejection_sampler
from lit_spec.errors import ConfigError, check_count


@register("prompt_lookup")
class PromptLookupDecoder(Decoder):
    def __init__(self, model, num_draft_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None, **kwargs):
        super().__init__(model, **kwargs)
        self.sampler = rejection_sampler(temperature, top_p, top_k, seed, model.device)
        self.num_draft_tokens = check_count("num_draft_tokens", num_draft_tokens)
        self.max_ngram = check_count("max_ngram", max_ngram)
        self.min_ngram = check_count("min_ngram", min_ngram)
        if self.min_ngram > self.max_ngram:
            raise ConfigError(f"min_ngram={min_ngram} > max_ngram={max_ngram}: the n-gram sizes tried run from "
                              "max_ngram down to min_ngram")

    def _decode(self, state: DecodeState) -> None:
        state.require_single_row(self.name)
        prompt = state.prompt[0][state.prompt_mask[0].bool()].tolist()
        state.commit([[draw(self.sampler, state.prefill()[0])]], advance=[0])
        device = state.pending.device
        while not state.finished:
            out = state.out[0]
            # never draft beyond what can still be committed (n accepted + the target's own token <= room)
            room = min(self.num_draft_tokens, state.max_new_tokens - len(out) - 1)
            drafts = ngram_continuation(prompt + out, self.max_ngram, room, self.min_ngram) if room else []
            q = len(drafts) + 1
            logits = state.forward(torch.tensor([out[-1:] + drafts], device=device), causal(q, device))[0]
            if self.sampler is None:
                target = logits.argmax(-1).tolist()
                n = greedy_accept_length(drafts, target)
                extra = target[n]
            else:       # a chain: block position i's parent is i - 1
                path, extra = self.sampler.choose(list(range(-1, q - 1)), out[-1:] + drafts, logits)
                n = len(path)
            state.keep_prefix(q, [n + 1])
            state.commit([drafts[:n] + [extra]], advance=[n + 1], drafted=[len(drafts)])
