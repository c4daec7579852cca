"""Chimera's lightweight draft model (Zeng et al. 2024, §4.1). The paper leaves open which states eq. 3-4 may read at decoding time; the
reading implemented here is leak-free and the same in training and decoding:
- n-gram encoder (eq. 2): ``h_tri_i = W2 SiLU(W1 [x_{i-g+1}; ...; x_i])`` over the base's embeddings (g = 3: the
  trigram encoder); the first tokens of a sequence get zeros for the embeddings they lack (the paper's collapsed
  unigram and bigram).
- full-context encoder (eq. 3): one transformer block whose queries are n-gram states and whose keys/values are
  ``[H_LLM ; H_tri]``. For head k the query is the n-gram of token j = n+1+k, and it may see the base's states of
  tokens <= n and the n-grams of tokens <= j: when drafting, the base has run on the prefix only, token n+1 is the
  base's own next token and tokens n+2..j are the previous heads' top-1 guesses (the true tokens in training). The
  n-gram part is Fig. 3's rule (an n-gram that contains a future token is masked); the base part is cut at n, the
  head's offset. The block has no position encoding: the base states carry positions, the mask gives the order.
- residual decoding heads (eq. 4): ``p_k = softmax(MLP_k [h_LLM_n ; h_full_{n+1+k}])``; ``residual=False`` gives
  the heads ``h_full`` only (Fig. 8's ablation). MLP_k: Linear(2d -> d) (initialised to pass ``h_LLM_n`` through),
  Medusa's ResBlock, and a vocabulary projection initialised from the base's LM head.
- an LRU n-gram cache for decoding (§4.1.1): n-gram states by token ids; a hit skips the encoder.

Draft heads (Chimera, Medusa), models part: the shared head parts are in ``models/draft_heads.py``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from lit_spec.errors import ConfigError, check_count
from lit_spec.models.draft_heads import DecodingHead, DraftHeads


class FullContextBlock(nn.Module):
    """One pre-norm transformer block (RMSNorm, multi-head attention, SiLU MLP) whose queries and keys come apart:
    keys/values of every context state are computed once (``keys_values``) and queried by any subset of states.
    Query, key and value projections are one matrix (``qkv``): a drafted n-gram state, which is both a query and a
    new key, needs one matrix product."""

    def __init__(self, hidden_size: int, attention_heads: int, ffn_size: int, eps: float = 1e-6):
        super().__init__()
        if hidden_size % attention_heads:
            raise ConfigError(f"attention_heads={attention_heads} must divide the hidden size {hidden_size}")
        self.heads, self.hidden_size = attention_heads, hidden_size
        self.kv_heads, self.head_dim = attention_heads, hidden_size // attention_heads    # a static layer's shape
        self.norm_in, self.norm_mid = nn.RMSNorm(hidden_size, eps=eps), nn.RMSNorm(hidden_size, eps=eps)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o = nn.Linear(hidden_size, hidden_size, bias=False)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, ffn_size), nn.SiLU(), nn.Linear(ffn_size, hidden_size))

    def _split(self, x: torch.Tensor) -> torch.Tensor:        # [B, L, d] -> [B, heads, L, d / heads]
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def _project(self, states: torch.Tensor, rows: slice) -> list[torch.Tensor]:
        """Rows ``rows`` of [q; k; v] (a slice of the fused weight) of ``states``, each [B, heads, L, dh]."""
        if torch.compiler.is_compiling():
            # inductor's frozen C++ GEMM template (torch 2.13) reads a weight slice from its storage's start, so a
            # compiled step projects with the whole weight (tests/test_decoding_fast.py)
            x = F.linear(self.norm_in(states), self.qkv.weight)[..., rows]
        else:
            x = F.linear(self.norm_in(states), self.qkv.weight[rows])
        return [self._split(part) for part in x.split(self.hidden_size, dim=-1)]

    def keys_values(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._project(states, slice(self.hidden_size, None))
        return k, v

    def queries_keys_values(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self._project(states, slice(None))
        return q, k, v

    def forward(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                allowed: torch.Tensor | None = None, q: torch.Tensor | None = None) -> torch.Tensor:
        """``queries`` [B, Q, d] attend to ``keys``/``values`` [B, heads, L, dh] where ``allowed`` [B, Q, L]
        (None: everywhere); ``q``: their projected queries when already computed (``queries_keys_values``)."""
        if q is None:
            (q,) = self._project(queries, slice(0, self.hidden_size))
        mask = None if allowed is None else allowed[:, None]
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        h = queries + self.o(attended.transpose(1, 2).flatten(-2))
        return h + self.mlp(self.norm_mid(h))


def full_context_mask(valid: torch.Tensor, offset: int) -> torch.Tensor:
    """Training mask of the full-context encoder for head ``offset`` (k) over keys ``[H_LLM ; H_tri]`` ([B, T]
    each, ``valid`` marks real tokens): row n is the query of token n+1+k's n-gram, which sees the base's states
    of tokens <= n and the n-grams of tokens <= n+1+k (an n-gram with a token after that is masked: Fig. 3).
    Returns [B, T-k-2, 2T] booleans (True = may attend), one row per prefix end n whose label n+2+k exists."""
    t = valid.size(1)
    n = torch.arange(max(t - offset - 2, 0), device=valid.device)[:, None]
    i = torch.arange(t, device=valid.device)[None]
    allowed = torch.cat([i <= n, i <= n + 1 + offset], dim=-1)
    return allowed[None] & valid.repeat(1, 2)[:, None, :]


def ngram_inputs(embeds: torch.Tensor, ngram: int) -> torch.Tensor:
    """[B, T, d] embeddings -> [B, T, g*d]: position i holds [x_{i-g+1}; ...; x_i], zeros before the first token."""
    shifted = [F.pad(embeds, (0, 0, s, 0))[:, : embeds.size(1)] for s in range(ngram - 1, -1, -1)]
    return torch.cat(shifted, dim=-1)


class ChimeraDraft(DraftHeads):
    """Chimera's lightweight draft model (module docstring): n-gram encoder, full-context block, residual heads."""

    kind = "chimera"
    forward_methods = ("head_inputs",)   # called in place of forward in training: FSDP2 gathers the weights for it

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, ngram: int = 3, residual: bool = True,
                 attention_heads: int = 4, ffn_size: int | None = None, eps: float = 1e-6,
                 shared_lm_head: bool = False):
        super().__init__(hidden_size, vocab_size, num_heads, shared_lm_head)
        self.ngram, self.residual, self.attention_heads = check_count("ngram", ngram), bool(residual), attention_heads
        self.ffn_size, self.eps = ffn_size or 4 * hidden_size, eps
        d = hidden_size
        self.ngram_encoder = nn.Sequential(nn.Linear(self.ngram * d, d), nn.SiLU(), nn.Linear(d, d))   # eq. 2
        self.block = FullContextBlock(d, attention_heads, self.ffn_size, eps)                     # eq. 3
        self.heads = nn.ModuleList(DecodingHead(2 * d if self.residual else d, d, vocab_size, shared_lm_head)
                                   for _ in range(num_heads))                                     # eq. 4

    @property
    def config(self) -> dict:
        return super().config | {"ngram": self.ngram, "residual": self.residual,
                                 "attention_heads": self.attention_heads, "ffn_size": self.ffn_size, "eps": self.eps}

    def encode_ngrams(self, embed: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Eq. 2 of n-grams by token ids ([..., g]; -1: before the first token, a zero embedding) -> [..., d]."""
        x = embed(ids.clamp(min=0)) * (ids >= 0)[..., None]
        return self.ngram_encoder(x.flatten(-2))

    def head_input(self, llm_state: torch.Tensor, full_state: torch.Tensor) -> torch.Tensor:
        """Eq. 4's input: ``[h_LLM_n ; h_full_{n+1+k}]`` (``h_full`` alone without ``residual``)."""
        return torch.cat([llm_state, full_state], dim=-1) if self.residual else full_state

    def head_inputs(self, embeds: torch.Tensor, hidden: torch.Tensor, valid: torch.Tensor):
        """Teacher-forced over whole sequences: per head k, its inputs [B, T-k-2, in] at every prefix end n
        (``heads[k]`` of them predicts token n+2+k) and the full-context states ``h_full_{n+1+k}`` [B, T-k-2, d]
        (distilled towards ``h_LLM_{n+1+k}``, eq. 6)."""
        tri = self.ngram_encoder(ngram_inputs(embeds, self.ngram))
        keys, values = (torch.cat(kv, dim=2) for kv in zip(self.block.keys_values(hidden),
                                                             self.block.keys_values(tri)))
        inputs, full = [], []
        for k in range(self.num_heads):
            m = max(hidden.size(1) - k - 2, 0)
            state = self.block(tri[:, k + 1: k + 1 + m], keys, values, full_context_mask(valid, k))
            inputs.append(self.head_input(hidden[:, :m], state))
            full.append(state)
        return inputs, full


class NGramCache:
    """Fixed-size LRU cache of n-gram encoder outputs by token ids (Chimera §4.1.1); ``size=0`` disables it.

    Entries belong to the weights they were computed with: any change of the encoder's or the embeddings' weights
    (an optimizer step, ``load_state_dict``: in-place updates, which bump the tensors' version counters) empties the
    cache, so a decoder kept across training steps (the speedup callback's) never drafts from stale states."""

    def __init__(self, size: int):
        self.size, self.entries = size, OrderedDict()
        self.hits = self.misses = 0
        self.weights: tuple | None = None     # (id, version) of every weight the cached states were computed with

    def states(self, draft: ChimeraDraft, embed: nn.Module, ngrams: list[tuple[int, ...]]) -> torch.Tensor:
        """[len(ngrams), d] encoder outputs of ``ngrams`` (token ids; -1 = before the first token)."""
        weights = tuple((id(w), w._version) for w in (embed.weight, *draft.ngram_encoder.parameters()))
        if weights != self.weights:
            self.entries.clear()
            self.weights = weights
        missing = list(ngrams) if not self.size else [g for g in dict.fromkeys(ngrams) if g not in self.entries]
        self.misses += len(missing)
        computed = torch.empty(0)
        if missing:
            computed = draft.encode_ngrams(embed, torch.tensor(missing, device=embed.weight.device))
        if not self.size:
            return computed
        self.hits += len(ngrams) - len(missing)
        self.entries.update(zip(missing, computed))
        rows = []
        for g in ngrams:
            self.entries.move_to_end(g)
            rows.append(self.entries[g])
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return torch.stack(rows)
