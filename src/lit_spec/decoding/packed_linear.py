"""oneDNN's packed fp32 linear for the static engine on a CPU. MKL's ``F.linear`` reads SmolLM2's weights at 12.6 GB/s
with one row and 7.6 GB/s with four on a 2-core AVX2 EPYC; on weights reordered once for oneDNN
(``mkldnn._reorder_linear_weight``) the same products read them at 16.7 and 14.6 GB/s. The target then runs through
a *twin*: its module tree copied shallowly, sharing every parameter, each ``nn.Linear`` replaced by a
``PackedLinear`` over the same weight. The model itself is left as it is.

A weight changed in place since it was packed (``_version``: an optimizer step, the speedup callback's refreshed
copy) is packed again before its next product. The compiled engine keeps MKL's products: inductor lowers oneDNN's op
only for weights frozen into the graph, and wrapping it in a custom op cost more than it saved.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PreTrainedModel


def packable(model) -> bool:
    """A transformers model with fp32 weights on a CPU with oneDNN (bf16, GPUs and wrapped models keep their own)."""
    weight = next(model.parameters())
    return (isinstance(model, PreTrainedModel) and weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


class PackedLinear(nn.Module):
    """An ``nn.Linear``'s product on a packed copy of its weight, packed again when the weight changes."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear
        self.packed_version = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.linear.weight
        if self.packed_version != (weight.data_ptr(), weight._version):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
            self.packed_version = (weight.data_ptr(), weight._version)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.linear.bias, "none", [], "")


def packed_twin(module: nn.Module) -> nn.Module:
    """``module`` with every ``nn.Linear`` below it replaced by a ``PackedLinear``; every other module copied
    shallowly (parameters, buffers and config shared)."""
    if type(module) is nn.Linear:
        return PackedLinear(module)
    twin = copy.copy(module)
    twin._modules = {name: None if child is None else packed_twin(child) for name, child in module._modules.items()}
    return twin
