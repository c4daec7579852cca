"""Draft heads (Chimera, Medusa), decoding part (the models/ and methods/ files of this name build and train them):
``medusa`` and ``chimera``, tree-verified decoding whose candidates come from draft heads on the target. Greedy
verification (``tree``) makes both lossless whatever the heads predict.

Each step the heads read the target's last-layer hidden states of the verified prefix (``DecodeState.hidden``, no
extra target forward) and give the top-k tokens of the next ``depth`` positions after the pending token; the static
tree (``TreeSpec``) is built from them and verified in one target forward.

- Medusa: head k's top-k from ``h_LLM_n``, all heads in one call.
- Chimera: the full-context block attends to the keys/values of every base state and n-gram state so far (kept
  across steps, computed once per token) and runs once per depth: the query of depth 1 is the n-gram of the pending
  token, the query of depth d+1 the n-gram that ends with depth d's top-1 token (the training mask's view,
  ``models.chimera.full_context_mask``). The committed tokens' n-gram states come through the LRU ``NGramCache``
  (``ngram_cache`` entries; 0 disables it); a drafted n-gram is encoded within the step, so the depths run without
  reading a token back to the host.
- ``draft_vocab``: the heads score only the tokens they were most often trained to predict (FR-Spec,
  ``models.draft_heads.DraftVocab``); heads sharing one projection are scored in one matrix product.

Each draft's step (``medusa_forward``, ``chimera_forward``) runs as a ``DraftStep`` on the target's engine kind: on
the fast path compiled per width, ``frozen`` with the heads' weights compiled in.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from lit_spec.decoding.base import register
from lit_spec.decoding.cache import GrowingLayer, StaticLayer
from lit_spec.decoding.draft_step import DraftStep, SteppedDraft
from lit_spec.decoding.fast import width_bucket
from lit_spec.decoding.state import DecodeState
from lit_spec.decoding.stats import sync_device
from lit_spec.decoding.tree import TreeDecoder, TreeSpec
from lit_spec.errors import ConfigError, check_count
from lit_spec.models.chimera import ChimeraDraft, NGramCache
from lit_spec.models.draft_heads import DraftHeads, DraftVocab, MedusaHeads
from lit_spec.models.saved_heads import load_heads


def _count_draft(state: DecodeState, start: float, calls: int) -> None:
    """Add a candidate source's time since ``start`` and its module calls to the decode's draft counters."""
    sync_device(state.pending.device)
    state.stats.draft_time += time.perf_counter() - start
    state.stats.draft_forwards += calls


def drafted_shape(tree: TreeSpec | None, depth: int, k: int) -> tuple[int, int]:
    """The depth and top-k a heads' step drafts: the whole tree's, or (no tree) what the call asks for."""
    return (depth, k) if tree is None else (tree.depth, tree.top_k)


def medusa_forward(heads: MedusaHeads, vocab: DraftVocab, last: torch.Tensor, depth: int, k: int) -> torch.Tensor:
    """The top-``k`` target ids [depth, k] of heads 0..depth-1 from ``h_LLM_n`` (``last`` [d]), all in one call:
    what ``DraftStep`` compiles on the fast path."""
    return vocab.topk(heads.features(last)[:depth], 0, k)


class MedusaCandidates:
    """``tree``: the decoder's whole tree, drafted at every step (and cut to the tree of the last steps), so that a
    compiled step has one shape; None: what each call asks for."""

    def __init__(self, heads: MedusaHeads, vocab: DraftVocab, step: DraftStep | None = None,
                 tree: TreeSpec | None = None):
        self.vocab, self.tree = vocab, tree
        self.step = step or DraftStep.of(medusa_forward, heads, "eager", heads.kind)

    @torch.no_grad()
    def __call__(self, state: DecodeState, depth: int, k: int) -> torch.Tensor:
        start = time.perf_counter()
        depth_all, k_all = drafted_shape(self.tree, depth, k)
        top = self.step(f"{depth_all}/top{k_all}/v{self.vocab.size}", self.vocab, state.hidden[0, -1], depth_all,
                        k_all)
        _count_draft(state, start, 1)
        return top[:depth, :k]


def chimera_forward(draft: ChimeraDraft, vocab: DraftVocab, embed: torch.nn.Module, kv, rows: torch.Tensor,
                    query: torch.Tensor, llm: torch.Tensor, tail: torch.Tensor, allowed: torch.Tensor | None,
                    depth: int, k: int) -> torch.Tensor:
    """Append the full-context block's keys/values of ``rows`` [R, d] (this step's base states and n-gram states;
    pad rows seen by no query) to ``kv``, then draft ``depth`` positions: depth 1 queries with ``query`` [d] (the
    pending token's n-gram state), depth d + 1 with the n-gram of ``tail`` [g - 1] (the last tokens) and depth d's top-1,
    its keys/values appended too; query d sees the keys where ``allowed`` [depth, keys] (None: all). Each head reads
    eq. 4's ``[h_LLM_n ; h_full]`` (``llm`` [d]: h_LLM_n). The top-``k`` target ids [depth, k]: what ``DraftStep``
    compiles on the fast path, the depths unrolled, so no host sync between them."""
    block = draft.block
    kv.update(*block.keys_values(rows[None]))
    query, q, top = query[None, None], None, []
    for d in range(depth):
        mask = None if allowed is None else allowed[d][None, None]
        full = block(query, kv.keys, kv.values, mask, q=q)[0, 0]
        top.append(vocab.topk(draft.heads[d].features(draft.head_input(llm, full))[None], d, k)[0])
        if d + 1 < depth:                          # the next query: the n-gram ending with this depth's top-1
            gram = torch.cat([tail, top[-1][:1]])
            query, tail = draft.encode_ngrams(embed, gram)[None, None], gram[1:]
            q, key, value = block.queries_keys_values(query)
            kv.update(key, value)
    return torch.stack(top)


class ChimeraCandidates:
    """One decode's drafting state: the full-context block's keys/values (``kv``: no positions, so in any order) of
    the base states (every token but the pending one) and of the n-gram states (every token), each computed once,
    ``rows`` of them. Eager, ``kv`` grows as the decode does; on the fast path it is a static layer kept by the
    decoder, each step's rows padded to a power-of-two width (a pad row is seen by no query and rolled back)."""

    def __init__(self, draft: ChimeraDraft, vocab: DraftVocab, embed: torch.nn.Module, cache: NGramCache,
                 prompt: list[int], step: DraftStep | None = None, kv=None, tree: TreeSpec | None = None):
        self.draft, self.vocab, self.embed, self.cache, self.prompt = draft, vocab, embed, cache, prompt
        self.tree = tree                              # as Medusa's
        self.step = step or DraftStep.of(chimera_forward, draft, "eager", draft.kind)
        self.kv = GrowingLayer() if kv is None else kv
        self.static = isinstance(self.kv, StaticLayer)
        self.rows = 0                                 # valid rows in ``kv``
        self.base_states = 0                          # tokens whose base state is in ``kv``
        self.encoded = 0                              # tokens whose n-gram state is in ``kv``

    def _ngram_states(self, tokens: list[int], ends: range) -> torch.Tensor:
        g = self.draft.ngram
        grams = [tuple(tokens[i] if i >= 0 else -1 for i in range(end - g + 1, end + 1)) for end in ends]
        return self.cache.states(self.draft, self.embed, grams)

    @torch.no_grad()
    def __call__(self, state: DecodeState, depth: int, k: int) -> torch.Tensor:
        return self._draft(state, *drafted_shape(self.tree, depth, k))[:depth, :k]

    def _draft(self, state: DecodeState, depth: int, k: int) -> torch.Tensor:
        start = time.perf_counter()
        tokens = self.prompt + state.out[0]                              # tokens[-1]: the pending token
        base = state.hidden[0]                                           # h_LLM of the positions last cached
        self.base_states += base.size(0)
        if self.base_states != len(tokens) - 1:
            raise RuntimeError(f"chimera: {self.base_states} base states for {len(tokens) - 1} cached tokens")
        grams = self._ngram_states(tokens, range(self.encoded, len(tokens)))
        self.encoded = len(tokens)
        rows = torch.cat([base, grams])
        g, device = self.draft.ngram, base.device
        tail = torch.tensor([tokens[i] if i >= 0 else -1 for i in range(len(tokens) - g + 1, len(tokens))],
                            dtype=torch.long, device=device)
        real, width = rows.size(0), self.step.width(rows.size(0))
        allowed, keys = None, 0
        if self.static:      # every key the layer holds: the valid rows, and each depth's drafted n-grams before it
            keys = self.kv.max_cache_len
            if self.rows + width + depth - 1 > keys:
                raise RuntimeError(f"chimera: {self.rows + width + depth - 1} draft rows in a cache of {keys}")
            allowed = torch.zeros(depth, keys, dtype=torch.bool, device=device)
            allowed[:, : self.rows + real] = True
            drafted = self.rows + width
            allowed[:, drafted: drafted + depth - 1] = torch.ones(depth, depth - 1, dtype=torch.bool,
                                                                  device=device).tril(-1)
            rows = F.pad(rows, (0, 0, 0, width - real))
        label = f"{width}/depth{depth}/top{k}/v{self.vocab.size}@{keys}"
        top = self.step(label, self.vocab, self.embed, self.kv, rows, grams[-1], base[-1], tail, allowed, depth, k)
        self.kv.crop(-(width - real + depth - 1))   # the pads and the drafted n-grams' keys/values
        self.rows += real
        _count_draft(state, start, depth)
        return top


def check_depth(heads: DraftHeads, decoder: TreeDecoder) -> None:
    if decoder.spec.depth > heads.num_heads:
        raise ConfigError(f"{decoder.name}: the tree is {decoder.spec.depth} deep but the heads predict "
                          f"{heads.num_heads} positions: use a tree of depth <= {heads.num_heads}")


def check_draft_vocab(draft_vocab: int | None, decoder: TreeDecoder) -> int | None:
    """FR-Spec's subset size (``DraftVocab``): None (the whole vocabulary) or at least the tree's top-k."""
    if draft_vocab is not None:
        check_count("draft_vocab", draft_vocab, minimum=decoder.spec.top_k)
    return draft_vocab


def load_draft(heads, kind: type, model) -> DraftHeads:
    """``heads`` (a module or a ``save_heads`` directory) checked against the kind and the base it drafts for."""
    if isinstance(heads, (str, bytes)) or hasattr(heads, "__fspath__"):
        heads = load_heads(heads)[0].to(model.device)
    if not isinstance(heads, kind):
        raise ConfigError(f"heads: expected {kind.kind} heads, got {type(heads).__name__}")
    size, vocab = model.config.hidden_size, model.get_output_embeddings().weight.size(0)
    if (heads.hidden_size, heads.vocab_size) != (size, vocab):
        raise ConfigError(f"heads: trained for hidden size {heads.hidden_size} and vocabulary {heads.vocab_size}, "
                          f"but the model has {size} and {vocab}: load them onto the base they were trained on")
    return heads.attach(model)


@register("medusa")
class MedusaDecoder(SteppedDraft, TreeDecoder):
    """Tree decoding with Medusa-1 heads (``heads``: a ``MedusaHeads`` or a directory from ``save_heads``);
    ``draft_vocab``: score only the heads' most frequent training labels (FR-Spec, ``DraftVocab``; None: all)."""

    record_hidden, needs_draft = True, False
    draft_forward = staticmethod(medusa_forward)

    def __init__(self, model, heads, tree=(3, 2, 1, 1), draft_vocab: int | None = None, **kwargs):
        self.draft = load_draft(heads, MedusaHeads, model)
        super().__init__(model, tree=tree, **kwargs)
        check_depth(self.draft, self)
        self.draft_vocab = check_draft_vocab(draft_vocab, self)

    def new_candidates(self, state: DecodeState) -> MedusaCandidates:
        return MedusaCandidates(self.draft, DraftVocab(self.draft, self.draft_vocab), self.step, self.spec)


@register("chimera")
class ChimeraDecoder(SteppedDraft, TreeDecoder):
    """Tree decoding with Chimera's draft (``heads``: a ``ChimeraDraft`` or a directory from ``save_heads``);
    ``ngram_cache``: entries of the LRU n-gram cache (0: off); ``draft_vocab``: as Medusa's."""

    record_hidden, needs_draft = True, False
    draft_forward = staticmethod(chimera_forward)

    def __init__(self, model, heads, tree=(3, 2, 1, 1), ngram_cache: int = 4096, draft_vocab: int | None = None,
                 **kwargs):
        self.draft = load_draft(heads, ChimeraDraft, model)
        ngram_cache = check_count("ngram_cache", ngram_cache, minimum=0)   # 0 disables the cache
        super().__init__(model, tree=tree, **kwargs)
        check_depth(self.draft, self)
        self.draft_vocab = check_draft_vocab(draft_vocab, self)
        self.cache = NGramCache(ngram_cache)      # kept across decodes: n-gram states do not depend on context

    def new_candidates(self, state: DecodeState) -> ChimeraCandidates:
        """Fast: the decoder's static layer, two rows a token (its base state and its n-gram state), a step's rows
        padded past them, and the drafted n-grams after."""
        prompt = state.prompt[0][state.prompt_mask[0].bool()].tolist()
        depth = self.spec.depth
        kv = None if self.fast is None else self.static_layers(
            [self.draft.block], state, 2 * width_bucket(2 * (depth + 1)) + depth, rows_per_token=2)[0]
        return ChimeraCandidates(self.draft, DraftVocab(self.draft, self.draft_vocab),
                                 self.model.get_input_embeddings(), self.cache, prompt, self.step, kv, self.spec)
