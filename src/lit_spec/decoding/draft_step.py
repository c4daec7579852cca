"""A draft's own step on the fast path, where the draft is not a transformers model (EAGLE-3's layer, DFlash's
layers): the one function it runs per forward, compiled per input shapes on the target's engine kind. ``eager`` and
``static`` run it as it is; ``compiled`` and ``graphs`` read the weights live (``graphs`` replays CUDA graphs on a
GPU); ``frozen`` compiles them in as constants under inductor's freezing and, on a CPU, its autotuned C++ GEMM
templates, which read a one-row GEMM's weights much faster than MKL there (SmolLM2's EAGLE-3 step: 1.8 against 4.0 ms
a forward in a decode on a 2-core EPYC, RESULTS), and refuses weights that changed since. Unlike the target's frozen
packages these live in the process: a draft's shapes compile in seconds, not minutes.
"""

from __future__ import annotations

import time
import weakref
from contextlib import nullcontext

import torch
import torch._inductor.config as inductor_config

from lit_spec.decoding import cache as kv
from lit_spec.decoding.cache import StaticLayer
from lit_spec.decoding.fast import compile_shapes, unchanged_weights, width_bucket
from lit_spec.decoding.frozen import CPU_OPTIONS, GPU_OPTIONS

RECOMPILE_LIMIT = 32      # a draft's widths (powers of two) x its step kinds x cache lengths stay under this


class DraftStep:
    """``fn(module, *args)`` on engine ``kind``; ``compile_seconds`` holds the seconds each shape took to compile (by
    the label its caller gives it, which names everything that compiles anew: widths, top-k, cache length, step
    kind). On the fast path it also keeps the draft's static KV layers (``static_layers``)."""

    _steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, fn, module: torch.nn.Module, kind: str, label: str) -> "DraftStep":
        """The draft's step of ``kind``: one per draft module, function and kind, so that every decoder of that draft
        (a new one per ``generate`` call) reuses what compiled and its static layers."""
        steps = cls._steps.setdefault(module, {})
        if (fn, kind) not in steps:
            steps[fn, kind] = cls(fn, module, kind, label)
        return steps[fn, kind]

    def __init__(self, fn, module: torch.nn.Module, kind: str, label: str):
        self.fn, self.kind, self.label = fn, kind, label
        self._module = weakref.ref(module)
        self.compiled = kind not in ("eager", "static")
        self.compile_seconds: dict[str, float] = {}
        self.weights: tuple | None = None     # frozen: the weights' versions compiled in
        self.layers: list[StaticLayer] = []
        self._run = compile_shapes(fn, kind, RECOMPILE_LIMIT) if self.compiled else fn

    @property
    def compile_time(self) -> float:
        return sum(self.compile_seconds.values())

    def width(self, q: int) -> int:
        """The width ``q`` rows run at: compiled, the next power of two (a few shapes, not one per length)."""
        return width_bucket(q) if self.compiled else q

    def __call__(self, label: str, *args):
        module = self._module()
        if not self.compiled:
            return self.fn(module, *args)
        if self.kind == "frozen":
            self.weights = unchanged_weights(module, self.weights, f"the {self.label} draft's")
        if self.kind == "graphs":
            # each replay a new step, which may overwrite the outputs of earlier ones (no caller keeps one past the
            # next: tests/test_decoding_fast.py)
            torch.compiler.cudagraph_mark_step_begin()
        if label in self.compile_seconds:
            return self._run(module, *args)
        start = time.perf_counter()
        # dynamo reads inductor's freezing flag while it traces, so the flag is set around the compiling call
        with inductor_config.patch(self._frozen_options(module)) if self.kind == "frozen" else nullcontext():
            out = self._run(module, *args)
        self.compile_seconds[label] = time.perf_counter() - start
        return out

    @staticmethod
    def _frozen_options(module) -> dict:
        options = CPU_OPTIONS if next(module.parameters()).is_cpu else GPU_OPTIONS
        return {k: v for k, v in options.items() if not k.startswith("aot_inductor.")}

    def static_layers(self, attentions: list, rows: int) -> list[StaticLayer]:
        """One static layer per draft attention module (``kv_heads``, ``head_dim``), emptied, of at least ``rows``
        positions (grown only when a decode needs more: the length is part of every compiled shape)."""
        if not self.layers or self.layers[0].max_cache_len < rows:
            like = next(self._module().parameters())
            self.layers = [kv.static_layer(attention, rows, like) for attention in attentions]
        for layer in self.layers:
            kv.set_length(layer, 0)
        return self.layers


class SteppedDraft:
    """A decoder mixin, for a decoder whose draft (``self.draft``) is not a transformers model: its ``draft_forward``
    (a static method) runs as the draft's ``DraftStep`` on the target's engine kind."""

    draft_forward = None

    def set_engine(self, engine: str) -> None:
        super().set_engine(engine)
        self.step = DraftStep.of(self.draft_forward, self.draft, engine, self.draft.kind)

    def draft_steps(self) -> list[DraftStep]:
        return [self.step] if self.fast else []

    def static_layers(self, attentions: list, state, step_rows: int, rows_per_token: int = 1) -> list[StaticLayer]:
        """The step's static layers for this decode, ``rows_per_token`` rows a token: the prompt's rows (and the first
        new token's beside them), read at once and padded, every new token's, and the ``step_rows`` a step may add
        after them; at least the target's cache's as many (which the bench sizes for its longest prompt, so that no
        draft shape changes mid-run)."""
        first = self.step.width(rows_per_token * (state.prompt.size(1) + 1) - 1)
        rows = first + rows_per_token * state.max_new_tokens + step_rows
        return self.step.static_layers(attentions, max(rows, rows_per_token * self.fast.cache_length))
