"""Hidden Transfer (lit_spec.models.hidden_transfer, decoding.hidden_transfer, methods.hidden_transfer): the pseudo
tokens' mask and positions, identity maps after the last layer reproduce the anchor's own logits, no look at the
future, lossless tree decoding on three Llama-family architectures, save -> load -> same decoder, frozen base,
a micro training run, clear errors."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import built_method, heads_training_step
from random_models import ARCHS, greedy_with_mid_output_eos, random_model, random_prompts, reference_greedy

from lit_spec.decoding import generate
from lit_spec.decoding.masks import causal
from lit_spec.errors import ConfigError
from lit_spec.export import MARK
from lit_spec.models.saved_heads import load_heads, save_heads
from lit_spec.models.hidden_transfer import HiddenTransfer, transfer_block



def transfer(model, layers=(1, 1, 2), seed: int = 0, noise: float = 0.05, **kwargs) -> HiddenTransfer:
    """Maps near the identity with random perturbations (so the drafts are neither trivial nor all wrong)."""
    c = model.config
    torch.manual_seed(seed)
    t = HiddenTransfer(c.hidden_size, c.vocab_size, list(layers), **kwargs)
    with torch.no_grad():
        for p in t.parameters():
            p.add_(torch.randn_like(p) * noise)
    return t.init_from_base(model).eval()


def pseudo_logits(model, t: HiddenTransfer, ids: torch.Tensor) -> torch.Tensor:
    """One training-layout forward of ``ids`` [1, T]: logits [1 + k, T, V] (row 0 real, row i step i's pseudo)."""
    n, k = ids.size(1), t.num_heads
    positions = torch.arange(n)
    visible, depth = transfer_block(causal(n), positions, k, t.masked)
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]
    with t.planned(n, positions), torch.no_grad():
        logits = model(input_ids=ids.repeat(1, 1 + k), attention_mask=mask, position_ids=depth[None]).logits
    return logits[0].unflatten(0, (1 + k, n))


def test_transfer_block_is_the_papers_rule():
    """Real tokens 0..2 (causal), 2 steps: pseudo (j, i) sees real <= j and its chain's steps <= i ("no masked"),
    or itself alone among pseudo tokens ("masked"); position j + i. Real tokens never see pseudo ones."""
    visible, depth = transfer_block(causal(3), torch.arange(3), 2)
    expected = torch.tensor([
        # real 0 1 2 | step1 0 1 2 | step2 0 1 2
        [1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 0, 0, 0],     # (0, 1)
        [1, 1, 0, 0, 1, 0, 0, 0, 0],     # (1, 1)
        [1, 1, 1, 0, 0, 1, 0, 0, 0],     # (2, 1)
        [1, 0, 0, 1, 0, 0, 1, 0, 0],     # (0, 2): its step 1 and itself
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1]]).bool()
    assert torch.equal(visible, expected)
    assert depth.tolist() == [0, 1, 2, 1, 2, 3, 2, 3, 4]
    masked, _ = transfer_block(causal(3), torch.arange(3), 2, masked=True)
    assert torch.equal(masked[6:, 3:6], torch.zeros(3, 3, dtype=torch.bool))   # step 2 no longer sees step 1
    assert torch.equal(masked[:6], expected[:6]) and torch.equal(masked[6:, 6:], expected[6:, 6:])
    # a tree: root 0 with children 1, 2 — pseudo tokens of node 2 see the root and node 2, not node 1
    tree, tree_depth = transfer_block(torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]]).bool(), torch.tensor([0, 1, 1]),
                                      1)
    assert tree[5, :3].tolist() == [True, False, True] and tree_depth.tolist() == [0, 1, 1, 1, 2, 2]


def test_identity_maps_after_the_last_layer_give_the_anchors_logits():
    """t = L, W = I: a pseudo state is its anchor's final state, so its logits are the anchor's; the real tokens'
    logits are the plain forward's; with no plan the hooks change nothing."""
    model = random_model("llama", layers=2)
    ids, _ = random_prompts(1, [7], seed=2)
    with torch.no_grad():
        plain = model(ids).logits[0]
    t = HiddenTransfer(model.config.hidden_size, model.config.vocab_size, [2, 2]).init_from_base(model)
    logits = pseudo_logits(model, t, ids)
    torch.testing.assert_close(logits[0], plain, rtol=1e-5, atol=1e-5)
    for i in (1, 2):
        torch.testing.assert_close(logits[i], plain, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[0], plain, rtol=0, atol=0)


def test_pseudo_states_never_see_the_future():
    """Changing the tokens after position j changes no pseudo state anchored at <= j (nor real ones before)."""
    model = random_model("qwen2")
    t = transfer(model, layers=(0, 1, 2))
    ids, _ = random_prompts(1, [10], seed=5)
    changed = ids.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % model.config.vocab_size
    a, b = pseudo_logits(model, t, ids), pseudo_logits(model, t, changed)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_to_generate(models, arch):
    model = models[arch]
    t = transfer(model)
    accepted = 0
    for p, (length, new, tree) in enumerate([(3, 30, [2, 1, 1]), (10, 24, [3, 2, 1]), (6, 17, [[0], [1], [0, 0]])]):
        ids, mask = random_prompts(1, [length], seed=40 + p)
        ref = reference_greedy(model, ids, mask, new)
        out = generate(model, ids, "hidden_transfer", max_new_tokens=new, transfer=t, tree=tree)
        assert torch.equal(out.sequences, ref), p
        assert out.stats.new_tokens == new and out.stats.draft_forwards == 0   # drafts come from the same forward
        accepted += out.stats.accepted_tokens
    assert accepted > 0
    ids, mask = random_prompts(1, [5], seed=9)
    _, eos, ref = greedy_with_mid_output_eos(model, ids, mask, 30, not_before=3)
    out = generate(model, ids, "hidden_transfer", max_new_tokens=30, eos_token_id=eos, transfer=t)
    assert out.sequences[0, ids.size(1):].tolist()[: len(ref)] == ref
    # the hooks stay on the model and idle: plain AR is unchanged
    assert torch.equal(generate(model, ids, "ar", max_new_tokens=12).sequences, reference_greedy(model, ids, mask, 12))


def test_save_load_gives_the_same_decoder(models, tmp_path):
    model = models["mistral"]
    t = transfer(model, masked=True)
    save_heads(t, tmp_path / "ht", {"name_or_path": "random-mistral"})
    loaded, meta = load_heads(tmp_path / "ht")
    assert isinstance(loaded, HiddenTransfer) and loaded.layers == t.layers and loaded.masked
    assert meta == {"name_or_path": "random-mistral"}
    ids, _ = random_prompts(1, [6], seed=3)
    a = generate(model, ids, "hidden_transfer", max_new_tokens=25, transfer=t)
    b = generate(model, ids, "hidden_transfer", max_new_tokens=25, transfer=str(tmp_path / "ht"))
    assert torch.equal(a.sequences, b.sequences)
    assert a.stats.accepted_per_forward == b.stats.accepted_per_forward


def test_bad_input_is_a_config_error(models):
    model = models["llama"]
    c = model.config
    ids, _ = random_prompts(1, [4])
    for layers in ([], [2, 1], [-1]):
        with pytest.raises(ConfigError, match="transfer layers"):
            HiddenTransfer(c.hidden_size, c.vocab_size, layers)
    with pytest.raises(ConfigError, match="decoder layers"):
        HiddenTransfer(c.hidden_size, c.vocab_size, [1, c.num_hidden_layers + 1]).init_from_base(model)
    with pytest.raises(ConfigError, match="deep"):
        generate(model, ids, "hidden_transfer", transfer=transfer(model, layers=(1,)), tree=[2, 2])
    with pytest.raises(ConfigError, match="expected hidden_transfer"):
        from lit_spec.models.draft_heads import MedusaHeads

        generate(model, ids, "hidden_transfer", transfer=MedusaHeads(c.hidden_size, c.vocab_size))


# ---- training ---------------------------------------------------------------------------------------------------
def test_a_training_step_changes_the_maps_only(micro_config):
    module, datamodule = built_method(micro_config("method=hidden_transfer", "method.layers=[1,2]",
                                                   "method.tree=[2,1]"))
    loss, changed = heads_training_step(module, next(iter(datamodule.train_dataloader())))
    assert loss > 0 and all(changed)


@pytest.mark.slow      # end to end: train, export, resume
def test_micro_training_logs_steps_exports_and_decodes_the_same(micro_config):
    from pathlib import Path

    from lit_spec.config import build
    from lit_spec.training import run_training

    cfg = micro_config("method=hidden_transfer", "method.layers=[1,2]", "method.tree=[2,1]", "callbacks=speedup",
                       "callbacks.speedup.num_prompts=2", "callbacks.speedup.max_new_tokens=16", "method.lr=3e-3",
                       "callbacks.speedup.drift_data=null")
    metrics = run_training(cfg)
    for i in (1, 2):
        assert 0 <= metrics[f"val/step{i}/top1"] <= metrics[f"val/step{i}/top5"] <= 1
        assert math.isfinite(metrics[f"val/step{i}/cos_layer2"])        # a cosine: in [-1, 1] unless NaN
    assert "val/step1/cos_layer1" not in metrics          # before step 1's layer output nothing is compared
    assert metrics["exact_match/hidden_transfer"] == 1.0 and metrics["mean_accepted/hidden_transfer"] >= 1.0
    export = Path(cfg.export_dir)
    assert sorted(p.name for p in export.iterdir()) == ["heads.json", "heads.safetensors", MARK]
    spec = build(cfg.model)
    module = build(cfg.method, model_spec=spec)
    module.configure_model()
    loaded = load_heads(export)[0]
    module.heads.load_state_dict(loaded.state_dict())
    tokenizer = spec.load_tokenizer()
    ids = torch.tensor([tokenizer("def add(a, b):")["input_ids"]])
    a = module.decoders()["hidden_transfer"].generate(ids, 20)
    b = generate(module.model, ids, "hidden_transfer", max_new_tokens=20, transfer=str(export), tree=[2, 1])
    assert torch.equal(a.sequences, b.sequences)
