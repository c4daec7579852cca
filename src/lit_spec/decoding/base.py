"""The decoder interface and ``lit_spec.decoding.generate(model, input_ids, method=NAME, **params)``."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from lit_spec.decoding.fast import ENGINES, FastForward
from lit_spec.decoding.state import DecodeState, FastDecodeState, eos_ids, until_eos
from lit_spec.decoding.stats import DecodeStats, sync_device
from lit_spec.errors import ConfigError

DECODERS: dict[str, type["Decoder"]] = {}


def register(name: str):
    def wrap(cls):
        cls.name = name
        DECODERS[name] = cls
        return cls

    return wrap


@dataclass
class DecodeOutput:
    sequences: torch.Tensor                 # [B, prompt + new], right-padded with the pad token
    stats: DecodeStats
    extras: dict = field(default_factory=dict)   # method-specific (e.g. Jacobi trajectories)


class Decoder(ABC):
    """One decoding method over a target model. Subclasses implement ``_decode(state)``."""

    name = "decoder"
    record_hidden = False   # the decode needs the target's last hidden states (``DecodeState.hidden``), or those of
                            # the ``hidden_states`` indices it names
    greedy_only = False     # Jacobi-style decoders: temperature 0 only (``verify.require_greedy`` says why)
    hooked_forward = False  # the decode changes the target's forward through module hooks (Hidden Transfer's maps),
                            # which a frozen package, exported ahead of time, would not run: frozen is refused

    def __init__(self, model, pad_token_id: int | None = None, engine: str = "eager"):
        """``engine``: ``eager`` (transformers' dynamic cache, every forward eager), ``static``, ``compiled`` or
        ``frozen`` (the fast path, ``lit_spec.decoding.fast``: a static cache, and the target forward compiled per
        width, ``frozen`` with the weights compiled in)."""
        self.model = model
        self.set_engine(engine)
        cfg = model.generation_config if getattr(model, "generation_config", None) is not None else model.config
        self.pad_token_id = pad_token_id if pad_token_id is not None else (
            cfg.pad_token_id if cfg.pad_token_id is not None else model.config.eos_token_id)
        if isinstance(self.pad_token_id, list):
            self.pad_token_id = self.pad_token_id[0]
        if self.pad_token_id is None:
            self.pad_token_id = 0

    def set_engine(self, engine: str) -> None:
        """Run the target's forwards on ``engine`` from now on (the speedup callback sets its own on the decoders a
        method offers)."""
        if engine not in ENGINES:
            raise ConfigError(f"engine={engine!r}: choose one of {ENGINES}")
        if engine == "frozen" and self.hooked_forward:
            raise ConfigError(f"{self.name}: engine=frozen runs a graph exported ahead of time, which does not run the "
                              "forward hooks this decoder drafts through; choose engine=compiled, static or eager")
        self.fast = None if engine == "eager" else FastForward.of(self.model, engine)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | list[int] | None = None,
                 attention_mask: torch.Tensor | None = None) -> DecodeOutput:
        """Decode ``input_ids`` [B, L] (left-padded when ``attention_mask`` marks padding) for up to
        ``max_new_tokens``, stopping a row at ``eos_token_id``."""
        args = (self.model, input_ids, attention_mask, max_new_tokens, eos_token_id, self.record_hidden)
        state = DecodeState(*args) if self.fast is None else FastDecodeState(self.fast, *args)
        engines = self.fast_engines()
        compiling = [*engines, *self.draft_steps()]      # the target's first, then the drafts'
        compiled_before = [c.compile_time for c in compiling]
        sync_device(input_ids.device)
        start = time.perf_counter()
        with ExitStack() as spans:
            for engine in engines:
                spans.enter_context(engine.attention())
            extras = self._decode(state) or {}
        sync_device(input_ids.device)
        state.stats.wall_time = time.perf_counter() - start
        if self.fast:     # compiling a new width is kept out of the timings, each model's out of its own forwards
            target, *drafts = (c.compile_time - before for c, before in zip(compiling, compiled_before))
            state.stats.compile_time = target + sum(drafts)
            state.stats.wall_time -= state.stats.compile_time
            state.stats.forward_time -= target
            state.stats.draft_time -= sum(drafts)
        return DecodeOutput(state.sequences(self.pad_token_id), state.stats, extras)

    def fast_engines(self) -> list[FastForward]:
        """The fast engines a decode runs on: the target's, then each draft model's (of the same kind); none eager."""
        if self.fast is None:
            return []
        return [self.fast, *(FastForward.of(d, self.fast.kind) for d in self.draft_models())]

    def draft_models(self) -> list:
        """The transformers draft models this decoder runs beside the target (on the fast path when it is)."""
        draft = getattr(self, "draft_model", None)
        return [draft] if draft is not None else []

    def draft_steps(self) -> list:
        """The compiled steps of a draft that is not a transformers model (``DraftStep``: EAGLE-3's layer), on the
        target's engine kind; none eager."""
        return []

    @abstractmethod
    def _decode(self, state: DecodeState) -> dict | None: ...

    def reset(self) -> None:
        """Forget what earlier ``generate`` calls left behind (a decoder that learns across prompts, like Ouroboros's
        phrase pool, starts over); the bench calls it after warm-up so warm-up prompts teach nothing."""


def new_tokens(sequences: torch.Tensor, prompt_len: int, eos: int | None) -> list[int]:
    """The tokens after the prompt of ``sequences``' first row, up to and including the first ``eos`` (padding after
    it dropped): what a decoder or ``model.generate`` answered."""
    return until_eos(sequences[0, prompt_len:].tolist(), eos_ids(eos))


def generate(model, input_ids: torch.Tensor, method: str = "ar", max_new_tokens: int = 128,
             eos_token_id=None, attention_mask=None, **params) -> DecodeOutput:
    """``generate(model, ids, method="jacobi", n_tokens=16, max_new_tokens=256)``: build the decoder and run it."""
    if method not in DECODERS:
        raise ConfigError(f"unknown decoding method {method!r}; available: {sorted(DECODERS)}")
    decoder = DECODERS[method](model, **params)
    return decoder.generate(input_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                            attention_mask=attention_mask)
