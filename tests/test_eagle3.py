"""EAGLE-3 (lit_spec.models.eagle3, decoding.eagle3, methods.eagle3): the draft vocabulary right by construction, no
look at the future in the training-time test, training and decoding read the same states, lossless chain / static /
dynamic trees on three architectures, save -> load -> same decoder in the authors' layout, the draft vocabulary
counted from the training answers, clear errors."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from conftest import built_method, draft_step_on, heads_training_step, static_draft_layers
from random_models import ARCHS, check_drafting_decoder, random_model, random_prompts, reference_greedy

from lit_spec.decoding import generate
from lit_spec.decoding.cache import GrowingLayer
from lit_spec.decoding.eagle3 import Eagle3Decoder, Eagle3Drafter, Node, draft_forward, dynamic_tree
from lit_spec.decoding.state import DecodeState
from lit_spec.errors import ConfigError
from lit_spec.models.eagle3 import Eagle3Draft, shifted
from lit_spec.models.saved_heads import load_heads, save_heads

EAGLE3 = ["method=eagle3", "method.draft_vocab_size=128", "method.steps=3",
          "method.decoder={tree: dynamic, depth: 3, top_k: 2, total_tokens: 4}"]
TREES = ([1, 1, 1, 1], [3, 2, 1], [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], "dynamic")


def eagle3(model, seed: int = 0, vocab: int = 64) -> Eagle3Draft:
    """A draft over ``vocab`` tokens of a random ranking, with random (not base-initialised) weights."""
    torch.manual_seed(seed)
    draft = Eagle3Draft.for_target(model.config, vocab)
    draft.init_from_base(model, torch.randint(0, 100, (model.config.vocab_size,)))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return draft.eval()


def test_the_draft_vocabulary_is_one_sorted_id_list():
    """``d2t`` and ``t2d`` both come from the N most frequent ids (ties: the lower id), in id order; a damaged
    mapping is refused."""
    model = random_model("llama")
    draft = eagle3(model, vocab=4)
    counts = torch.zeros(model.config.vocab_size, dtype=torch.long)
    counts[[50, 7, 30, 90, 8]] = torch.tensor([5, 9, 5, 1, 5])     # 7 first; 8, 30, 50 tie: the lower ids win
    assert draft.set_vocab(counts) == pytest.approx(24 / 25)
    assert draft.draft_ids.tolist() == [7, 8, 30, 50]
    assert draft.d2t.tolist() == [7, 7, 28, 47] and draft.t2d.nonzero().flatten().tolist() == [7, 8, 30, 50]
    draft.check_vocab()
    draft.d2t[2] += 1                                           # 31: t2d says 30
    with pytest.raises(ConfigError, match="d2t and t2d"):
        draft.check_vocab()


def _steps(draft, model, ids: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
    with torch.no_grad():
        features = draft.features(model(ids, output_hidden_states=True).hidden_states)
        return draft(ids, features, torch.ones_like(ids, dtype=torch.bool), steps)


def test_the_training_time_test_never_sees_what_decoding_cannot():
    """Step i of row n reads tokens <= n+1+i (the drafted ones) and target features <= n: changing any later token
    leaves its state unchanged; changing token n+1+i changes it."""
    model = random_model("llama")
    draft = eagle3(model)
    ids, _ = random_prompts(1, [12], seed=4)
    states, n = _steps(draft, model, ids), 4
    for i, state in enumerate(states):
        changed = ids.clone()
        changed[0, n + 2 + i:] = (changed[0, n + 2 + i:] + 7) % 90 + 3
        torch.testing.assert_close(_steps(draft, model, changed)[i][0, : n + 1], state[0, : n + 1])
        changed = ids.clone()
        changed[0, n + 1 + i] = (changed[0, n + 1 + i] + 7) % 90 + 3
        assert not torch.allclose(_steps(draft, model, changed)[i][0, n], state[0, n])


def drafter_on(draft: Eagle3Draft, prompt: list[int], engine: str, k: int) -> Eagle3Drafter:
    """A drafter on ``engine``'s cache (``conftest.draft_step_on``): eager's grows, the others' is static."""
    cache = GrowingLayer() if engine == "eager" else static_draft_layers(draft, [draft.midlayer.self_attn])[0]
    return Eagle3Drafter(draft, prompt, draft_step_on(draft_forward, draft, engine), cache, k)


@pytest.mark.parametrize(("arch", "engine"), [("llama", "eager"), ("qwen2", "eager"), ("llama", "static"),
                                              ("qwen2", "padded")])
def test_decoding_drafts_what_training_predicts(models, arch, engine):
    """The chain's drafts at every depth are the training-time test's top-k on the sequence prompt + the target's
    next token + the draft's own top-1 guesses (same features, keys and positions), on the eager cache and on the
    fast path's static one, whose padded rows change nothing."""
    model = models[arch]
    draft = eagle3(model)
    ids, mask = random_prompts(1, [9], seed=6)
    state = DecodeState(model, ids, mask, 10, None, record_hidden=tuple(draft.layers))
    first = int(state.prefill()[0].argmax())
    state.commit([[first]], advance=[0])
    drafter = drafter_on(draft, ids[0].tolist(), engine, k=5)
    node = Node((), first, 0.0, None)
    node.state, _, top = drafter.root(state)
    drafted = []
    for depth in range(1, 4):
        drafted.append(top)
        node = Node(node.path + (0,), int(top[0]), 0.0, node)
        if depth < 3:
            top = drafter.expand([node], depth)[1][0]
    if engine == "padded":        # the root's 9 rows ran as 16, each expansion's 1 as 1
        assert set(drafter.step.compile_seconds) == {"root16/top5@256", "expand1/top5@256"}
    # the prompt's rows and the two drafted ones: the pad rows were rolled back
    assert drafter.length == ids.size(1) and int(drafter.kv.get_seq_length()) == drafter.length + 2
    sequence = torch.tensor([ids[0].tolist() + [first] + [int(t[0]) for t in drafted]])
    states, n = _steps(draft, model, sequence), ids.size(1) - 1
    for i, state in enumerate(states):
        assert draft.draft_ids[draft.logits(state[0, n]).topk(5).indices].tolist() == drafted[i].tolist(), i


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_to_generate(models, arch):
    model = models[arch]
    check_drafting_decoder(model, "eagle3", TREES, heads=eagle3(model), depth=4, top_k=3, total_tokens=8)


def test_the_dynamic_tree_keeps_its_best_nodes_prefix_closed(models):
    """EAGLE-2's selection: ``total`` nodes, best cumulative log-probability first, every node's parent among them,
    no deeper than ``depth``; one draft forward for the root and one per deeper level."""
    model = models["llama"]
    draft = eagle3(model)
    ids, mask = random_prompts(1, [7], seed=3)
    state = DecodeState(model, ids, mask, 10, None, record_hidden=tuple(draft.layers))
    state.commit([[int(state.prefill()[0].argmax())]], advance=[0])
    drafter = drafter_on(draft, ids[0].tolist(), "padded", k=3)
    pending = Node((), int(state.pending[0]), 0.0, None)
    pending.state, *top = drafter.root(state)
    nodes = dynamic_tree(drafter, pending, top, depth=4, top_k=3, total=10)
    paths = {n.path for n in nodes}
    assert len(nodes) == 10 and all(n.path[:-1] in paths for n in nodes if len(n.path) > 1)
    assert [n.score for n in nodes] == sorted((n.score for n in nodes), reverse=True)
    assert max(len(p) for p in paths) <= 4 and drafter.forwards == 1 + 3


def test_typical_acceptance_through_the_eagle3_decoder(models):
    model = models["qwen2"]
    draft = eagle3(model)
    ids, mask = random_prompts(1, [6], seed=31)
    ref = reference_greedy(model, ids, mask, 20)

    def run(**kw):
        return generate(model, ids, "eagle3", max_new_tokens=20, heads=draft, depth=3, top_k=2, total_tokens=5,
                        **kw).sequences

    assert torch.equal(run(temperature=1.0, seed=4), run(temperature=1.0, seed=4))
    assert torch.equal(run(temperature=1e-4, seed=4), ref)


def test_save_load_gives_the_same_decoder_in_the_authors_layout(models, tmp_path):
    """The export holds ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` (the names vLLM's
    LlamaForCausalLMEagle3 loads), never the target's embedding; loaded, it decodes the same."""
    model = models["mistral"]
    draft = eagle3(model)
    ids, _ = random_prompts(1, [7], seed=3)
    before = generate(model, ids, "eagle3", max_new_tokens=25, heads=draft, depth=4, top_k=3, total_tokens=8)
    save_heads(draft, tmp_path, base_model={"name_or_path": "random"})
    loaded, _ = load_heads(tmp_path)
    h = model.config.hidden_size
    shapes = {k: tuple(v.shape) for k, v in loaded.state_dict().items()}
    assert {k.split(".")[0] for k in shapes} == {"fc", "midlayer", "norm", "lm_head", "d2t", "t2d"}
    assert shapes["fc.weight"] == (h, 3 * h) and shapes["midlayer.self_attn.q_proj.weight"][1] == 2 * h
    assert shapes["lm_head.weight"] == (64, h) and shapes["t2d"] == (model.config.vocab_size,)
    after = generate(model, ids, "eagle3", max_new_tokens=25, heads=str(tmp_path), depth=4, top_k=3, total_tokens=8)
    assert torch.equal(after.sequences, before.sequences)
    assert after.stats.target_forwards == before.stats.target_forwards


def test_a_training_step_trains_the_draft_only_and_logs_each_steps_acceptance(micro_config):
    module, datamodule = built_method(micro_config(*EAGLE3))
    logged = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, float(value))
    loss, changed = heads_training_step(module, next(iter(datamodule.train_dataloader())))
    names = list(module.heads.state_dict())
    assert loss > 0 and all(c for n, c in zip(names, changed) if n not in ("d2t", "t2d"))
    assert {f"train/step{i}/{k}" for i in range(3) for k in ("loss", "acc")} <= logged.keys()
    acc = [logged[f"train/step{i}/acc"] for i in range(3)]
    expected = 1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2]
    assert logged["train/expected_tau"] == pytest.approx(expected)


def test_the_draft_vocabulary_comes_from_the_training_answers(micro_config):
    """Under a trainer the draft keeps the answers' most frequent tokens, before the first step."""
    module, datamodule = built_method(micro_config(*EAGLE3))
    fresh = type(module)(**module.hparams)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(fresh, datamodule=datamodule)
    counts = datamodule.answer_token_counts(fresh.heads.vocab_size)
    top = torch.sort(-counts, stable=True).indices[:128].sort().values
    assert fresh.heads.draft_ids.tolist() == top.tolist() and not torch.equal(top, torch.arange(128))


@pytest.mark.parametrize("overrides, match", [
    (["method.draft_vocab_size=100000"], "exceeds the target's vocabulary"),
    (["method.layers=[0,1,9]"], "hidden_states indices run 0..2"),
    (["method.step_weight=0"], "step_weight"),
    (["method.layers=[2,0,1]"], "ascending order \\(\\[0, 1, 2\\]\\)"),
])
def test_bad_settings_are_refused_before_work(micro_config, overrides, match):
    with pytest.raises(ConfigError, match=match):
        built_method(micro_config(*EAGLE3, *overrides))


def test_bad_decoder_settings_are_refused(models):
    model = models["llama"]
    with pytest.raises(ConfigError, match="tree='bushy'"):
        Eagle3Decoder(model, eagle3(model), tree="bushy")
    with pytest.raises(ConfigError, match="top_k=65 exceeds"):
        Eagle3Decoder(model, eagle3(model), top_k=65)
    with pytest.raises(ConfigError, match="trained for hidden size 64"):
        Eagle3Decoder(random_model("llama", hidden=32), eagle3(model))


def test_shifted_moves_left_and_pads():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shifted(x, 1).tolist() == [[2, 3, 4, 0]] and shifted(x, 5).tolist() == [[0, 0, 0, 0]]


def test_cached_states_of_other_layers_are_refused(models):
    """``data.base_states`` must hold the draft's feature layers and the last (what its loss reads), in that order."""
    from lit_spec.data.base_states import BaseStates
    from lit_spec.methods.frozen_base import check_cached_states

    draft = eagle3(models["llama"])
    check_cached_states(None, draft.layers, 2, "eagle3")
    check_cached_states(BaseStates(layers=[*draft.layers, 2]), draft.layers, 2, "eagle3")
    for layers in (None, draft.layers, [2, *draft.layers]):
        with pytest.raises(ConfigError, match=r"set data.base_states.layers=\[0, 1, 2, 2\]"):
            check_cached_states(BaseStates(layers=layers), draft.layers, 2, "eagle3")


def test_cached_base_states_train_the_fusion_layer_too(micro_config):
    """With ``data.base_states`` a batch carries the target's states instead of a forward; the draft's ``fc`` still
    gets its gradient (it once ran under the target's no_grad there and never trained)."""
    module, datamodule = built_method(micro_config(*EAGLE3))
    batch = next(iter(datamodule.train_dataloader()))
    with torch.no_grad():
        hidden = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              output_hidden_states=True).hidden_states
    layers = [*module.heads.layers, len(hidden) - 1]
    batch = {**batch, "base_hidden": torch.cat([hidden[i] for i in layers], dim=-1)}
    module.log = lambda *args, **kwargs: None
    _, changed = heads_training_step(module, batch)
    assert dict(zip(module.heads.state_dict(), changed))["fc.weight"]
