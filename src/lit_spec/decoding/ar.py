"""The AR baseline, decoding part (``methods/ar.py`` trains it): ``ar``, autoregressive decoding with a KV cache, greedy or sampled — the baseline every speedup is measured
against. One target forward per token, nothing else: as fast as a plain decode loop can be."""

from __future__ import annotations

import torch

from lit_spec.decoding.base import Decoder, register
from lit_spec.decoding.state import DecodeState
from lit_spec.decoding.verify import check_sampling, logits_to_probs


@register("ar")
class ARDecoder(Decoder):
    def __init__(self, model, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, **kwargs):
        super().__init__(model, **kwargs)
        self.temperature, self.top_p = check_sampling(temperature, top_p)
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator(device=model.device).manual_seed(seed)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0:
            return logits.argmax(-1)
        probs = logits_to_probs(logits, self.temperature, self.top_p)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def _decode(self, state: DecodeState) -> None:
        token = self.pick(state.prefill())
        state.commit([[t] for t in token.tolist()], advance=[0] * token.size(0))
        while not state.finished:
            token = self.pick(state.forward_next())
            state.commit([[t] for t in token.tolist()], advance=[1] * token.size(0))
