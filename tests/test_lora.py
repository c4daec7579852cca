"""``method.lora``: a full fine-tune that trains low-rank adapters only (peft), and exports them merged into plain
weights. Checked against peft's own merge and transformers' ``generate``, on several architectures and end to end."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lit_spec.checks import check_run
from lit_spec.decoding import generate
from lit_spec.errors import ConfigError
from lit_spec.models.lora import add_lora, merge_lora
from lit_spec.training import run_training
from random_models import ARCHS, random_model, random_prompts, reference_greedy

LORA = {"r": 4, "lora_alpha": 8}


def adapted(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A random model, and a copy with adapters whose B is random (as after training: B starts at 0)."""
    original = random_model(arch)
    model = add_lora(copy.deepcopy(original), LORA)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return original, model.eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_adapters_start_as_the_original_and_only_they_train(arch):
    original = random_model(arch)
    model = add_lora(copy.deepcopy(original), LORA)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert not any("lm_head" in n for n in trained), "every linear layer but the LM head"
    ids, mask = random_prompts(2, [5, 8])
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, original(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_merged_state_is_peft_merge_and_decodes_as_the_adapted_model(arch):
    original, model = adapted(arch)
    merged = merge_lora(model.state_dict(), model)
    assert merged.keys() == original.state_dict().keys()

    reference = copy.deepcopy(model)
    adapted_layers = {name: layer for name, layer in reference.named_modules() if isinstance(layer, LoraLayer)}
    # every linear layer but the LM head: q, k, v, o, gate, up and down of each decoder layer
    assert len(adapted_layers) == 7 * original.config.num_hidden_layers
    for name, layer in adapted_layers.items():       # peft's own merge, in place
        layer.merge()
        assert layer.merged
        torch.testing.assert_close(merged[f"{name}.weight"], layer.base_layer.weight, rtol=1e-6, atol=1e-6)
        assert not torch.equal(merged[f"{name}.weight"], original.state_dict()[f"{name}.weight"]), "B·A merged in"

    plain = copy.deepcopy(original)
    plain.load_state_dict(merged)
    ids, mask = random_prompts(1, [9], seed=ARCHS.index(arch))
    expected = reference_greedy(model, ids, mask, 24)
    assert torch.equal(reference_greedy(plain, ids, mask, 24), expected)
    # lossless on the adapted model itself: the decoders see peft's layers inside the transformers class
    assert torch.equal(generate(model, ids, "jacobi", max_new_tokens=24, n_tokens=4).sequences, expected)


def test_a_lora_run_trains_the_adapters_and_exports_plain_merged_weights(micro_config, micro_dirs):
    cfg = micro_config("method.lora={r: 4, lora_alpha: 8}", "trainer.max_steps=6", "trainer.val_check_interval=6",
                       "method.lr=1e-2")
    run_training(cfg)
    state = torch.load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    original = load_file(Path(micro_dirs[0]) / "model.safetensors")
    exported = load_file(Path(cfg.export_dir) / "model.safetensors")
    assert exported.keys() == original.keys(), "plain names: no adapter or base_layer keys"
    moved = {k for k in exported if not torch.equal(exported[k], original[k])}
    assert moved and all(k.endswith("proj.weight") for k in moved), "only adapted layers move"
    ups = [v for k, v in state.items() if ".lora_B." in k]
    assert ups and any(v.abs().sum() > 0 for v in ups), "the adapters trained (B left 0)"
    model = AutoModelForCausalLM.from_pretrained(cfg.export_dir)   # no peft needed to load it
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert json.loads((Path(cfg.export_dir) / "config.json").read_text())["architectures"]


@pytest.mark.parametrize("overrides, message", [
    (["method=medusa", "method.lora={r: 4}"], r"method.lora: MedusaModule already trains a small part"),
    (["method.lora={rank: 4}"], r"method.lora: .*rank.*its keys are peft.LoraConfig's"),
])
def test_bad_lora_settings_are_refused_before_work(micro_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_run(micro_config(*overrides))


# one of each setting whose adapters merge_lora cannot merge (peft's LoRA variants: aLoRA's, VeLoRA's, KaSA's config)
UNMERGEABLE = ["use_dora: true", "modules_to_save: [lm_head]", "trainable_token_indices: [3, 4]", "lora_bias: true",
               "target_parameters: [mlp.down_proj.weight]", "layer_replication: [[0, 1], [0, 2]]",
               "alora_invocation_tokens: [5]", "velora_config: {}", "kasa_config: {}"]


@pytest.mark.parametrize("setting", UNMERGEABLE)
def test_settings_the_export_cannot_merge_are_refused_before_work(micro_config, setting):
    """Without the refusal each trains, then fails at the export (DoRA: "adapter weights left unmerged";
    modules_to_save: save_pretrained's shared tensors), or exports what does not load as the model (layer_replication)
    or another model, silently (aLoRA)."""
    key = setting.split(":")[0]
    with pytest.raises(ConfigError, match=rf"^method\.lora\.{key}=\S.*: .*(drop it|in target_modules instead)"):
        check_run(micro_config(f"method.lora={{r: 4, {setting}}}"))


def test_an_adapter_on_an_embedding_is_refused_as_the_model_is_built():
    """``target_modules`` names layers of the model: only once it is built does it show an embedding among them."""
    with pytest.raises(ConfigError, match=r"method\.lora\.target_modules: adapts model\.embed_tokens, not a linear"):
        add_lora(random_model("llama"), {**LORA, "target_modules": ["embed_tokens", "q_proj"]})
