"""The AR baseline, decoding part (``methods/ar.py`` trains it): ``ar``, autoregressive decoding with a KV cache, greedy or sampled — the baseline every speedup is measured
against. One target forward per token, nothing else: as fast as a plain decode loop can be."""

from __future__ import annotations

from lit_spec.decoding.base import Decoder, register
from lit_spec.decoding.state import DecodeState
from lit_spec.decoding.verify import Sampling


@register("ar")
class ARDecoder(Decoder):
    def __init__(self, model, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 **kwargs):
        super().__init__(model, **kwargs)
        self.sampling = Sampling(temperature, top_p, top_k, seed, model.device)

    def _decode(self, state: DecodeState) -> None:
        token = self.sampling.pick(state.prefill())
        state.commit([[t] for t in token.tolist()], advance=[0] * token.size(0))
        while not state.finished:
            token = self.sampling.pick(state.forward_next())
            state.commit([[t] for t in token.tolist()], advance=[1] * token.size(0))
