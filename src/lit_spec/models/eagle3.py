"""EAGLE-3 (Li et al. 2025, arXiv 2503.01840), models part (the methods/ and decoding/ files of this name train it and
decode with it): a one-layer draft that reads the frozen target's features and predicts its next tokens, one at a time.

- **Features** (§3.2): the target's hidden states at ``layers`` (transformers' ``hidden_states`` indices: the inputs of
  decoder layers 2, n/2 and n-3 in the authors' code) are concatenated and fused by ``fc`` (3H -> H).
- **One decoder layer** (``Eagle3Layer``): its input is ``[norm(embedding of the token) ; norm(state)]``, so q/k/v read
  2H; the residual is the state. The state is the fused feature at the first step and the layer's own output after
  (training-time test, §3.3). A final ``norm`` and ``lm_head`` score a **pruned draft vocabulary**: the N tokens most
  frequent in the training answers, ``d2t[i]`` = (target id of draft token i) - i and ``t2d`` the target tokens kept,
  both derived from one sorted id list (``set_vocab``) and checked on load (``check_vocab``). The embedding is the
  target's, frozen and bound by ``attach(base)`` (never saved).
- **Positions.** Row n of the first step reads (token n+1, feature of position n) at position n; step i of row n sits
  at position n+i and sees the first step's rows <= n and its own chain (steps 1..i of row n): the training mask and
  the decoding cache see the same keys.

Parameter names follow the authors' checkpoints (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), the
layout vLLM's ``LlamaForCausalLMEagle3`` loads.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from lit_spec.errors import ConfigError, check_count
from lit_spec.models.draft_heads import DraftHeads, DraftRotary, layer_settings, swiglu, swiglu_mlp, target_widths


def feature_layers(num_layers: int) -> list[int]:
    """The authors' feature layers for a target of ``num_layers`` decoder layers: the inputs of layers 2, n/2 and
    n-3 (``hidden_states`` indices), low to high."""
    return sorted([min(2, num_layers), num_layers // 2, max(num_layers - 3, 0)])


def shifted(x: torch.Tensor, s: int) -> torch.Tensor:
    """``x`` [B, T, ...] moved ``s`` positions left along T, zeros after the end."""
    return torch.cat([x[:, s:], x.new_zeros(x.size(0), min(s, x.size(1)), *x.shape[2:])], dim=1)


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read 2H ([embedding ; state]); rotary positions; grouped key/value heads."""

    def __init__(self, hidden_size: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(2 * hidden_size, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden_size, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden_size, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]):
        """[B, Q, 2H] -> q [B, heads, Q, hd], k and v [B, kv_heads, Q, hd], q and k rotated."""
        q, k, v = (proj(x).unflatten(-1, (n, self.head_dim)).transpose(1, 2)
                   for proj, n in ((self.q_proj, self.heads), (self.k_proj, self.kv_heads),
                                   (self.v_proj, self.kv_heads)))
        q, k = apply_rotary_pos_emb(q, k, *rotary)
        return q, k, v

    def out(self, attended: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attended.transpose(1, 2).flatten(-2))


def ttt_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                  chain: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Step i of the training-time test: row n's query sees the first step's keys where ``allowed`` [B, T, T] and the
    keys of its own chain (``chain``: steps 1..i, each [B, kv, T, hd], row n for row n) -- a diagonal each, scored
    as T dot products rather than a T x T block (the authors' way)."""
    groups = q.size(1) // keys.size(1)
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    scale = 1 / math.sqrt(q.size(-1))
    scores = (q @ keys.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~allowed[:, None], torch.finfo(scores.dtype).min)
    diagonal = [(q * k.repeat_interleave(groups, 1)).sum(-1, keepdim=True).float() * scale for k, _ in chain]
    weights = torch.cat([scores, *diagonal], dim=-1).softmax(-1).to(q.dtype)
    out = weights[..., : keys.size(2)] @ values
    for j, (_, v) in enumerate(chain):
        out = out + weights[..., keys.size(2) + j: keys.size(2) + j + 1] * v.repeat_interleave(groups, 1)
    return out


class Eagle3Layer(nn.Module):
    """The draft's decoder layer (the authors' ``midlayer``); ``hidden_norm`` norms the state half of the input."""

    def __init__(self, hidden_size: int, heads: int, kv_heads: int, head_dim: int, intermediate_size: int,
                 eps: float):
        super().__init__()
        self.input_layernorm, self.hidden_norm = nn.RMSNorm(hidden_size, eps=eps), nn.RMSNorm(hidden_size, eps=eps)
        self.self_attn = Eagle3Attention(hidden_size, heads, kv_heads, head_dim)
        self.post_attention_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        self.mlp = swiglu_mlp(hidden_size, intermediate_size)

    def qkv(self, embeds: torch.Tensor, state: torch.Tensor, rotary):
        return self.self_attn.qkv(torch.cat([self.input_layernorm(embeds), self.hidden_norm(state)], dim=-1), rotary)

    def finish(self, state: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention (``attended`` [B, heads, Q, hd]) and the MLP."""
        h = state + self.self_attn.out(attended)
        x = self.post_attention_layernorm(h)
        return h + swiglu(self.mlp, x)


class Eagle3Draft(DraftHeads):
    """The EAGLE-3 draft (module docstring). ``forward`` is the training-time test over whole sequences; decoding
    calls ``features``, ``layer`` and ``logits`` step by step (``decoding/eagle3.py``)."""

    kind = "eagle3"
    counts_labels = False      # its vocabulary is fixed before training (``set_vocab``)
    forward_methods = ("features", "logits")   # called besides forward in training: FSDP2 gathers the weights

    def __init__(self, hidden_size: int, vocab_size: int, draft_vocab_size: int, layers: list[int],
                 num_attention_heads: int, num_key_value_heads: int | None = None, head_dim: int | None = None,
                 intermediate_size: int | None = None, rms_norm_eps: float = 1e-6,
                 rope_parameters: dict | None = None, max_position_embeddings: int = 2048):
        super().__init__(hidden_size, vocab_size, num_heads=1)      # one layer, run once per drafted token
        self.draft_vocab_size = check_count("draft_vocab_size", draft_vocab_size)
        if draft_vocab_size > vocab_size:
            raise ConfigError(f"method.draft_vocab_size={draft_vocab_size} exceeds the target's vocabulary of "
                              f"{vocab_size}: use at most {vocab_size}")
        self.layers = [int(t) for t in layers]
        if not self.layers or min(self.layers) < 0:
            raise ConfigError(f"method.layers={layers}: give the target's feature layers (hidden_states indices >= 0)")
        if self.layers != sorted(self.layers):
            # vLLM collects the target's states in ascending layer order: fc's input blocks must be in that order
            raise ConfigError(f"method.layers={layers}: list them in ascending order ({sorted(self.layers)}), the "
                              "order vLLM concatenates the target's states in")
        self.settings = layer_settings(hidden_size, num_attention_heads, num_key_value_heads, head_dim,
                                       intermediate_size, rms_norm_eps, rope_parameters, max_position_embeddings)
        s = self.settings
        self.fc = nn.Linear(len(self.layers) * hidden_size, hidden_size, bias=False)
        self.midlayer = Eagle3Layer(hidden_size, s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"],
                                    s["intermediate_size"], rms_norm_eps)
        self.norm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)
        self.lm_head = nn.Linear(hidden_size, draft_vocab_size, bias=False)
        self.rotary = DraftRotary(hidden_size, s)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(vocab_size) < draft_vocab_size)    # until set_vocab: the first N
        self._embed: tuple[nn.Module, ...] = ()

    @classmethod
    def for_target(cls, config, draft_vocab_size: int, layers: list[int] | None = None) -> "Eagle3Draft":
        """A draft shaped after the target's ``config`` (a transformers config): its sizes, heads, rotary and
        norm; ``layers`` None: the authors' feature layers."""
        return cls(config.hidden_size, config.vocab_size, draft_vocab_size,
                   layers or feature_layers(config.num_hidden_layers), **target_widths(config))

    @property
    def config(self) -> dict:
        return {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size, "layers": self.layers, **self.settings}

    # ---- the draft vocabulary -----------------------------------------------------------------------------------
    @property
    def draft_ids(self) -> torch.Tensor:
        """[N] the target id of each draft token."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_vocab(self, token_counts: torch.Tensor) -> float:
        """Keep the N most frequent tokens of ``token_counts`` [V] (ties: the lower id), in id order; returns the
        share of the counted tokens they cover."""
        counts = token_counts.to(torch.long).cpu()
        kept = torch.sort(-counts, stable=True).indices[: self.draft_vocab_size]     # stable: ties keep id order
        ids = kept.sort().values.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_().index_fill_(0, ids, True)
        total = int(counts.sum())
        return int(counts[kept].sum()) / total if total else 0.0

    def check_vocab(self) -> None:
        """``d2t`` and ``t2d`` describe one set of N increasing target ids (what a mismatched export breaks)."""
        ids = self.draft_ids
        if (ids.numel() != self.draft_vocab_size or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size
                or bool((ids[1:] <= ids[:-1]).any()) or int(self.t2d.sum()) != ids.numel()
                or not bool(self.t2d[ids].all())):
            raise ConfigError("eagle3 draft: its d2t and t2d do not describe the same draft vocabulary (N increasing "
                              "target ids); the weights are damaged or from another draft: export them again")

    # ---- binding to the target ----------------------------------------------------------------------------------
    def attach(self, base) -> "Eagle3Draft":
        embed = base.get_input_embeddings()
        if tuple(embed.weight.shape) != (self.vocab_size, self.hidden_size):
            raise ConfigError(f"eagle3 draft for hidden size {self.hidden_size} and vocabulary {self.vocab_size} "
                              f"does not fit a target whose embeddings are {tuple(embed.weight.shape)}")
        n = base.config.num_hidden_layers
        if max(self.layers) > n:
            raise ConfigError(f"method.layers={self.layers}: the target has {n} decoder layers, so hidden_states "
                              f"indices run 0..{n}")
        self._embed = (embed,)
        return self

    def init_from_base(self, base, token_counts: torch.Tensor | None = None) -> "Eagle3Draft":
        """A new draft: its vocabulary from ``token_counts`` (None: kept), its ``lm_head`` rows the target's LM
        head rows of those tokens (the authors start it at random; the target's rows score the normed state from the
        first step)."""
        self.attach(base)
        if token_counts is not None:
            self.set_vocab(token_counts)
        with torch.no_grad():
            self.lm_head.weight.copy_(base.get_output_embeddings().weight[self.draft_ids])
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if not self._embed:
            raise RuntimeError("an eagle3 draft needs attach(target) before use")
        return self._embed[0](ids)

    # ---- steps ----------------------------------------------------------------------------------------------------
    def features(self, hidden_states: tuple[torch.Tensor, ...] | torch.Tensor) -> torch.Tensor:
        """The fused feature [B, T, H] of the target's ``hidden_states`` (all of a forward's, or the ``layers``
        already concatenated: [B, T, k·H])."""
        if not isinstance(hidden_states, torch.Tensor):
            hidden_states = torch.cat([hidden_states[t] for t in self.layers], dim=-1)
        return self.fc(hidden_states.to(self.fc.weight.dtype))

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., N] of the layer's output state."""
        return self.lm_head(self.norm(state))

    def forward(self, ids: torch.Tensor, features: torch.Tensor, valid: torch.Tensor, steps: int) -> list:
        """The training-time test over right-padded sequences (``ids``, ``valid`` [B, T], ``features`` [B, T, H]):
        per step i (0..steps-1) the states [B, T, H] whose row n predicts token n+2+i (logits: ``logits``). Step 0
        reads token n+1 and the feature of n; step i token n+1+i and step i-1's state of row n."""
        b, t = ids.shape
        positions = torch.arange(t, device=ids.device)[None].expand(b, -1)
        allowed = (positions[:, None, :] <= positions[:, :, None]) & valid[:, None, :]
        state, keys, chain, outputs = features, None, [], []
        for i in range(steps):
            rotary = self.rotary(state, positions + i)
            q, k, v = self.midlayer.qkv(self.embed(shifted(ids, 1 + i)).to(state.dtype), state, rotary)
            if i == 0:
                keys = (k, v)
            else:
                chain.append((k, v))
            state = self.midlayer.finish(state, ttt_attention(q, *keys, allowed, chain))
            outputs.append(state)
        return outputs
