"""Hidden Transfer (Wu et al. 2024, §3.2-3.4), models part (the methods/ and decoding/ files of this name train and
decode it): linear maps that turn the base's hidden state of a token at an
intermediate layer into *pseudo* hidden states of the tokens after it, which then run through the remaining layers
with the real ones and are decoded by the base's own LM head.

Step i (i = 1..k) has its own map W_i ∈ R^{d×d} (identity at initialisation) at layer t_i (non-decreasing): the
pseudo state of step i anchored at real position j, h̃ = W_i · h_j^{t_i} (§3.3's equation), stands for position j+i
(its position id) and its logits predict the token after it, as the real state at j+i does. It may see the real
states of positions <= j and the pseudo states of its own chain with steps <= i (the paper's "no masked" setting,
which its ablation prefers; ``masked=True``: only itself).

How it runs inside any Llama-family ``transformers`` model without touching its code: the pseudo tokens are placed
after the real ones in the same forward (``transfer_block``: visibility and positions), with placeholder inputs; a
forward pre-hook on decoder layer t_i (the final norm for t_i = L) replaces step i's placeholders by W_i of their
anchors' states, out of place. Below t_i the placeholders compute garbage that nothing real sees (real tokens never
attend to pseudo ones, and a pseudo state only sees earlier steps of its chain, replaced at a layer <= its own). The
same hooks serve training (every position anchors a chain) and decoding (every node of the verified tree does), and
they do nothing unless ``planned(...)`` says where the pseudo tokens are.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from lit_spec.errors import ConfigError
from lit_spec.models.draft_heads import DraftHeads


def transfer_block(visible: torch.Tensor, depth: torch.Tensor, steps: int,
                   masked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Visibility and positions of a block of R real tokens followed by ``steps`` pseudo tokens per real one.

    ``visible`` [R, R] (which real tokens each real token sees, itself included) and ``depth`` [R] (their positions)
    -> [R(1+k), R(1+k)] and [R(1+k)]. Layout: the R real tokens, then step 1's R pseudo tokens (anchored at real
    token 0..R-1), then step 2's, ... Pseudo (a, i) sees what its anchor a sees and its chain's steps 1..i (only
    itself when ``masked``), at position depth[a] + i. Real tokens see no pseudo token."""
    r = visible.size(0)
    q = r * (1 + steps)
    out = torch.zeros(q, q, dtype=torch.bool, device=visible.device)
    out[:r, :r] = visible
    eye = torch.eye(r, dtype=torch.bool, device=visible.device)
    for s in range(1, steps + 1):
        rows = slice(r * s, r * (s + 1))
        out[rows, :r] = visible
        for earlier in ([s] if masked else range(1, s + 1)):
            out[rows, r * earlier: r * (earlier + 1)] = eye
    return out, torch.cat([depth] + [depth + s for s in range(1, steps + 1)])


class HiddenTransfer(DraftHeads):
    """The k transfer maps (``heads[i - 1]`` is W_i) and the layers they act at; ``init_from_base`` checks the
    layers against the base and hooks it."""

    kind = "hidden_transfer"
    counts_labels = False     # its pseudo states go through the base's own layers and LM head

    def __init__(self, hidden_size: int, vocab_size: int, layers: list[int], masked: bool = False):
        layers = [int(t) for t in layers] if layers else []
        if not layers or min(layers) < 0 or any(b < a for a, b in zip(layers, layers[1:])):
            raise ConfigError(f"transfer layers={layers}: give one layer per transfer step, non-decreasing, each "
                              ">= 0 (t: the decoder layers that run before the transfer)")
        super().__init__(hidden_size, vocab_size, len(layers))
        self.layers, self.masked = layers, bool(masked)
        self.heads = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=False) for _ in layers)
        for w in self.heads:
            nn.init.eye_(w.weight)
        self._plan: tuple[torch.Tensor, torch.Tensor] | None = None   # (anchor indices [R], real tokens R)
        self._hooks: list = []
        self._base_id: int | None = None

    @property
    def config(self) -> dict:
        return {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "layers": self.layers,
                "masked": self.masked}

    def init_from_base(self, base) -> "HiddenTransfer":
        """Check the layers against ``base`` and hook its decoder layers (once per base; idempotent)."""
        decoder = base.get_decoder()
        n = len(decoder.layers)
        if max(self.layers) > n:
            raise ConfigError(f"transfer layers={self.layers}: the base has {n} decoder layers; use layers <= {n} "
                              f"({n} = after the last layer, before the final norm)")
        if self._base_id == id(base):
            return self
        for handle in self._hooks:
            handle.remove()
        modules = {t: decoder.layers[t] if t < n else decoder.norm for t in dict.fromkeys(self.layers)}
        self._hooks = [m.register_forward_pre_hook(self._hook(t), with_kwargs=True) for t, m in modules.items()]
        self._base_id = id(base)
        return self

    @contextmanager
    def planned(self, real: int, anchors: torch.Tensor):
        """Within this block, the forward's input holds ``real`` real tokens and then, per step, one pseudo token
        per entry of ``anchors`` (real indices; ``transfer_block``'s layout when ``anchors`` is all of them)."""
        self._plan = (anchors, real)
        try:
            yield
        finally:
            self._plan = None

    def _hook(self, layer: int):
        steps = [i for i, t in enumerate(self.layers) if t == layer]

        def inject(module, args, kwargs):
            if self._plan is None:
                return None
            anchors, real = self._plan
            hidden = args[0] if args else kwargs["hidden_states"]
            r = anchors.numel()
            for i in steps:                                  # step i + 1's pseudo tokens: W_i of their anchors
                index = torch.arange(real + i * r, real + (i + 1) * r, device=hidden.device)
                hidden = hidden.index_copy(1, index, self.heads[i](hidden[:, anchors]))
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}

        return inject

