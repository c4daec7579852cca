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
  ``models.chimera.full_context_mask``). n-gram states come through the LRU ``NGramCache`` (``ngram_cache`` entries;
  0 disables it).
- ``draft_vocab``: the heads score only the tokens they were most often trained to predict (FR-Spec,
  ``models.draft_heads.DraftVocab``); heads sharing one projection are scored in one matrix product.
"""

from __future__ import annotations

import time

import torch

from lit_spec.decoding.base import register
from lit_spec.decoding.cache import GrowingLayer
from lit_spec.decoding.state import DecodeState
from lit_spec.decoding.stats import sync_device
from lit_spec.decoding.tree import TreeDecoder
from lit_spec.errors import ConfigError, check_count
from lit_spec.models.chimera import ChimeraDraft, NGramCache
from lit_spec.models.draft_heads import DraftHeads, DraftVocab, MedusaHeads
from lit_spec.models.saved_heads import load_heads


def _count_draft(state: DecodeState, start: float, calls: int) -> None:
    """Add a candidate source's time since ``start`` and its module calls to the decode's draft counters."""
    sync_device(state.pending.device)
    state.stats.draft_time += time.perf_counter() - start
    state.stats.draft_forwards += calls


class MedusaCandidates:
    def __init__(self, heads: MedusaHeads, vocab: DraftVocab):
        self.heads, self.vocab = heads, vocab

    @torch.no_grad()
    def __call__(self, state: DecodeState, depth: int, k: int) -> torch.Tensor:
        start = time.perf_counter()
        features = self.heads.features(state.hidden[0, -1])[:depth]   # of h_LLM_n: the last position cached
        top = self.vocab.topk(features, 0, k)
        _count_draft(state, start, 1)
        return top


class ChimeraCandidates:
    """One decode's drafting state: the full-context block's keys/values of the base states (every token but the
    pending one) and of the n-gram states (every token), each computed once."""

    def __init__(self, draft: ChimeraDraft, vocab: DraftVocab, embed: torch.nn.Module, cache: NGramCache,
                 prompt: list[int]):
        self.draft, self.vocab, self.embed, self.cache, self.prompt = draft, vocab, embed, cache, prompt
        self.kv = GrowingLayer()        # the block's keys/values (any order: no positions, no mask when decoding)
        self.base_states = 0                          # tokens whose base state is in ``kv``
        self.encoded = 0                              # tokens whose n-gram state is in ``kv``

    def _ngram_states(self, tokens: list[int], ends: range) -> torch.Tensor:
        g = self.draft.ngram
        grams = [tuple(tokens[i] if i >= 0 else -1 for i in range(end - g + 1, end + 1)) for end in ends]
        return self.cache.states(self.draft, self.embed, grams)

    @torch.no_grad()
    def __call__(self, state: DecodeState, depth: int, k: int) -> torch.Tensor:
        start = time.perf_counter()
        draft, block, kv = self.draft, self.draft.block, self.kv
        tokens = self.prompt + state.out[0]                              # tokens[-1]: the pending token
        kv.update(*block.keys_values(state.hidden[:1]))
        self.base_states += state.hidden.size(1)
        if self.base_states != len(tokens) - 1:
            raise RuntimeError(f"chimera: {self.base_states} base states for {len(tokens) - 1} cached tokens")
        tri = self._ngram_states(tokens, range(self.encoded, len(tokens)))
        q, new_k, new_v = block.queries_keys_values(tri[None])
        kv.update(new_k, new_v)
        self.encoded = len(tokens)
        query, q, llm_last = tri[-1:][None], q[:, :, -1:], state.hidden[0, -1]   # n-gram of x_{n+1}; h_LLM_n
        top = []
        for d in range(depth):
            full = block(query, kv.keys, kv.values, q=q)[0, 0]
            top.append(self.vocab.topk(draft.heads[d].features(draft.head_input(llm_last, full))[None], d, k)[0])
            if d + 1 < depth:                          # the next query: the n-gram ending with this depth's top-1
                tokens = tokens + [int(top[-1][0])]
                query = self._ngram_states(tokens, range(len(tokens) - 1, len(tokens)))[None]
                q, new_k, new_v = block.queries_keys_values(query)
                kv.update(new_k, new_v)
        kv.crop(1 - depth)                             # drop the drafted n-grams' keys/values (depth - 1 of them)
        _count_draft(state, start, depth)
        return torch.stack(top)


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
class MedusaDecoder(TreeDecoder):
    """Tree decoding with Medusa-1 heads (``heads``: a ``MedusaHeads`` or a directory from ``save_heads``);
    ``draft_vocab``: score only the heads' most frequent training labels (FR-Spec, ``DraftVocab``; None: all)."""

    record_hidden, needs_draft = True, False

    def __init__(self, model, heads, tree=(3, 2, 1, 1), draft_vocab: int | None = None, **kwargs):
        self.heads = load_draft(heads, MedusaHeads, model)
        super().__init__(model, tree=tree, **kwargs)
        check_depth(self.heads, self)
        self.draft_vocab = check_draft_vocab(draft_vocab, self)

    def new_candidates(self, state: DecodeState) -> MedusaCandidates:
        return MedusaCandidates(self.heads, DraftVocab(self.heads, self.draft_vocab))


@register("chimera")
class ChimeraDecoder(TreeDecoder):
    """Tree decoding with Chimera's draft (``heads``: a ``ChimeraDraft`` or a directory from ``save_heads``);
    ``ngram_cache``: entries of the LRU n-gram cache (0: off); ``draft_vocab``: as Medusa's."""

    record_hidden, needs_draft = True, False

    def __init__(self, model, heads, tree=(3, 2, 1, 1), ngram_cache: int = 4096, draft_vocab: int | None = None,
                 **kwargs):
        self.heads = load_draft(heads, ChimeraDraft, model)
        ngram_cache = check_count("ngram_cache", ngram_cache, minimum=0)   # 0 disables the cache
        super().__init__(model, tree=tree, **kwargs)
        check_depth(self.heads, self)
        self.draft_vocab = check_draft_vocab(draft_vocab, self)
        self.cache = NGramCache(ngram_cache)      # kept across decodes: n-gram states do not depend on context

    def new_candidates(self, state: DecodeState) -> ChimeraCandidates:
        prompt = state.prompt[0][state.prompt_mask[0].bool()].tolist()
        return ChimeraCandidates(self.heads, DraftVocab(self.heads, self.draft_vocab),
                                 self.model.get_input_embeddings(), self.cache, prompt)
