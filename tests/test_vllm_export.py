"""Exports for vLLM (lit_spec.serving.vllm_export): each weight lands under vLLM's name with its trained value, the
config says what vLLM builds, a damaged export is one clear error, and what vLLM cannot serve as trained is not
written. ``tests/test_serving.py`` has vLLM itself load and run them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from random_models import random_model
from safetensors.torch import load_file, save_file

from lit_spec.errors import ConfigError
from lit_spec.models.chimera import ChimeraDraft
from lit_spec.models.dflash import DFlashDraft
from lit_spec.models.draft_heads import MedusaHeads
from lit_spec.models.eagle3 import Eagle3Draft
from lit_spec.models.hidden_transfer import HiddenTransfer
from lit_spec.serving.vllm_export import check_vllm_export, write_vllm_export


@pytest.fixture(scope="module")
def model():
    return random_model("llama")


def eagle3(model, layers=(0, 1)) -> Eagle3Draft:
    """A draft of random weights over 32 target tokens, reading the states before the model's two layers."""
    torch.manual_seed(0)
    draft = Eagle3Draft.for_target(model.config, 32, list(layers))
    draft.set_vocab(torch.randint(0, 50, (model.config.vocab_size,)))
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_()
    return draft


def test_eagle3_is_written_under_vllms_names_with_its_trained_values(model, tmp_path):
    draft = eagle3(model)
    out = write_vllm_export(draft, None, tmp_path / "vllm", model.config.num_hidden_layers)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (config["draft_vocab_size"], config["vocab_size"]) == (32, model.config.vocab_size)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1]
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1]
    assert config["target_hidden_size"] == model.config.hidden_size and config["num_hidden_layers"] == 1
    written, state = load_file(out / "model.safetensors"), draft.state_dict()
    assert written.keys() == state.keys()
    assert all(torch.equal(written[k], state[k]) for k in state)
    # vLLM's draft token i is target token i + d2t[i]: our draft ids
    assert torch.equal(torch.arange(32) + written["d2t"], draft.draft_ids)


def test_dflash_is_written_under_vllms_names_with_its_mask_embedding_beside(model, tmp_path):
    torch.manual_seed(0)
    draft = DFlashDraft.for_target(model.config, 2, 8, layer_ids=[0, 0], mask_token_id=3)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_()
    out = write_vllm_export(draft, None, tmp_path / "vllm", model.config.num_hidden_layers)
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["DFlashDraftModel"], "qwen3")
    assert config["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [0, 0]}
    assert config["num_hidden_layers"] == 2 and config["layer_types"] == ["full_attention"] * 2
    written, state = load_file(out / "model.safetensors"), draft.state_dict()
    mask = torch.load(out / "mask_embedding.pt", weights_only=True)
    assert written.keys() == state.keys() - {"mask_embedding"}
    assert all(torch.equal(written[k], state[k]) for k in written)
    assert mask["mask_token_id"] == 3 and torch.equal(mask["embedding"], draft.mask_embedding)

    (out / "mask_embedding.pt").unlink()          # vLLM would embed the mask slot as token 3: another draft
    with pytest.raises(ConfigError, match="missing mask_embedding.pt"):
        check_vllm_export(out)


def test_medusa_heads_are_written_as_vllms_residual_blocks_and_lm_heads(model, tmp_path):
    heads = MedusaHeads(model.config.hidden_size, model.config.vocab_size, num_heads=3).init_from_base(model)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    out = write_vllm_export(heads, None, tmp_path / "vllm", model.config.num_hidden_layers)
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["num_heads"], config["medusa_fc_bias"]) == (["MedusaModel"], 3, True)
    written = load_file(out / "model.safetensors")
    assert len(written) == 9
    for k, head in enumerate(heads.heads):
        assert torch.equal(written[f"blocks.{k}.layers.0.weight"], head.block.linear.weight)
        assert torch.equal(written[f"blocks.{k}.layers.0.bias"], head.block.linear.bias)
        assert torch.equal(written[f"lm_heads.{k}.weight"], head.out.weight)


def test_what_vllm_cannot_serve_as_trained_is_not_written(model, tmp_path):
    h, v, n = model.config.hidden_size, model.config.vocab_size, model.config.num_hidden_layers
    shared = MedusaHeads(h, v, num_heads=2, shared_lm_head=True)       # vLLM reads each head's LM head from its file
    last = eagle3(model, layers=[1, n])      # hidden_states[n]: transformers' is after the final norm, vLLM's before
    for heads in (ChimeraDraft(h, v, num_heads=2), HiddenTransfer(h, v, layers=[1]), shared, last):
        assert write_vllm_export(heads, None, tmp_path / heads.kind, n) is None
        assert not (tmp_path / heads.kind).exists()


def test_a_damaged_export_is_one_error_naming_every_mismatch(model, tmp_path):
    good = write_vllm_export(eagle3(model), None, tmp_path / "good", model.config.num_hidden_layers)
    bad = shutil.copytree(good, tmp_path / "bad")
    weights = load_file(bad / "model.safetensors")
    weights["midlayer.self_attn.qproj.weight"] = weights.pop("midlayer.self_attn.q_proj.weight")    # renamed
    del weights["d2t"]                        # vLLM would map draft token i to target token i, silently
    weights["fc.weight"] = weights["fc.weight"][:, :-1].contiguous()
    save_file(weights, bad / "model.safetensors")
    with pytest.raises(ConfigError) as error:
        check_vllm_export(bad)
    for part in ("missing midlayer.self_attn.q_proj.weight", "missing d2t", "unexpected midlayer.self_attn.qproj",
                 "fc.weight is"):
        assert part in str(error.value)

    weights = load_file(good / "model.safetensors")
    weights["d2t"][-1] += model.config.vocab_size            # past the target's vocabulary
    save_file(weights, bad / "model.safetensors")
    with pytest.raises(ConfigError, match="d2t maps draft tokens outside"):
        check_vllm_export(bad)
