"""Low-rank adapters on a full fine-tune (``method.lora={r: 8, lora_alpha: 16}``: any ``peft.LoraConfig`` field;
``target_modules`` defaults to every linear layer but the LM head), through peft. Only the adapters train, so each
weight stays within rank r of the original (LoRA, Hu et al. 2021, eq. 3: W = W0 + (α/r)·B·A, with B = 0 at the start:
the model begins as the original, exactly). peft injects them into the transformers model in place, so the decoders,
the cache and ``generate`` see the same class; the export merges them into plain weights that load without peft.
"""

from __future__ import annotations

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer

from lit_spec.errors import ConfigError
from lit_spec.strategies import unpartitioned_init

ADAPTER = "default"


def lora_config(settings: dict) -> LoraConfig:
    try:
        return LoraConfig(**{"target_modules": "all-linear", **settings})
    except (TypeError, ValueError) as error:
        raise ConfigError(f"method.lora: {error} (its keys are peft.LoraConfig's: r, lora_alpha, lora_dropout, "
                          "target_modules, ...)") from None


def add_lora(model: torch.nn.Module, settings: dict) -> torch.nn.Module:
    """``model`` with adapters injected (in place), only they trainable, in the dtype of the weights they adapt."""
    # built whole: inside zero.Init peft would initialise A on an empty partition; the engine partitions them later
    with unpartitioned_init():
        try:
            return inject_adapter_in_model(lora_config(settings), model, adapter_name=ADAPTER)
        except ValueError as error:   # e.g. target_modules that name no layer of this model
            raise ConfigError(f"method.lora: {error}") from None


def merge_lora(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``state`` (the adapted model's whole state dict) with each adapted layer's weight merged (eq. 3, in fp32, then
    back to its dtype) under the plain layer's names: the state dict of the model without adapters."""
    merged = dict(state)
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        base = merged.pop(f"{name}.base_layer.weight")
        down, up = merged.pop(f"{name}.lora_A.{ADAPTER}.weight"), merged.pop(f"{name}.lora_B.{ADAPTER}.weight")
        delta = layer.scaling[ADAPTER] * (up.float() @ down.float())
        merged[f"{name}.weight"] = (base.float() + delta).to(base.dtype)
        if f"{name}.base_layer.bias" in merged:
            merged[f"{name}.bias"] = merged.pop(f"{name}.base_layer.bias")
    left = [key for key in merged if ".lora_" in key or ".base_layer." in key]
    if left:
        raise ValueError(f"adapter weights left unmerged: {left[:3]} (an adapter kind merge_lora does not know)")
    return merged
