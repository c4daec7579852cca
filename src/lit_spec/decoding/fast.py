"""The fast path through the one engine (``engine=static`` or ``engine=compiled`` on any decoder): a static KV cache
rolled back by length, the attention mask cut from one additive row per decode, grouped-query attention without
repeating the cache, and (``compiled``) the target forward compiled once per query width, the prefill left eager.

Blocks are padded to a power-of-two width, so a decoder whose block varies (prompt lookup's drafts, a tree that
grows) compiles a few widths, not one per length. A pad token sees only itself and is rolled back with the rejected
tokens. One prompt at a time: the static cache keeps one row (what the bench, the callback and the console decode).
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from lit_spec.decoding import cache as kv
from lit_spec.errors import ConfigError

ENGINES = ("eager", "static", "compiled")
GQA_SDPA = "lit_spec_sdpa_gqa"
CACHE_STEP = 256          # the static cache's length is a multiple of this, so prompts of near lengths share it


def sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa attention, with grouped-query heads reading the shared key/value heads in place under a
    mask too: transformers' ``use_gqa_in_sdpa`` refuses a mask on CPU and CUDA, so every masked forward repeats the
    whole cache per query head (``repeat_kv``)."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=query.size(1) != key.size(1))
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA_SDPA, sdpa_gqa)


def width_bucket(q: int) -> int:
    """The padded width a block of ``q`` tokens runs at: the next power of two."""
    return 1 << (q - 1).bit_length()


class FastForward:
    """One model's fast forwards: its static cache (kept across decodes, grown when a decode needs more) and, when
    compiled, its compiled forward with the seconds each width took to compile (``compile_seconds``)."""

    _engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, model, compiled: bool) -> "FastForward":
        """The model's engine (one per model and setting, so compiled widths and the cache are reused)."""
        engines = cls._engines.setdefault(model, {})
        if compiled not in engines:
            engines[compiled] = cls(model, compiled)
        return engines[compiled]

    def __init__(self, model, compiled: bool):
        attention = model.config._attn_implementation
        if attention not in ("sdpa", GQA_SDPA):
            raise ConfigError(f"the fast decoding path runs sdpa attention; this model uses {attention!r}: load it "
                              "with model.attn_implementation=sdpa or decode with engine=eager")
        self.model, self.compiled = model, compiled
        self.cache: kv.StaticCache | None = None
        self.cache_length = 0
        self.compile_seconds: dict[tuple[int, bool, int], float] = {}
        self.cache_keyword = next(iter(kv.cache_argument(model, None)))   # looked up once, outside compiled code
        self._run = self._forward
        if compiled:
            # the widths (powers of two) x hidden states or not stay well under this; the default (8) could not
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
            self._run = torch.compile(self._forward, dynamic=False, fullgraph=True)

    @property
    def compile_time(self) -> float:
        return sum(self.compile_seconds.values())

    @staticmethod
    def positions(prompt_length: int, max_new_tokens: int) -> int:
        """The cache positions a decode may use: its tokens plus the widest block a decoder feeds (checked at each
        forward)."""
        return prompt_length + max_new_tokens + CACHE_STEP

    def reserve(self, length: int) -> None:
        """A static cache of at least ``length`` positions. A longer one is allocated, and every width compiled anew
        for its shapes, only when a decode needs more: the bench reserves its longest prompt's before warm-up."""
        if self.cache_length < length:
            self.cache_length = -(-length // CACHE_STEP) * CACHE_STEP
            self.cache = kv.static_cache(self.model, self.cache_length)

    def new_cache(self, length: int) -> kv.StaticCache:
        """The static cache, emptied, holding at least ``length`` positions."""
        self.reserve(length)
        kv.set_length(self.cache, 0)
        return self.cache

    def __call__(self, ids, mask, position_ids, hidden: bool, eager: bool = False):
        """Run the model on ``ids`` [1, q] against the static cache (inside ``attention()``); ``eager`` for the
        prefill."""
        if eager or not self.compiled:
            return self._forward(ids, mask, position_ids, hidden)
        key = (ids.size(1), hidden, self.cache_length)   # a longer cache recompiles every width
        if key in self.compile_seconds:
            return self._run(ids, mask, position_ids, hidden)
        start = time.perf_counter()
        out = self._run(ids, mask, position_ids, hidden)
        self.compile_seconds[key] = time.perf_counter() - start
        return out

    def _forward(self, ids, mask, position_ids, hidden: bool):
        return self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                          output_hidden_states=hidden, **{self.cache_keyword: self.cache})

    @contextmanager
    def attention(self):
        """A decode's span: the model attends with ``sdpa_gqa``, then gets its own attention back (a model shared
        with training, as the speedup callback's is, keeps transformers' sdpa outside the fast path)."""
        before = self.model.config._attn_implementation
        self.model.set_attn_implementation(GQA_SDPA)
        try:
            yield
        finally:
            self.model.set_attn_implementation(before)
