"""DFlash (lit_spec.models.dflash, decoding.dflash): the feature layers by z-lab's rule, the block drafted in one
forward from cached context keys and values equal to the draft over the whole context at once, lossless chains and
trees on three architectures, save -> load -> the same decoder, clear errors."""

from __future__ import annotations

import pytest
import torch
from conftest import built_method, draft_step_on, heads_training_step, static_draft_layers
from random_models import ARCHS, check_drafting_decoder, random_model, random_prompts, reference_greedy

from lit_spec.decoding import generate
from lit_spec.decoding.dflash import DFlashCandidates, draft_forward
from lit_spec.decoding.state import DecodeState
from lit_spec.errors import ConfigError
from lit_spec.methods.dflash import anchors_of, block_mask
from lit_spec.models.dflash import DFlashDraft, target_layer_ids
from lit_spec.models.saved_heads import load_heads, save_heads

TREES = (None, [2, 1, 1], [[0], [1], [0, 0], [0, 0, 0]])     # None: the block's chain
DFLASH = ["method=dflash", "method.num_layers=1", "method.layers=[0]", "method.block_size=4", "method.gamma=2",
          "method.max_anchors=6"]


def dflash(model, seed: int = 0, block_size: int = 5, num_layers: int = 2) -> DFlashDraft:
    """A draft reading the first layer's output (the test models have two), random weights."""
    torch.manual_seed(seed)
    draft = DFlashDraft.for_target(model.config, num_layers, block_size, layer_ids=[0, 0][:num_layers])
    draft.init_from_base(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return draft.eval()


def test_feature_layers_follow_z_labs_rule():
    """Evenly from layer 1 to n - 3 (Qwen3-8B: 36 layers, 5 draft layers -> 1, 9, 17, 25, 33, SpecForge's
    qwen3-8b-dflash.json); one draft layer reads the middle; the features are ``hidden_states`` indices one above the layer ids."""
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert target_layer_ids(30, 1) == [15] and target_layer_ids(30, 2) == [1, 27]
    # a target too small for the rule: never its last layer
    assert target_layer_ids(2, 5) == [0] * 5 and target_layer_ids(3, 2) == [1, 1] and target_layer_ids(2, 1) == [0]
    draft = DFlashDraft.for_target(random_model("llama", layers=8).config, 3, 16)
    assert draft.target_layer_ids == [1, 3, 5] and draft.hidden_states == (2, 4, 6)


@pytest.fixture(scope="module")
def models():
    return {arch: random_model(arch) for arch in ARCHS}


@pytest.mark.parametrize("engine", ["eager", "static", "padded"])
def test_a_block_from_cached_context_is_the_draft_over_the_whole_context(models, engine):
    """The decoder's drafter appends each forward's features to every layer's context keys and values (eager, or on
    the fast path's static layers, its context and block padded: ``conftest.draft_step_on``); its block predictions
    equal one draft forward over the whole context computed at once."""
    model = models["llama"]
    draft = dflash(model)
    ids, mask = random_prompts(1, [9], seed=4)
    state = DecodeState(model, ids, mask, 8, None, record_hidden=draft.hidden_states)
    state.commit([[int(state.prefill()[0].argmax(-1))]], advance=[0])
    caches = None if engine == "eager" else static_draft_layers(draft, draft.layers)
    drafter = DFlashCandidates(draft, draft_step_on(draft_forward, draft, engine), caches, 2)
    top = drafter(state, 4, 2)
    if engine == "padded":        # the prompt's 9 context rows ran as 16, the block's 5 as 8; the pad rows rolled back
        assert set(drafter.step.compile_seconds) == {"16+8/top2@256"}
        assert all(int(cache.get_seq_length()) == ids.size(1) for cache in caches)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i] for i in draft.hidden_states], dim=-1)
    positions = torch.arange(ids.size(1))[None]
    block = torch.tensor([[int(state.pending[0]), -1, -1, -1, -1]])
    states = draft(block, positions[:, -1:] + 1 + torch.arange(5), draft.context(features, positions), None)
    assert torch.equal(draft.logits(states[0, 1:]).topk(2, dim=-1).indices, top)
    assert drafter.length == ids.size(1)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_to_generate(models, arch):
    model = models[arch]
    check_drafting_decoder(model, "dflash", TREES, heads=dflash(model))


def test_save_load_gives_the_same_decoder(models, tmp_path):
    model = models["qwen2"]
    draft = dflash(model, seed=3)
    ids, _ = random_prompts(1, [6], seed=2)
    before = generate(model, ids, "dflash", max_new_tokens=20, heads=draft)
    save_heads(draft, tmp_path, {"name": "test"})
    loaded, _ = load_heads(tmp_path)
    assert isinstance(loaded, DFlashDraft) and loaded.config == draft.config
    after = generate(model, ids, "dflash", max_new_tokens=20, heads=str(tmp_path))
    assert torch.equal(before.sequences, after.sequences)
    assert before.stats.accepted_tokens == after.stats.accepted_tokens      # the same drafts, not just the output


def test_bad_settings_are_config_errors(models):
    model = models["llama"]
    with pytest.raises(ConfigError, match="target_layer_ids=\\[1\\]: the target has 2 layers"):
        DFlashDraft.for_target(model.config, 1, 4, layer_ids=[1]).attach(model)
    with pytest.raises(ConfigError, match="block_size"):
        DFlashDraft.for_target(model.config, 1, 1, layer_ids=[0])
    with pytest.raises(ConfigError, match="a block of 5 drafts at most 4 tokens"):
        generate(model, random_prompts(1, [4])[0], "dflash", max_new_tokens=4, heads=dflash(model), tree=[1] * 5)
    partial = random_model("llama").config
    partial.partial_rotary_factor = 0.5
    with pytest.raises(ConfigError, match="partial rotary"):
        DFlashDraft.for_target(partial, 1, 4)


def test_anchors_open_blocks_that_see_only_the_context_before_them_and_themselves():
    """Anchors sit where the next token is an answer token; a block's queries see the valid context strictly before
    its anchor and their own block in both directions, no other block; a padding block only itself."""
    answer = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    valid = torch.tensor([[1] * 8, [1] * 5 + [0] * 3], dtype=torch.bool)
    anchors, real = anchors_of(answer, valid, 4)
    picked = [sorted(a for a, r in zip(row.tolist(), ok.tolist()) if r) for row, ok in zip(anchors, real)]
    assert picked == [[2, 3, 4], [1, 2]]              # a >= 1 and token a + 1 an answer token
    mask = block_mask(anchors, real, valid, 3)[:, 0]  # [B, Q, T + Q]
    for b in range(2):
        for j, (a, r) in enumerate(zip(anchors[b].tolist(), real[b].tolist())):
            for slot in range(3):
                row = mask[b, 3 * j + slot]
                context = [t for t in range(8) if row[t]]
                assert context == ([t for t in range(a) if valid[b, t]] if r else [])
                assert [q for q in range(len(anchors[b]) * 3) if row[8 + q]] == [3 * j, 3 * j + 1, 3 * j + 2]


def test_a_training_step_trains_the_draft_only_and_logs_each_slots_acceptance(micro_config):
    module, datamodule = built_method(micro_config(*DFLASH))
    logged = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, float(value))
    loss, changed = heads_training_step(module, next(iter(datamodule.train_dataloader())))
    assert loss > 0 and all(changed), [n for n, c in zip(module.heads.state_dict(), changed) if not c]
    acc = [logged[f"train/slot{k}/acc"] for k in (1, 2, 3)]
    assert logged["train/expected_tau"] == pytest.approx(1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2])


def test_training_lifts_acceptance_and_the_decoder_stays_lossless(micro_config):
    """80 steps on one batch: the draft learns the target's next tokens (slot 1 accuracy rises), and the decoder
    built from the module, trained or not, stays token-identical to the target's greedy decode."""
    module, datamodule = built_method(micro_config(*DFLASH))
    batch = next(iter(datamodule.train_dataloader()))
    logged = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, float(value))
    optimizer = torch.optim.AdamW(module.heads.parameters(), lr=1e-2)
    first = None
    for _ in range(80):
        loss = module.training_step(batch, 0)
        first = logged["train/slot1/acc"] if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert logged["train/slot1/acc"] > first + 0.25
    module.eval()
    ids = batch["input_ids"][:1, :12]
    ref = reference_greedy(module.model, ids, torch.ones_like(ids), 16)
    assert torch.equal(module.decoders()["dflash"].generate(ids, 16).sequences, ref)


@pytest.mark.parametrize("overrides, match", [
    (["method.layers=[1]"], "target_layer_ids=\\[1\\]: the target has 2 layers"),
    (["method.gamma=0"], "gamma"),
    (["method.block_size=1"], "block_size"),
])
def test_bad_method_settings_are_refused_before_work(micro_config, overrides, match):
    with pytest.raises(ConfigError, match=match):
        built_method(micro_config(*DFLASH, *overrides))
