"""The fast path through the one engine (``engine=static``, ``compiled``, ``frozen`` or ``graphs`` on any
decoder): a static KV cache rolled back by length, the attention mask cut from one additive row per decode,
grouped-query attention without repeating the cache, and (but ``static``) the target forward compiled once per query
width, the prefill left eager. ``frozen`` compiles the weights in as constants, ahead of time, into a package per
width kept on disk (``lit_spec.decoding.frozen``), so inductor packs them for its own GEMM kernels and a later
process loads them; a model whose weights change (the speedup callback's) decodes on ``compiled``, which reads them
live. ``graphs`` is ``compiled`` replayed as CUDA graphs on a GPU (one launch a forward); on a CPU
it compiles without them.

Compiled blocks are padded to a power-of-two width, so a decoder whose block varies (prompt lookup's drafts, a tree
that grows) compiles a few widths, not one per length. A pad token sees only itself and is rolled back with the
rejected tokens. A draft model (``speculative``, ``tree``, ``ouroboros``) runs on an engine of its own, of the same
kind. One prompt at a time for every decoder (what the bench, the callback and the console decode); AR and Jacobi
also decode a batch (what collection decodes), its rows in one static cache of one length, each row's invalid entries
masked.
"""

from __future__ import annotations

import inspect
import time
import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from lit_spec.decoding import cache as kv
from lit_spec.decoding.frozen import CPU_OPTIONS, GPU_OPTIONS, FrozenForwards
from lit_spec.errors import ConfigError

ENGINES = ("eager", "static", "compiled", "frozen", "graphs")
GQA_SDPA = "lit_spec_sdpa_gqa"
CACHE_STEP = 256          # the static cache's length is a multiple of this, so prompts of near lengths share it
PLAIN_HEADS = ("llama", "mistral", "qwen2", "qwen3", "phi3")    # model types whose logits are lm_head(last hidden)
RECOMPILE_LIMIT = 64      # an engine's widths (powers of two) x hidden states or not x cache lengths x batches (and
                          # their attended lengths) stay under this


def sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa attention, with grouped-query heads reading the shared key/value heads in place under a
    mask too: transformers' ``use_gqa_in_sdpa`` refuses a mask on CPU and CUDA, so every masked forward repeats the
    whole cache per query head (``repeat_kv``). One half-precision query on a CPU attends in fp32: torch's CPU flash
    kernel takes 412 us for one bf16 query against 104 us cast to fp32 and back (SmolLM2's 9 heads over 768
    positions, a Zen 4 core pair; two bf16 queries take 140 us): 30 layers of it were half a frozen bf16 AR token."""
    dtype = query.dtype
    if attention_mask is not None and attention_mask.size(-1) < key.size(2):     # the filled part of the cache
        key, value = key[:, :, : attention_mask.size(-1)], value[:, :, : attention_mask.size(-1)]
    if query.device.type == "cpu" and query.size(2) == 1 and dtype in (torch.bfloat16, torch.float16):
        query, key, value = query.float(), key.float(), value.float()
        attention_mask = None if attention_mask is None else attention_mask.float()
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=query.size(1) != key.size(1))
    return out.to(dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA_SDPA, sdpa_gqa)


def width_bucket(q: int) -> int:
    """The padded width a block of ``q`` tokens runs at: the next power of two."""
    return 1 << (q - 1).bit_length()


def unchanged_weights(module: torch.nn.Module, seen: tuple | None, whose: str) -> tuple:
    """The versions of ``module``'s weights, refused when they differ from ``seen``: engine=frozen compiled them in
    as constants, and a decode after they changed (an optimizer step) would run the old ones."""
    version = tuple((p.data_ptr(), p._version) for p in module.parameters())
    if seen is not None and seen != version:
        raise ConfigError(f"engine=frozen compiled {whose} weights into its graphs, and they have changed since: "
                          "decode weights that train with engine=compiled (it reads them live)")
    return version


def compile_shapes(fn, kind: str, limit: int):
    """``fn`` under ``torch.compile``, one whole graph per input shapes (``graphs``: replayed as CUDA graphs), with a
    budget of ``limit`` compiles of its own. A torch without per-call budgets (before 2.12; the GPU image's 2.11)
    raises dynamo's process-wide limits instead: each engine's compiles then count against the one code object."""
    options = dict(dynamic=False, fullgraph=True, mode="reduce-overhead" if kind == "graphs" else None)
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        return torch.compile(fn, recompile_limit=limit, isolate_recompiles=True, **options)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, limit)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 64 * limit)
    return torch.compile(fn, **options)


class PackedHead:
    """The LM head on oneDNN's packed fp32 weight, run eagerly after the (compiled) decoder stack and only on the rows
    whose logits are read. MKL's GEMM reads SmolLM2's 49152 x 576 head at 13 GB/s for one row and 5 GB/s for four on a
    2-core EPYC; oneDNN's at 25 and 11 (experiments/RESULTS.md). The weight is packed again when it changes (the
    speedup callback decodes the model it trains)."""

    def __init__(self, head: torch.nn.Linear):
        self.head, self.version, self.packed = head, None, None

    @classmethod
    def of(cls, model) -> "PackedHead | None":
        """The model's packed head, or None where the fast path keeps the model's own (not a CPU fp32 model whose
        logits are its head's output alone, or no oneDNN)."""
        head = model.get_output_embeddings()
        plain = model.config.model_type in PLAIN_HEADS and type(head) is torch.nn.Linear
        if plain and head.weight.device.type == "cpu" and head.weight.dtype == torch.float32 and \
                torch.backends.mkldnn.is_available():
            return cls(head)
        return None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight
        version = (weight.data_ptr(), weight._version)
        if version != self.version:
            self.packed, self.version = weight.detach().to_mkldnn(), version
        rows = hidden.reshape(-1, hidden.size(-1))
        logits = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.head.bias, "none", [], "")
        return logits.view(*hidden.shape[:-1], -1)


class StaticRow:
    """One sequence, or a batch of them in step, on an engine's static cache: ``length`` positions are filled, and
    ``allowed``, the additive mask row of each sequence's cache positions (0 valid, -inf not), is kept in place. A
    block's mask is that row per query with the block's own pattern written over its columns; a rollback moves the
    length, never a tensor, and a row that kept fewer of a block's entries than another masks the rest. The target's
    ``FastDecodeState`` and a draft model's ``DraftRunner`` each keep one."""

    def __init__(self, engine: "FastForward", positions: int, dtype: torch.dtype, device: torch.device,
                 batch: int = 1):
        self.engine, self.cache, self.length = engine, engine.new_cache(positions, batch), 0
        self.min = torch.finfo(dtype).min
        self.allowed = torch.full((batch, engine.cache_length), self.min, dtype=dtype, device=device)

    def run(self, block, visible, position_ids, hidden: bool, rows: slice, valid=None, eager: bool = False):
        """Feed ``block`` [B, q] after the filled positions, its tokens seeing the cache and ``visible`` ([q, q], or
        [B, q, q] per row) of the block; ``valid`` ([q] or [B, q]) marks the entries that stay visible afterwards (all
        by default; a prompt's padding not). Compiled blocks run padded to a power-of-two width (a pad token sees only
        itself and lies past the length); ``eager`` (a prompt) runs as it is."""
        q, start = block.size(1), self.length
        width = q if eager or not self.engine.compiled else width_bucket(q)
        if start + width > self.engine.cache_length:
            self._grow(start + width)
        pattern = torch.eye(width, dtype=torch.bool, device=block.device).repeat(block.size(0), 1, 1)
        pattern[:, :q, :q] = visible.to(block.device).reshape(-1, q, q)
        ids, position_ids = (F.pad(t, (0, width - q), value=0) for t in (block, position_ids))
        attend = self.attended(start + width)
        mask = self.allowed[:, None, None, :attend].repeat(1, 1, width, 1)
        mask[:, 0, :, start: start + width] = torch.where(pattern, 0.0, self.min)
        out = self.engine(ids, mask, position_ids, hidden, rows, eager)
        if not eager:
            self.engine.widths.add((width, hidden))
        self.set_length(start + q)
        self.allowed[:, start: start + q] = 0.0 if valid is None else torch.where(valid, 0.0, self.min)
        return out

    def attended(self, end: int) -> int:
        """The cache positions a block ending at ``end`` attends to (its mask's width: ``sdpa_gqa`` reads no further):
        for a batch, the filled ones rounded up to ``CACHE_STEP``, since its keys and values outweigh the weights (16
        rows of SmolLM2 at 768 positions read 566 MB a step, the weights 540); one row attends to the whole cache, a
        few % of a step, with one compiled shape a width."""
        if self.allowed.size(0) == 1:
            return self.engine.cache_length
        return min(self.engine.cache_length, -(-end // CACHE_STEP) * CACHE_STEP)

    def _grow(self, positions: int) -> None:
        """A longer static cache, where a block would pass the end of this one (a decoder's blocks wider than the
        margin ``FastForward.positions`` leaves): the valid entries are copied over, and the widths compile anew for
        its length (their seconds kept apart as every compile's)."""
        old = self.cache
        self.engine.reserve(positions, self.allowed.size(0))
        self.cache = self.engine.cache
        kv.copy_prefix(old, self.cache, self.length)
        kv.set_length(self.cache, self.length)
        allowed = torch.full((self.allowed.size(0), self.engine.cache_length), self.min, dtype=self.allowed.dtype,
                             device=self.allowed.device)
        allowed[:, : self.allowed.size(1)] = self.allowed
        self.allowed = allowed

    def set_length(self, length: int) -> None:
        self.allowed[:, length: self.length] = self.min
        self.length = length
        kv.set_length(self.cache, length)

    def keep_prefix(self, q: int, kept: list[int]) -> None:
        """After a block of ``q`` entries, row r keeps its first ``kept[r]``: the length moves past the most any row
        kept, and each row masks what it kept fewer of."""
        start, most = self.length - q, max(kept)
        for r, k in enumerate(kept):
            if k < most:      # one row (every single-row decode) masks nothing: no op on its path
                self.allowed[r, start + k: start + most] = self.min
        self.set_length(start + most)

    def keep_path(self, q: int, keep: list[int]) -> None:
        """After a tree block of ``q`` entries, keep only its offsets ``keep``, moved down after the cached ones."""
        start = self.length - q
        kv.keep_positions(self.cache, start, keep)
        self.set_length(start + len(keep))


class FastForward:
    """One model's fast forwards: its static cache (kept across decodes, grown when a decode needs more) and, when
    compiled, its compiled forward with the seconds each width took to compile (``compile_seconds``)."""

    _engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, model, kind: str) -> "FastForward":
        """The model's engine of ``kind`` (static, compiled, frozen): one per model and kind, so compiled widths and
        the cache are reused."""
        engines = cls._engines.setdefault(model, {})
        if kind not in engines:
            engines[kind] = cls(model, kind)
        return engines[kind]

    def __init__(self, model, kind: str):
        attention = model.config._attn_implementation
        if attention not in ("sdpa", GQA_SDPA):
            raise ConfigError(f"the fast decoding path runs sdpa attention; this model uses {attention!r}: load it "
                              "with model.attn_implementation=sdpa or decode with engine=eager")
        # the model weakly: the registry's key is weak, and a strong reference here would keep every model alive
        self._model, self.kind, self.compiled = weakref.ref(model), kind, kind != "static"
        self.frozen_weights = None      # engine=frozen: the weights' versions its graphs were compiled with
        self.cache: kv.StaticCache | None = None
        self.cache_length = self.cache_batch = 0
        # (width, hidden states read, cache length, batch, positions attended) -> seconds
        self.compile_seconds: dict[tuple[int, bool, int, int, int], float] = {}
        self.widths: set[tuple[int, bool]] = set()     # (block width, hidden states read) of the decode forwards run
        self.head = PackedHead.of(model)
        self.stack = model.get_decoder() if self.head else None      # what runs compiled: the stack, or all of it
        self.cache_keyword = next(iter(kv.cache_argument(self.body, None)))   # looked up once, outside compiled code
        self._run = self._forward
        self.frozen = None if kind != "frozen" else \
            FrozenForwards(CPU_OPTIONS if next(model.parameters()).is_cpu else GPU_OPTIONS)
        if self.compiled and not self.frozen:
            # every engine compiles the one code object FastForward._forward: an engine's widths count against its
            # own budget, not those of the engines (live or dead) compiled before it in the process
            self._run = compile_shapes(self._forward, kind, RECOMPILE_LIMIT)

    @property
    def model(self):
        return self._model()

    @property
    def body(self):
        return self.model if self.stack is None else self.stack

    @property
    def compile_time(self) -> float:
        return sum(self.compile_seconds.values())

    @staticmethod
    def positions(prompt_length: int, max_new_tokens: int) -> int:
        """The cache positions a decode may use: its tokens plus the widest block a decoder feeds (checked at each
        forward)."""
        return prompt_length + max_new_tokens + CACHE_STEP

    def reserve(self, length: int, batch: int = 1) -> None:
        """A static cache of at least ``length`` positions for ``batch`` rows. A longer one (or one of another batch)
        is allocated, and every width compiled anew for its shapes, only when a decode needs it: the bench reserves
        its longest prompt's before warm-up."""
        if self.cache_length < length or self.cache_batch != batch:
            self.cache_length = max(self.cache_length, -(-length // CACHE_STEP) * CACHE_STEP)
            self.cache, self.cache_batch = kv.static_cache(self.model, self.cache_length), batch

    def memory(self) -> dict[str, int]:
        """The bytes this engine holds beside the model's weights: the static cache's keys and values (allocated at
        its first forward) and the packed head's copy of the head."""
        layers = self.cache.layers if self.cache is not None else []
        tensors = [t for layer in layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                   if isinstance(t, torch.Tensor)]
        packed = self.head.packed if self.head is not None and self.head.packed is not None else None
        return {"static_cache": sum(t.numel() * t.element_size() for t in tensors),
                "packed_head": 0 if packed is None else packed.numel() * packed.element_size()}

    def new_cache(self, length: int, batch: int = 1) -> kv.StaticCache:
        """The static cache, emptied, holding at least ``length`` positions of ``batch`` rows."""
        self.reserve(length, batch)
        kv.set_length(self.cache, 0)
        return self.cache

    def __call__(self, ids, mask, position_ids, hidden: bool, rows: slice, eager: bool = False):
        """Run the model on ``ids`` [B, q] against the static cache (inside ``attention()``); ``eager`` for the
        prefill. The logits of the block's ``rows`` are returned (more where the model's own head runs)."""
        out = self._body(ids, mask, position_ids, hidden, eager)
        if self.head is None:
            return out
        return CausalLMOutputWithPast(logits=self.head(out.last_hidden_state[:, rows]), hidden_states=out.hidden_states)

    def _body(self, ids, mask, position_ids, hidden: bool, eager: bool):
        if eager or not self.compiled:
            return self._forward(ids, mask, position_ids, hidden)
        # every shape compiles anew: the width, a longer cache, another batch, a batch's attended positions
        key = (ids.size(1), hidden, self.cache_length, ids.size(0), mask.size(-1))
        if key in self.compile_seconds:
            return self._compiled(key, ids, mask, position_ids, hidden)
        start = time.perf_counter()
        out = self._compiled(key, ids, mask, position_ids, hidden)
        self.compile_seconds[key] = time.perf_counter() - start
        return out

    def _compiled(self, key, ids, mask, position_ids, hidden: bool):
        if self.frozen:
            main, *states = self.frozen(self, key, ids, mask, position_ids)
            states = states[0] if states else None
            if self.stack is None:
                return CausalLMOutputWithPast(logits=main, hidden_states=states)
            return BaseModelOutputWithPast(last_hidden_state=main, hidden_states=states)
        if self.kind == "graphs":
            # each replay a new step: CUDA graphs may then overwrite every earlier replay's outputs (no decoder keeps
            # one past the next forward, of the target or a draft: tests/test_decoding_fast.py)
            torch.compiler.cudagraph_mark_step_begin()
        return self._run(ids, mask, position_ids, hidden)

    def _forward(self, ids, mask, position_ids, hidden: bool):
        return self.body(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                         output_hidden_states=hidden, **{self.cache_keyword: self.cache})

    def check_frozen_weights(self) -> None:
        if self.kind == "frozen":
            self.frozen_weights = unchanged_weights(self.model, self.frozen_weights, "this model's")

    @contextmanager
    def attention(self):
        """A decode's span: the model attends with ``sdpa_gqa``, then gets its own attention back (a model shared
        with training, as the speedup callback's is, keeps transformers' sdpa outside the fast path)."""
        self.check_frozen_weights()
        before = self.model.config._attn_implementation
        self.model.set_attn_implementation(GQA_SDPA)
        try:
            yield
        finally:
            self.model.set_attn_implementation(before)
