"""Low-rank adapters on a full fine-tune (``method.lora={r: 8, lora_alpha: 16}``: ``peft.LoraConfig``'s fields;
``target_modules`` defaults to every linear layer but the LM head), through peft. Only the adapters train, so each
weight stays within rank r of the original (LoRA, Hu et al. 2021, eq. 3: W = W0 + (α/r)·B·A, with B = 0 at the start:
the model begins as the original, exactly). peft injects them into the transformers model in place, so the decoders,
the cache and ``generate`` see the same class; the export merges them into plain weights that load without peft.
Settings whose adapters that merge cannot fold into plain linear layers (DoRA, ``modules_to_save``, ...) are refused
before any work; an adapter on another kind of layer (an embedding), as soon as the model is built.
"""

from __future__ import annotations

from dataclasses import fields

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import Linear, LoraLayer

from lit_spec.errors import ConfigError
from lit_spec.strategies import unpartitioned_init

ADAPTER = "default"
# LoraConfig settings whose trained weights merge_lora cannot fold into the plain model (W0 + (α/r)·B·A of linear
# layers): set, each fails the export, or writes it under peft's names, after the whole training. Why, what to do.
UNMERGEABLE = {
    "use_dora": "DoRA's magnitude vectors do not merge into W0 + (α/r)·B·A; drop it",
    "modules_to_save": "peft trains copies of these modules, which the export would write under peft's names; drop "
                       "it (to train whole modules, train without method.lora)",
    "trainable_token_indices": "peft trains these tokens' embeddings apart, which the export does not merge; drop it",
    "lora_bias": "a bias on B does not merge into W0 + (α/r)·B·A; drop it",
    "target_parameters": "the export merges adapted linear layers only; name those layers in target_modules instead",
    "layer_replication": "the repeated layers are not in the model's config, so the export cannot write them; drop it",
}
# peft marks its other LoRA variants (VeLoRA, aLoRA, KaSA, ...): none merges into W0 + (α/r)·B·A
VARIANT = "a LoRA variant whose weights do not merge into W0 + (α/r)·B·A; drop it"


def check_mergeable(settings: dict) -> None:
    """Refuse what ``merge_lora`` cannot merge (``UNMERGEABLE`` and peft's LoRA variants): before any work, not at
    the export after training. Unset is None or False, each setting's default."""
    variants = {f.name: VARIANT for f in fields(LoraConfig) if f.metadata.get("is_lora_variant")}
    for key, why in (variants | UNMERGEABLE).items():
        if settings.get(key) not in (None, False):
            raise ConfigError(f"method.lora.{key}={settings[key]}: {why}")


def lora_config(settings: dict) -> LoraConfig:
    check_mergeable(settings)
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
            model = inject_adapter_in_model(lora_config(settings), model, adapter_name=ADAPTER)
        except ValueError as error:   # e.g. target_modules that name no layer of this model
            raise ConfigError(f"method.lora: {error}") from None
    # which layers target_modules names is known only now; an embedding's adapter would fail the export's merge
    other = [name for name, layer in model.named_modules() if isinstance(layer, LoraLayer)
             and not isinstance(layer, Linear)]
    if other:
        raise ConfigError(f"method.lora.target_modules: adapts {other[0]}, not a linear layer, which the export cannot "
                          "merge; name linear layers only (the default, all-linear, does)")
    return model


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
