"""DFlash (z-lab, arXiv 2602.06036), models part (the methods/ and decoding/ files of this name train it and decode
with it): a small draft that proposes a whole block of tokens in one forward, reading the frozen target's features.

- **Features**: the outputs of ``target_layer_ids`` target layers (z-lab's ids: layer i's output is transformers'
  ``hidden_states[i + 1]``; by default spaced evenly from layer 1 to n - 3, one per draft layer), concatenated,
  fused by ``fc`` (kH -> H) and normed by ``hidden_norm``: the context ``c``.
- **Draft layers** (Qwen3's: per-head ``q_norm`` / ``k_norm``, rotary, SwiGLU MLP), ``num_layers`` of them. Each
  layer's keys and values are [its own k/v projections of the context c; of the block], and only the block makes
  queries: the context enters every layer as keys and values (vLLM's ``precompute_and_store_context_kv``). The block
  attends to the whole context before it and to itself in both directions.
- **The block**: [the last verified token, then B - 1 mask tokens] at consecutive positions from the token's; slot k
  (1..B-1) predicts the token at its own position, through the draft's ``norm`` and the target's LM head.
- **Shared with the target, frozen, never saved**: the embedding and the LM head (``attach``). The mask token's
  embedding is the draft's own parameter (``mask_embedding``): SmolLM2 has no spare vocabulary slot for one; the
  export ships it as vLLM's ``mask_embedding.pt``.

Parameter names are vLLM's ``DFlashDraftModel`` layout (``fc``, ``hidden_norm``, ``layers.N.*``, ``norm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from lit_spec.errors import ConfigError, check_count
from lit_spec.models.draft_heads import DraftHeads, DraftRotary, layer_settings, swiglu, swiglu_mlp, target_widths


def target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's feature layers: ``num_draft_layers`` target layers spaced evenly from layer 1 to n - 3 (one draft
    layer: the middle one), as layer indices whose output is read; never the last layer (n - 1), whose output
    transformers returns normed, so a target of 2 or 3 layers gets its first or second."""
    last = num_target_layers - 2
    if num_draft_layers == 1:
        return [min(num_target_layers // 2, last)]
    start = min(1, last)
    end = max(num_target_layers - 3, start)
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


class DFlashLayer(nn.Module):
    """One Qwen3 decoder layer whose keys and values also come from the context (``context_kv``)."""

    forward_methods = ("context_kv",)     # called besides forward: FSDP2 gathers the weights for it

    def __init__(self, hidden_size: int, heads: int, kv_heads: int, head_dim: int, intermediate_size: int,
                 eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        self.self_attn = nn.ModuleDict({
            "q_proj": nn.Linear(hidden_size, heads * head_dim, bias=False),
            "k_proj": nn.Linear(hidden_size, kv_heads * head_dim, bias=False),
            "v_proj": nn.Linear(hidden_size, kv_heads * head_dim, bias=False),
            "o_proj": nn.Linear(heads * head_dim, hidden_size, bias=False),
            "q_norm": nn.RMSNorm(head_dim, eps=eps), "k_norm": nn.RMSNorm(head_dim, eps=eps)})
        self.post_attention_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        self.mlp = swiglu_mlp(hidden_size, intermediate_size)

    def _heads(self, x: torch.Tensor, name: str, n: int) -> torch.Tensor:
        return self.self_attn[name](x).unflatten(-1, (n, self.head_dim)).transpose(1, 2)     # [B, n, Q, hd]

    def _kv(self, x: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [B, kv_heads, Q, hd] of ``x`` [B, Q, H] (normed already)."""
        k = self.self_attn["k_norm"](self._heads(x, "k_proj", self.kv_heads))
        return apply_rotary_pos_emb(k, k, *rotary)[1], self._heads(x, "v_proj", self.kv_heads)

    def context_kv(self, c: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the context ``c`` (an entry point of its own: FSDP2 reshards after it, so
        ``forward`` calls ``_kv``)."""
        return self._kv(c, rotary)

    def forward(self, h: torch.Tensor, rotary, context: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None) -> torch.Tensor:
        """The block's states ``h`` [B, Q, H] after this layer, its queries seeing [context keys; block keys] where
        ``mask`` [B, 1, Q, T + Q] allows (None: all of them)."""
        x = self.input_layernorm(h)
        q = self.self_attn["q_norm"](self._heads(x, "q_proj", self.heads))
        k, v = self._kv(x, rotary)
        q = apply_rotary_pos_emb(q, q, *rotary)[0]
        keys, values = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        h = h + self.self_attn["o_proj"](attended.transpose(1, 2).flatten(-2))
        x = self.post_attention_layernorm(h)
        return h + swiglu(self.mlp, x)


class DFlashDraft(DraftHeads):
    """The DFlash draft (module docstring). ``context`` turns target features into every layer's context keys and
    values; ``forward`` runs blocks against them; ``logits`` scores the output states with the target's LM head."""

    kind = "dflash"
    counts_labels = False
    forward_methods = ("context", "logits")   # called besides forward in training: FSDP2 gathers the weights

    def __init__(self, hidden_size: int, vocab_size: int, target_layer_ids: list[int], num_layers: int,
                 block_size: int, num_attention_heads: int, num_key_value_heads: int | None = None,
                 head_dim: int | None = None, intermediate_size: int | None = None, rms_norm_eps: float = 1e-6,
                 rope_parameters: dict | None = None, max_position_embeddings: int = 2048, mask_token_id: int = 0):
        super().__init__(hidden_size, vocab_size, num_heads=1)
        self.num_layers = check_count("method.num_layers", num_layers)
        self.block_size = check_count("method.block_size", block_size, minimum=2)
        self.target_layer_ids = [int(i) for i in target_layer_ids]
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ConfigError(f"method.target_layer_ids={target_layer_ids}: give the target layers whose outputs the "
                              "draft reads (layer indices >= 0), or null for z-lab's")
        if not 0 <= mask_token_id < vocab_size:
            raise ConfigError(f"mask_token_id={mask_token_id}: a token id below the vocabulary size {vocab_size}")
        self.mask_token_id = int(mask_token_id)
        self.settings = layer_settings(hidden_size, num_attention_heads, num_key_value_heads, head_dim,
                                       intermediate_size, rms_norm_eps, rope_parameters, max_position_embeddings)
        s = self.settings
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden_size, hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(hidden_size, s["num_attention_heads"], s["num_key_value_heads"],
                                                s["head_dim"], s["intermediate_size"], rms_norm_eps)
                                    for _ in range(self.num_layers))
        self.norm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(hidden_size))
        self.rotary = DraftRotary(hidden_size, s)
        self._target: tuple[nn.Module, ...] = ()     # (embedding, LM head), bound by attach

    @classmethod
    def for_target(cls, config, num_layers: int, block_size: int, layer_ids: list[int] | None = None,
                   mask_token_id: int = 0) -> "DFlashDraft":
        """A draft at the target's widths (its ``config``, a transformers config), z-lab's feature layers unless
        ``layer_ids`` are given. Partial rotary is refused: the draft's rotary would not be the target's."""
        if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"method=dflash: the target rotates {config.partial_rotary_factor} of each head "
                              "(partial rotary), which this draft does not model; choose a target with full rotary")
        return cls(config.hidden_size, config.vocab_size,
                   layer_ids or target_layer_ids(config.num_hidden_layers, num_layers), num_layers, block_size,
                   mask_token_id=mask_token_id, **target_widths(config))

    @property
    def config(self) -> dict:
        return {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "target_layer_ids": self.target_layer_ids, "num_layers": self.num_layers,
                "block_size": self.block_size, "mask_token_id": self.mask_token_id, **self.settings}

    @property
    def hidden_states(self) -> tuple[int, ...]:
        """The transformers ``hidden_states`` indices of the feature layers (layer i's output: i + 1)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    def attach(self, base) -> "DFlashDraft":
        embed, head = base.get_input_embeddings(), self._base_lm_head(base)
        n = base.config.num_hidden_layers
        if max(self.target_layer_ids) >= n - 1:
            raise ConfigError(f"method.target_layer_ids={self.target_layer_ids}: the target has {n} layers; read "
                              f"layers below its last ({n - 1}), whose output transformers returns normed")
        self._target = (embed, head)
        return self

    def init_from_base(self, base) -> "DFlashDraft":
        """A new draft on ``base``: the mask token starts as the mean of the target's token embeddings."""
        self.attach(base)
        with torch.no_grad():
            self.mask_embedding.copy_(base.get_input_embeddings().weight.float().mean(0))
        return self

    def _bound(self) -> tuple[nn.Module, nn.Module]:
        if not self._target:
            raise RuntimeError("a dflash draft needs attach(target) before use")
        return self._target

    def context(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's context keys and values [B, kv_heads, T, hd] of the target's ``features`` [B, T, kH] (the
        feature layers' outputs, concatenated) at ``positions`` [B, T]."""
        c = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        rotary = self.rotary(c, positions)
        return [layer.context_kv(c, rotary) for layer in self.layers]

    def embed_block(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, Q] token ids, ``-1`` for a mask slot, -> [B, Q, H] embeddings."""
        embed = self._bound()[0]
        masked = tokens < 0
        x = embed(tokens.clamp(min=0)).to(self.mask_embedding.dtype)
        return torch.where(masked[..., None], self.mask_embedding, x)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, context: list, mask: torch.Tensor | None):
        """The output states [B, Q, H] of blocks ``tokens`` [B, Q] (-1: mask) at ``positions`` [B, Q], seeing the
        ``context`` keys and values and one another where ``mask`` [B, 1, Q, T + Q] allows (None: all)."""
        h = self.embed_block(tokens)
        rotary = self.rotary(h, positions)
        for layer, kv in zip(self.layers, context):
            h = layer(h, rotary, kv, mask)
        return h

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """The target's vocabulary logits of output states (the draft's ``norm``, then the target's LM head)."""
        head = self._bound()[1]
        return head(self.norm(states).to(head.weight.dtype))
