"""Chimera's draft and Medusa's heads (lit_spec.models.heads, decoding.heads, methods.heads): the full-context mask of
Fig. 3, no look at the future in training, training and decoding read the same states, lossless tree decoding on
three architectures, save -> load -> same decoder, the n-gram cache changes nothing, frozen base, clear errors."""

from __future__ import annotations

import pytest
import torch
from conftest import built_method, draft_step_on, heads_training_step, static_draft_layers
from random_models import ARCHS, greedy_with_mid_output_eos, random_model, random_prompts, reference_greedy

from lit_spec.decoding import generate
from lit_spec.decoding.draft_heads import ChimeraCandidates, ChimeraDecoder, MedusaCandidates, chimera_forward
from lit_spec.decoding.state import DecodeState
from lit_spec.errors import ConfigError
from lit_spec.export import MARK
from lit_spec.models.chimera import ChimeraDraft, NGramCache, full_context_mask, ngram_inputs
from lit_spec.models.draft_heads import DraftVocab, MedusaHeads
from lit_spec.models.saved_heads import load_heads, save_heads



def chimera(model, seed: int = 0, **kwargs) -> ChimeraDraft:
    """A draft with random (not identity-initialised) weights, so every part of it matters."""
    c = model.config
    torch.manual_seed(seed)
    draft = ChimeraDraft(c.hidden_size, c.vocab_size, attention_heads=4, **kwargs).init_from_base(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return draft.eval()


def medusa(model, seed: int = 0, **kwargs) -> MedusaHeads:
    c = model.config
    torch.manual_seed(seed)
    heads = MedusaHeads(c.hidden_size, c.vocab_size, **kwargs).init_from_base(model)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return heads.eval()


def test_full_context_mask_is_fig3():
    """Query row n (the n-gram of token n+1+k) sees base states 0..n and n-grams 0..n+1+k: an n-gram that holds a
    later token is masked; padding is never seen."""
    valid = torch.tensor([[True] * 5])
    o, x = True, False
    head0 = torch.tensor([[o, x, x, x, x, o, o, x, x, x],     # n=0: h_LLM_0 | tri_0, tri_1
                          [o, o, x, x, x, o, o, o, x, x],
                          [o, o, o, x, x, o, o, o, o, x]])
    head1 = torch.tensor([[o, x, x, x, x, o, o, o, x, x],     # n=0: h_LLM_0 | tri_0..tri_2 (token 2 drafted)
                          [o, o, x, x, x, o, o, o, o, x]])
    assert torch.equal(full_context_mask(valid, 0)[0], head0)
    assert torch.equal(full_context_mask(valid, 1)[0], head1)
    padded = full_context_mask(torch.tensor([[True, True, True, True, False]]), 0)[0]
    assert not padded[:, 4].any() and not padded[:, 9].any() and torch.equal(padded[:, :4], head0[:, :4])


def test_ngram_inputs_pad_the_start_with_zeros():
    embeds = torch.arange(1, 5, dtype=torch.float)[None, :, None]      # x_i = i + 1, d = 1
    assert ngram_inputs(embeds, 3)[0].tolist() == [[0, 0, 1], [0, 1, 2], [1, 2, 3], [2, 3, 4]]
    assert ngram_inputs(embeds, 1)[0].tolist() == [[1], [2], [3], [4]]


def _training_logits(draft, model, ids: torch.Tensor):
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        embeds = model.get_input_embeddings()(ids)
        inputs, full = draft.head_inputs(embeds, out.hidden_states[-1], torch.ones_like(ids, dtype=torch.bool))
        return [head(x) for head, x in zip(draft.heads, inputs)], full


def test_training_heads_never_see_what_decoding_cannot():
    """Head k at prefix end n may depend on tokens <= n+1+k only (the base's next token and the previous heads'
    guesses), and on base states <= n: changing any later token leaves its logits unchanged."""
    model = random_model("llama")
    draft = chimera(model)
    ids, _ = random_prompts(1, [12], seed=4)
    logits, _ = _training_logits(draft, model, ids)
    for k in range(draft.num_heads):
        n = 4
        changed = ids.clone()
        changed[0, n + 2 + k:] = (changed[0, n + 2 + k:] + 7) % 90 + 3          # everything after token n+1+k
        after, _ = _training_logits(draft, model, changed)
        torch.testing.assert_close(after[k][0, : n + 1], logits[k][0, : n + 1])
        changed = ids.clone()
        changed[0, n + 1 + k] = (changed[0, n + 1 + k] + 7) % 90 + 3             # token n+1+k itself matters
        after, _ = _training_logits(draft, model, changed)
        assert not torch.allclose(after[k][0, n], logits[k][0, n])


@pytest.mark.parametrize(("residual", "engine"), [(True, "eager"), (False, "eager"), (True, "static"),
                                                  (False, "padded")])
def test_decoding_drafts_what_training_predicts(residual, engine):
    """The decoder's candidates at every depth are the training-time head logits' top-k on the sequence prompt +
    the base's next token + the draft's own top-1 guesses (same states, same masks), on the eager cache and on the
    fast path's static one (``conftest.draft_step_on``), whose pad rows and drafted n-grams are rolled back."""
    model = random_model("qwen2")
    draft = chimera(model, residual=residual)
    ids, mask = random_prompts(1, [9], seed=6)
    state = DecodeState(model, ids, mask, 10, None, record_hidden=True)
    first = int(state.prefill()[0].argmax())
    state.commit([[first]], advance=[0])
    kv = None if engine == "eager" else static_draft_layers(draft, [draft.block])[0]
    candidates = ChimeraCandidates(draft, DraftVocab(draft), model.get_input_embeddings(), NGramCache(0),
                                   ids[0].tolist(), draft_step_on(chimera_forward, draft, engine), kv)
    top = candidates(state, draft.num_heads, 5)
    if engine == "padded":      # the 9 base states and 10 n-gram states ran as 32 rows
        assert set(candidates.step.compile_seconds) == {f"32/depth4/top5/v{draft.vocab_size}@256"}
    assert int(candidates.kv.get_seq_length()) == candidates.rows == 2 * ids.size(1) + 1
    # + the last depth's top-1 as well: training computes a head's logits where its label token exists
    sequence = torch.tensor([ids[0].tolist() + [first] + top[:, 0].tolist()])
    logits, _ = _training_logits(draft, model, sequence)
    n = ids.size(1) - 1
    for k in range(draft.num_heads):
        assert logits[k][0, n].topk(5).indices.tolist() == top[k].tolist(), k


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_to_generate(models, arch):
    model = models[arch]
    heads = {"chimera": chimera(model), "medusa": medusa(model)}
    for p, (length, new, tree) in enumerate([(3, 30, [3, 2, 1, 1]), (10, 24, [2, 2]), (6, 17, [[0], [1], [0, 0]])]):
        ids, mask = random_prompts(1, [length], seed=20 + p)
        ref = reference_greedy(model, ids, mask, new)
        for method in ("chimera", "medusa"):
            out = generate(model, ids, method, max_new_tokens=new, heads=heads[method], tree=tree)
            assert torch.equal(out.sequences, ref), (method, p)
            assert out.stats.new_tokens == new and out.stats.draft_forwards > 0
    # EOS inside an accepted path
    ids, mask = random_prompts(1, [5], seed=9)
    _, eos, ref = greedy_with_mid_output_eos(model, ids, mask, 30, not_before=3)
    for method in ("chimera", "medusa"):
        out = generate(model, ids, method, max_new_tokens=30, eos_token_id=eos, heads=heads[method])
        assert out.sequences[0, ids.size(1):].tolist()[: len(ref)] == ref


def test_typical_acceptance_through_the_heads_decoders(models):
    """temperature > 0 reaches the heads decoders' tree verification: seeded runs repeat; near temperature 0 the
    target's distributions are one-hot and typical acceptance gives the greedy output."""
    model = models["qwen2"]
    heads = {"chimera": chimera(model), "medusa": medusa(model)}
    ids, mask = random_prompts(1, [6], seed=31)
    ref = reference_greedy(model, ids, mask, 20)
    for method in ("chimera", "medusa"):
        def run(**kw):
            return generate(model, ids, method, max_new_tokens=20, heads=heads[method], **kw).sequences

        assert torch.equal(run(temperature=1.0, seed=4), run(temperature=1.0, seed=4)), method
        assert torch.equal(run(temperature=1e-4, seed=4), ref), method


def test_save_load_gives_the_same_decoder(models, tmp_path):
    model = models["mistral"]
    ids, _ = random_prompts(1, [7], seed=3)
    for heads in (chimera(model, ngram=2, num_heads=3), medusa(model)):
        before = generate(model, ids, heads.kind, max_new_tokens=25, heads=heads, tree=[2, 2, 1])
        save_heads(heads, tmp_path / heads.kind, base_model={"name_or_path": "random"})
        loaded, base = load_heads(tmp_path / heads.kind)
        assert type(loaded) is type(heads) and base == {"name_or_path": "random"}
        for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
            assert torch.equal(a, b), name
        after = generate(model, ids, heads.kind, max_new_tokens=25, heads=str(tmp_path / heads.kind), tree=[2, 2, 1])
        assert torch.equal(after.sequences, before.sequences)
        assert after.stats.target_forwards == before.stats.target_forwards
        assert sorted(p.name for p in (tmp_path / heads.kind).iterdir()) == ["heads.json", "heads.safetensors"]


def test_heads_sharing_the_lm_head_project_with_the_base_and_save_without_it(models, tmp_path):
    """shared_lm_head: each head's logits are the base's LM head of its own state; the LM head is neither a
    parameter nor saved; decoding stays lossless, and loaded heads bind the base's head again."""
    model = models["llama"]
    ids, mask = random_prompts(1, [6], seed=12)
    ref = reference_greedy(model, ids, mask, 24)
    for heads in (chimera(model, shared_lm_head=True), medusa(model, shared_lm_head=True)):
        head = heads.heads[1]
        x = torch.randn(3, getattr(head.proj, "in_features", heads.hidden_size))
        assert torch.equal(head(x), model.get_output_embeddings()(head.block(head.proj(x))))
        lm_head = model.get_output_embeddings().weight
        assert not any(p is lm_head for p in heads.parameters())
        assert not any(k.endswith(".out.weight") for k in heads.state_dict())
        out = generate(model, ids, heads.kind, max_new_tokens=24, heads=heads, tree=[2, 2, 1])
        assert torch.equal(out.sequences, ref) and out.stats.draft_forwards > 0
        save_heads(heads, tmp_path / heads.kind, base_model={"name_or_path": "random"})
        loaded, _ = load_heads(tmp_path / heads.kind)
        assert loaded.shared_lm_head
        with pytest.raises(RuntimeError, match="attach"):
            loaded.heads[0](x)
        again = generate(model, ids, heads.kind, max_new_tokens=24, heads=str(tmp_path / heads.kind), tree=[2, 2, 1])
        assert torch.equal(again.sequences, ref) and again.stats.target_forwards == out.stats.target_forwards


def _decode_state(model, seed: int) -> DecodeState:
    ids, mask = random_prompts(1, [7], seed=seed)
    state = DecodeState(model, ids, mask, 10, None, record_hidden=True)
    state.commit([[int(state.prefill()[0].argmax())]], advance=[0])
    return state


@pytest.mark.parametrize("shared", [False, True])
def test_draft_vocab_drafts_the_most_frequent_labels_only_and_stays_lossless(models, shared):
    """FR-Spec: with draft_vocab=N the heads' candidates are the top-k of their logits over the N tokens counted
    most often in training, nothing else; decoding still equals greedy decoding."""
    model = models["llama"]
    vocab = model.config.vocab_size
    for heads in (chimera(model, shared_lm_head=shared), medusa(model, shared_lm_head=shared)):
        torch.manual_seed(1)
        heads.count_tokens(torch.randint(0, vocab, (4 * vocab,)))
        subset = heads.token_counts.topk(12).indices
        outside = torch.ones(vocab, dtype=torch.bool)
        outside[subset] = False
        state = _decode_state(model, seed=5)
        if heads.kind == "medusa":
            full = heads(state.hidden[0, -1])[:3]
            top = MedusaCandidates(heads, DraftVocab(heads, 12))(state, 3, 4)
            assert torch.equal(top, full.masked_fill(outside, -torch.inf).topk(4).indices)
        else:
            top = ChimeraCandidates(heads, DraftVocab(heads, 12), model.get_input_embeddings(), NGramCache(0),
                                    state.prompt[0].tolist())(state, 3, 4)
        assert torch.isin(top, subset).all() and top.shape == (3, 4)
        for p, tree in enumerate([[3, 2, 1, 1], [[0], [1], [0, 0]]]):
            ids, mask = random_prompts(1, [6], seed=40 + p)
            ref = reference_greedy(model, ids, mask, 24)
            out = generate(model, ids, heads.kind, max_new_tokens=24, heads=heads, tree=tree, draft_vocab=12)
            assert torch.equal(out.sequences, ref), (heads.kind, p)


def test_draft_vocab_needs_counted_heads_and_room_for_the_tree(models, tmp_path):
    model = models["llama"]
    ids, _ = random_prompts(1, [4])
    with pytest.raises(ConfigError, match="token counts"):
        generate(model, ids, "medusa", heads=medusa(model), draft_vocab=8)
    with pytest.raises(ConfigError, match="draft_vocab"):
        generate(model, ids, "chimera", heads=chimera(model), tree=[3, 2], draft_vocab=2)
    heads = medusa(model)       # heads saved before token counts existed load with none
    save_heads(heads, tmp_path, base_model={"name_or_path": "random"})
    from safetensors.torch import load_file, save_file
    state = load_file(str(tmp_path / "heads.safetensors"))
    del state["token_counts"]
    save_file(state, str(tmp_path / "heads.safetensors"))
    assert not load_heads(tmp_path)[0].token_counts.any()


def test_ngram_cache_changes_nothing_but_the_work(models):
    model = models["llama"]
    draft = chimera(model)
    runs = {}
    for size in (0, 64):
        decoder = ChimeraDecoder(model, draft, ngram_cache=size)
        runs[size] = [decoder.generate(random_prompts(1, [n], seed=n)[0], 30) for n in (4, 8, 4)]
        runs[size].append(decoder.cache)
    for a, b in zip(runs[0][:3], runs[64][:3]):
        assert torch.equal(a.sequences, b.sequences)
        assert a.stats.target_forwards == b.stats.target_forwards
    cache = runs[64][3]
    assert cache.hits > 0 and len(cache.entries) <= 64      # the repeated prompt hits, the LRU stays bounded
    assert runs[0][3].hits == 0


def test_ngram_cache_follows_weight_changes(models):
    """A decoder kept while the draft trains (the speedup callback's) must not draft from states computed with older
    weights: an optimizer step or ``load_state_dict`` empties the cache, and it serves the new weights' states."""
    model = models["llama"]
    draft, embed = chimera(model), model.get_input_embeddings()
    grams = [(-1, 3, 5), (3, 5, 7), (5, 7, 9)]
    cache = NGramCache(64)
    before = cache.states(draft, embed, grams)
    assert torch.equal(cache.states(draft, embed, grams), before) and cache.hits == 3
    saved = {k: v.clone() for k, v in draft.state_dict().items()}

    optimizer = torch.optim.AdamW(draft.ngram_encoder.parameters(), lr=1e-2)
    draft.ngram_encoder(torch.randn(4, 3 * model.config.hidden_size)).square().sum().backward()
    optimizer.step()
    after = cache.states(draft, embed, grams)
    assert not torch.allclose(after, before)
    assert torch.equal(after, NGramCache(0).states(draft, embed, grams))

    draft.load_state_dict(saved)
    assert torch.equal(cache.states(draft, embed, grams), before)


def test_bad_input_is_a_config_error(models, tmp_path):
    model = models["llama"]
    ids, _ = random_prompts(1, [4])
    with pytest.raises(ConfigError, match="depth"):
        generate(model, ids, "chimera", heads=chimera(model, num_heads=2), tree=[2, 2, 2])
    with pytest.raises(ConfigError, match="no draft heads"):
        generate(model, ids, "medusa", heads=str(tmp_path))
    with pytest.raises(ConfigError, match="expected medusa"):
        generate(model, ids, "medusa", heads=chimera(model))
    with pytest.raises(ConfigError, match="ngram_cache"):
        generate(model, ids, "chimera", heads=chimera(model), ngram_cache=-1)
    with pytest.raises(ConfigError, match="ngram"):
        ChimeraDraft(64, 96, ngram=0)
    with pytest.raises(ConfigError, match="LM head"):
        MedusaHeads(32, 96).init_from_base(model)


# ---- training ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shared", [False, True])
def test_a_training_step_changes_the_heads_only(micro_config, shared):
    module, datamodule = built_method(micro_config("method=chimera", f"method.shared_lm_head={shared}"))
    _, changed = heads_training_step(module, next(iter(datamodule.train_dataloader())))
    assert any(changed)
    own = [k for k in module.heads.state_dict() if k.endswith(".out.weight")]
    assert len(own) == (0 if shared else module.heads.num_heads)
    batch = next(iter(datamodule.train_dataloader()))     # the same first batch: its first head's labels were counted
    assert module.heads.token_counts.sum() == (batch["labels"][:, 2:] != -100).sum() > 0


def test_a_batch_without_answer_tokens_gives_a_zero_loss(micro_config):
    """Every label masked (e.g. answers too short for any head): a zero loss that backpropagates zero gradients,
    instead of a loss without a graph that would stop training (or leave a DDP rank out of the all-reduce)."""
    module, datamodule = built_method(micro_config("method=medusa"))
    batch = next(iter(datamodule.train_dataloader()))
    batch["labels"].fill_(-100)
    loss = module.training_step(batch, 0)
    loss.backward()
    assert loss.item() == 0
    assert all(p.grad is not None and not p.grad.any() for p in module.heads.parameters())


@pytest.mark.slow      # end to end: train, export, resume
@pytest.mark.parametrize("method", ["chimera", "medusa"])
def test_train_logs_head_accuracy_exports_the_heads_and_resumes(micro_config, tmp_path, method):
    """A micro run: per-head top-k accuracy and the speedup callback's numbers are logged; the export holds only the
    heads, which decode exactly like the trained module; the heads-only checkpoint resumes."""
    import csv
    from pathlib import Path

    from lit_spec.config import build
    from lit_spec.training import run_training

    common = [f"method={method}", "callbacks=speedup", "callbacks.speedup.num_prompts=2", "callbacks.speedup.drift_data=null",
              "callbacks.speedup.max_new_tokens=16", "method.lr=3e-3", "trainer.log_every_n_steps=1",
              "callbacks.model_checkpoint.every_n_train_steps=4"]
    cfg = micro_config(*common, output_dir=tmp_path / "a")
    metrics = run_training(cfg)
    for k in range(4):
        assert 0 <= metrics[f"val/head{k}/top1"] <= metrics[f"val/head{k}/top5"] <= 1
    assert metrics[f"exact_match/{method}"] == 1.0 and metrics[f"mean_accepted/{method}"] >= 1.0
    assert ("val/distill" in metrics) == (method == "chimera")
    export = Path(cfg.export_dir)
    # Medusa's heads also in vLLM's layout (tests/test_vllm_export.py); no engine serves Chimera's draft
    assert sorted(p.name for p in export.iterdir()) == ["heads.json", "heads.safetensors", MARK, *(
        ["vllm"] if method == "medusa" else [])]

    last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=True, map_location="cpu")["state_dict"]
    assert state and all(k.startswith("heads.") for k in state)          # the frozen base is not checkpointed
    spec = build(cfg.model)
    module = build(cfg.method, model_spec=spec)
    module.configure_model()
    module.load_state_dict(state, strict=False)
    model = module.model
    ids = torch.tensor([datamodule_prompt(cfg, spec)])
    trained = module.decoders()[method].generate(ids, 20)
    loaded = generate(model, ids, method, max_new_tokens=20, heads=str(export), tree=list(cfg.method.tree))
    assert torch.equal(trained.sequences, loaded.sequences)
    assert trained.stats.target_forwards == loaded.stats.target_forwards

    resumed = micro_config(*common, "trainer.max_steps=10", f"ckpt_path={last}", output_dir=tmp_path / "b")
    assert run_training(resumed)["global_step"] == 10
    with open(Path(resumed.paths.output_dir) / "csv" / "metrics.csv") as f:
        assert len([r for r in csv.DictReader(f) if r.get("train/loss")]) == 2


def datamodule_prompt(cfg, spec) -> list[int]:
    from lit_spec.config import build

    datamodule = build(cfg.data, tokenizer=spec.load_tokenizer())
    return datamodule.eval_records("validation", 1)[0]["prompt_ids"]


def test_method_settings_are_checked(micro_config):
    from lit_spec.config import build

    for override, name in [("method.labels=gold", "labels"), ("method.tree=[2,2,2,2,2]", "tree"),
                           ("method.num_heads=0", "num_heads")]:
        cfg = micro_config("method=chimera", override)
        with pytest.raises(ConfigError, match=name):
            build(cfg.method, model_spec=build(cfg.model))
