"""Draft heads (Chimera, Medusa), models part (the methods/ and decoding/ files of this name train and decode them):
what Chimera's lightweight draft (``models/chimera.py``) and the Medusa-1 baseline heads share, and Medusa's heads.

Both read the base's last-layer hidden states (the ones its LM head reads) and predict the tokens after the base's
own next token: for a prefix of n tokens the base predicts token n+1 and head k (k = 0..K-1) token n+2+k. They own
only their parameters; the base, embeddings and LM head included, is frozen and never saved with them
(``save_heads`` / ``load_heads``).

Medusa-1 (Cai et al. 2024): head k = vocabulary projection (initialised from the base's LM head) of a ResBlock
(initialised to the identity) of ``h_LLM_n``.

``shared_lm_head=True`` gives every head the base's frozen LM head as its vocabulary projection instead of a
trainable copy (as EAGLE's draft does): on SmolLM2 a copy is 49,152 x 576 = 28 M trainable parameters per head,
which dominates a training step on CPU (experiments/RESULTS.md). The shared projection is bound by
``attach(base)``, never saved, and the heads' ``heads.json`` records the choice.

``token_counts`` counts the tokens the heads were trained to predict (a saved buffer, filled by training):
``DraftVocab`` drafts over the most frequent of them only (FR-Spec), a fraction of the vocabulary projection's cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from lit_spec.errors import ConfigError, check_count


def layer_settings(hidden_size: int, num_attention_heads: int, num_key_value_heads: int | None = None,
                   head_dim: int | None = None, intermediate_size: int | None = None, rms_norm_eps: float = 1e-6,
                   rope_parameters: dict | None = None, max_position_embeddings: int = 2048) -> dict:
    """The widths of a draft's own decoder layers (EAGLE-3's, DFlash's), defaults filled: every head its own keys,
    head dim H / heads, an MLP of 4H, Llama's default rotary."""
    return {"num_attention_heads": num_attention_heads,
            "num_key_value_heads": num_key_value_heads or num_attention_heads,
            "head_dim": head_dim or hidden_size // num_attention_heads,
            "intermediate_size": intermediate_size or 4 * hidden_size, "rms_norm_eps": rms_norm_eps,
            "rope_parameters": dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}),
            "max_position_embeddings": max_position_embeddings}


def target_widths(config) -> dict:
    """A transformers target ``config``'s layer widths, as ``layer_settings``' keywords."""
    return {"num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": getattr(config, "num_key_value_heads", None),
            "head_dim": getattr(config, "head_dim", None), "intermediate_size": config.intermediate_size,
            "rms_norm_eps": getattr(config, "rms_norm_eps", 1e-6),
            "rope_parameters": getattr(config, "rope_parameters", None),
            "max_position_embeddings": config.max_position_embeddings}


class DraftRotary:
    """transformers' Llama rotary (cos, sin) for a draft's own attention, built at first use per device (no meta copy
    to fill); called with a tensor for the dtype and ``positions`` [B, Q]."""

    def __init__(self, hidden_size: int, settings: dict):
        self.config = LlamaConfig(hidden_size=hidden_size, **settings)
        self.by_device: dict[torch.device, nn.Module] = {}

    def on(self, device: torch.device) -> nn.Module:
        """The rotary module on ``device``, built at its first use: a compiled draft step builds it first, outside
        the compiled code (a module built while tracing breaks the graph)."""
        if device not in self.by_device:
            self.by_device[device] = LlamaRotaryEmbedding(self.config).to(device)
        return self.by_device[device]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor):
        return self.on(x.device)(x, positions)


def swiglu_mlp(hidden_size: int, intermediate_size: int) -> nn.ModuleDict:
    """A Llama MLP under its checkpoint names (``gate_proj``, ``up_proj``, ``down_proj``); run by ``swiglu``."""
    return nn.ModuleDict({name: nn.Linear(*shape, bias=False) for name, shape in (
        ("gate_proj", (hidden_size, intermediate_size)), ("up_proj", (hidden_size, intermediate_size)),
        ("down_proj", (intermediate_size, hidden_size)))})


def swiglu(mlp: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
    return mlp["down_proj"](F.silu(mlp["gate_proj"](x)) * mlp["up_proj"](x))


class ResBlock(nn.Module):
    """Medusa's ``x + SiLU(Wx + b)``, W zero-initialised so that a new head starts as the base's LM head."""

    def __init__(self, size: int):
        super().__init__()
        self.linear = nn.Linear(size, size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class DecodingHead(nn.Module):
    """Linear(in -> d) (absent when in == d; initialised to pass the first d inputs through), ResBlock,
    Linear(d -> V): its own (``out``), or the base's LM head bound by ``share`` (held outside the module's
    parameters, so it is neither trained nor saved)."""

    def __init__(self, in_size: int, hidden_size: int, vocab_size: int, shared_lm_head: bool = False):
        super().__init__()
        self.proj = nn.Identity()
        if in_size != hidden_size:
            self.proj = nn.Linear(in_size, hidden_size, bias=False)
            with torch.no_grad():
                self.proj.weight.zero_()
                self.proj.weight[:, :hidden_size].copy_(torch.eye(hidden_size))
        self.block = ResBlock(hidden_size)
        self.out = None if shared_lm_head else nn.Linear(hidden_size, vocab_size, bias=False)
        self._shared: tuple[nn.Module, ...] = ()

    def share(self, lm_head: nn.Module) -> None:
        self._shared = (lm_head,)

    def projection(self) -> nn.Module:
        """The vocabulary projection: the head's own, or the base's LM head it shares."""
        if self.out is None and not self._shared:
            raise RuntimeError("draft heads with shared_lm_head=True need attach(base) before use")
        return self.out if self.out is not None else self._shared[0]

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The state the projection reads."""
        return self.block(self.proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection()(self.features(x))


class DraftHeads(nn.Module):
    """What Chimera's draft, Medusa's heads and Hidden Transfer's maps share: K heads, their config, initialisation
    from the base; ``kind`` names the class in ``heads.json`` (``models/saved_heads.py``)."""

    kind = "heads"
    counts_labels = True     # a ``token_counts`` buffer of the training labels (heads with a vocabulary projection)

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, shared_lm_head: bool = False):
        super().__init__()
        self.hidden_size = check_count("hidden_size", hidden_size)
        self.vocab_size = check_count("vocab_size", vocab_size)
        self.num_heads = check_count("num_heads", num_heads)
        self.shared_lm_head = bool(shared_lm_head)
        if self.counts_labels:
            self.register_buffer("token_counts", torch.zeros(vocab_size, dtype=torch.long))

    def count_tokens(self, labels: torch.Tensor) -> None:
        """Add the labels of a training batch to ``token_counts`` (what ``DraftVocab`` ranks the vocabulary by). In
        multi-process training the saved counts are rank zero's: a sample of the data, as good for a ranking."""
        self.token_counts += torch.bincount(labels.flatten(), minlength=self.vocab_size)

    @property
    def config(self) -> dict:
        return {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "num_heads": self.num_heads,
                "shared_lm_head": self.shared_lm_head}

    def _base_lm_head(self, base) -> nn.Module:
        lm_head = base.get_output_embeddings()
        if tuple(lm_head.weight.shape) != (self.vocab_size, self.hidden_size):
            raise ConfigError(f"heads for hidden size {self.hidden_size} and vocabulary {self.vocab_size} do not fit "
                              f"a base whose LM head is {tuple(lm_head.weight.shape)}")
        return lm_head

    def attach(self, base) -> "DraftHeads":
        """Bind the base's LM head to every head when they share it (trained or loaded heads alike)."""
        if self.shared_lm_head:
            lm_head = self._base_lm_head(base)
            for head in self.heads:
                head.share(lm_head)
        return self

    def init_from_base(self, base) -> "DraftHeads":
        """New heads: copy the base's LM head into every head's own vocabulary projection (as Medusa does), or
        share it (``shared_lm_head``)."""
        weight = self._base_lm_head(base).weight
        if not self.shared_lm_head:
            with torch.no_grad():
                for head in self.heads:
                    head.out.weight.copy_(weight)
        return self.attach(base)


class MedusaHeads(DraftHeads):
    """Medusa-1: head k predicts token n+2+k from ``h_LLM_n`` alone."""

    kind = "medusa"

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, shared_lm_head: bool = False):
        super().__init__(hidden_size, vocab_size, num_heads, shared_lm_head)
        self.heads = nn.ModuleList(DecodingHead(hidden_size, hidden_size, vocab_size, shared_lm_head)
                                   for _ in range(num_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] base states -> [..., K, V] logits of tokens n+2..n+1+K."""
        return torch.stack([head(hidden) for head in self.heads], dim=-2)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] base states -> [..., K, d]: what each head's vocabulary projection reads."""
        return torch.stack([head.features(hidden) for head in self.heads], dim=-2)

    def head_inputs(self, embeds: torch.Tensor, hidden: torch.Tensor, valid: torch.Tensor):
        """Head k's inputs at every prefix end n in [0, T-k-2) ([B, T-k-2, d]; ``heads[k]`` of them predicts token
        n+2+k); no full-context states."""
        t = hidden.size(1)
        return [hidden[:, : t - k - 2] for k in range(self.num_heads)], None


class DraftVocab:
    """What draft heads score when decoding: the whole vocabulary (``size`` None), or FR-Spec's frequency-ranked
    subset (Zhao et al. 2025, §3): the ``size`` tokens the heads were most often trained to predict
    (``token_counts``). A head's cost on a CPU is reading its vocabulary projection (49,152 x 576 on SmolLM2, the
    size of a quarter of the base's layers), so the subset cuts it by V / size. Verification still scores the whole
    vocabulary, so a decoder stays lossless; a token outside the subset is never drafted. Built per decode from the
    heads' current weights; heads sharing one projection (``shared_lm_head``) are scored in one matrix product."""

    def __init__(self, heads: DraftHeads, size: int | None = None):
        self.ids = None
        if size is not None and size < heads.vocab_size:
            if not heads.token_counts.any():
                raise ConfigError(f"draft_vocab={size}: these heads carry no token counts (saved before training "
                                  "counted them): retrain them, or use draft_vocab=null (the whole vocabulary)")
            self.ids = heads.token_counts.topk(size).indices
        cut: dict[int, tuple] = {}
        for head in heads.heads:
            out = head.projection()
            if id(out) not in cut:
                weight, bias = out.weight, out.bias
                cut[id(out)] = (weight, bias) if self.ids is None else (
                    weight[self.ids], None if bias is None else bias[self.ids])
        self.weights = [cut[id(head.projection())] for head in heads.heads]
        self.shared = len(cut) == 1                  # one projection for every head: one matrix product
        self.size = heads.vocab_size if self.ids is None else size

    def topk(self, features: torch.Tensor, first: int, k: int) -> torch.Tensor:
        """Token ids [H, k] of the top-k of heads ``first``..``first+H-1`` from their features [H, d]."""
        weights = self.weights[first: first + features.size(0)]
        if self.shared or len(weights) == 1:
            logits = F.linear(features, *weights[0])
        else:
            logits = torch.stack([F.linear(f, *w) for f, w in zip(features, weights)])
        top = logits.topk(k, dim=-1).indices
        return top if self.ids is None else self.ids[top]
