"""Ouroboros (Zhao et al. 2024): token-identical to ``model.generate`` on three architectures for many settings, with
K phrase branches, a warm pool and EOS inside accepted phrases; the verification block of Fig. 3 gives every branch
exactly its own context; both caches hold the committed prefix; the phrase pool's LRU, capacity and persistence; the
harvesting rules of §3.3; each ablation switch changes only its component; clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from hand_models import bigram_model
from random_models import (ARCHS, assert_same_cache, check_cache_after_each_commit, greedy_with_mid_output_eos,
                           noisy_copy, random_model, random_prompts, reference_greedy, tokens_until_eos)

from lit_spec.decoding import DECODERS, generate
from lit_spec.decoding.draft import DraftRunner
from lit_spec.decoding.ouroboros import OuroborosDecoder, matched_segments, verification_block
from lit_spec.decoding.phrases import PhrasePool
from lit_spec.decoding.state import DecodeState
from lit_spec.errors import ConfigError



def cycle(period: int, first: int = 3):
    return lambda t: first + (t - first + 1) % period if first <= t < first + period else first


def ouroboros(target, draft, **params) -> OuroborosDecoder:
    return DECODERS["ouroboros"](target, draft_model=draft, **params)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_to_generate(models, arch):
    """Independent, noisy and identical drafts; gamma, W, N, G, K varied; one decoder per setting decodes every
    prompt in turn, so later prompts start from a warm pool."""
    target = models[arch]
    drafts = {"noisy": noisy_copy(target, 0.02), "independent": random_model(arch, seed=7, layers=1, hidden=32),
              "self": target}
    settings = [dict(gamma=1, window=2, ngram=2, guesses=1, phrases=1), dict(gamma=4, window=3, ngram=3, phrases=3),
                dict(gamma=6, window=4, ngram=5, guesses=2, phrases=2, pool_capacity=3)]
    prompts = [random_prompts(1, [n], seed=60 + 10 * ARCHS.index(arch) + i) for i, n in enumerate([5, 10])]
    refs = [reference_greedy(target, ids, mask, new) for (ids, mask), new in zip(prompts, [26, 19])]
    from_phrases = 0
    for kind, draft in drafts.items():
        for params in settings if kind == "noisy" else settings[1:2]:
            decoder = ouroboros(target, draft, **params)
            for (ids, _), ref in zip(prompts, refs):
                out = decoder.generate(ids, max_new_tokens=ref.size(1) - ids.size(1))
                assert torch.equal(out.sequences, ref), (kind, params)
                s = out.stats
                assert s.new_tokens == s.row_forwards + s.accepted_tokens and s.accepted_tokens <= s.drafted_tokens
                assert s.draft_forwards > 0 and out.extras["pool_size"] == len(decoder.pool) > 0
                from_phrases += out.extras["phrase_tokens"]
            if kind == "self":     # the draft is the target: every round but the last commits gamma drafts + 1
                assert min(s.accepted_per_forward[1:-1]) >= params["gamma"] + 1
    assert from_phrases > 0        # lengthening phrases were accepted somewhere


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_inside_an_accepted_draft_or_phrase(models, arch):
    target = models[arch]
    ids, mask = random_prompts(1, [6], seed=70 + ARCHS.index(arch))
    _, eos, ref = greedy_with_mid_output_eos(target, ids, mask, 40, not_before=7)
    for draft in (target, noisy_copy(target, 0.02)):
        out = generate(target, ids, "ouroboros", max_new_tokens=40, eos_token_id=eos, draft_model=draft, gamma=3,
                       window=3, ngram=4, phrases=2)
        assert tokens_until_eos(out.sequences[0], ids.size(1), eos) == ref

    # a 9-token cycle, target = draft: a warm pool holds the cycle's phrases, so rounds commit draft + whole phrases
    model = bigram_model(cycle(9), arch=arch)
    ids = torch.tensor([[1, 20, 3]])
    decoder = ouroboros(model, model, gamma=2, window=2, ngram=4, guesses=2, phrases=2)
    decoder.generate(ids, max_new_tokens=30)                     # warms the pool
    full = decoder.generate(ids, max_new_tokens=30)
    assert tokens_until_eos(full.sequences[0], 3, None) == reference_greedy(model, ids, torch.ones_like(ids), 30)[
        0, 3:].tolist()
    # a round commits the draft (gamma or more: the draft's own lookahead accepts phrases), a whole phrase and one
    assert full.extras["phrase_tokens"] > 0 and max(full.stats.accepted_per_forward) >= 2 + 3 + 1
    # the second round drafts 5 6 7 8 and lengthens it with the phrase 9 10 11: EOS = 10 falls inside the phrase
    out = decoder.generate(ids, max_new_tokens=30, eos_token_id=10)
    assert tokens_until_eos(out.sequences[0], 3, 10) == [4, 5, 6, 7, 8, 9, 10]
    assert out.stats.accepted_per_forward == [1, 6] and out.extras["phrase_tokens"] == 2


def test_verification_block_of_k_branches():
    """Fig. 3 on a small case: [pending, d1, d2, phrase a (3 tokens), phrase b (2 tokens)]."""
    parents, visible, depth = verification_block(2, (3, 2))
    assert parents == [-1, 0, 1, 2, 3, 4, 2, 6]
    assert depth.tolist() == [0, 1, 2, 3, 4, 5, 3, 4]        # the branches share positions after d2
    sees = {i: set(visible[i].nonzero().flatten().tolist()) for i in range(len(parents))}
    assert sees[2] == {0, 1, 2}
    assert sees[5] == {0, 1, 2, 3, 4, 5} and sees[7] == {0, 1, 2, 6, 7}   # a branch never sees the other one
    assert verification_block(0, (2,))[0] == [-1, 0, 1]                    # no draft: phrases of the pending token


@pytest.mark.parametrize("arch", ARCHS)
def test_one_forward_gives_every_branch_its_own_context(models, arch):
    model = models[arch]
    ids, _ = random_prompts(1, [6], seed=80 + ARCHS.index(arch))
    state = DecodeState(model, ids, None, 16, None)
    state.commit([[int(state.prefill()[0].argmax(-1))]], advance=[0])
    parents, visible, depth = verification_block(3, (2, 3, 1))
    tokens = state.out[0] + torch.randint(3, 96, (len(parents) - 1,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = state.forward(torch.tensor([tokens]), visible, depth)[0]
    for i in range(len(parents)):
        chain, node = [], i
        while node >= 0:
            chain.append(tokens[node])
            node = parents[node]
        plain = model(torch.tensor([ids[0].tolist() + chain[::-1]])).logits[0, -1]
        torch.testing.assert_close(logits[i], plain, atol=1e-4, rtol=1e-4)


def test_both_caches_hold_exactly_the_committed_prefix(models, monkeypatch):
    """After every round the target's cache is the committed prefix's; the draft's holds the committed sequence
    and its drafts but the last, each entry as a fresh forward of those tokens computes it (tree entries moved)."""
    target = models["llama"]
    draft = noisy_copy(target, 0.02)
    ids, _ = random_prompts(1, [7], seed=9)
    checked = check_cache_after_each_commit(monkeypatch, target, ids[0].tolist())
    drafted = []
    keep_path = DraftRunner.keep_path

    def checked_keep_path(runner, q, keep):
        keep_path(runner, q, keep)
        assert_same_cache(runner.cache, draft, runner.ids)
        drafted.append(len(keep))

    monkeypatch.setattr(DraftRunner, "keep_path", checked_keep_path)
    out = generate(target, ids, "ouroboros", max_new_tokens=30, draft_model=draft, gamma=4, window=3, ngram=3)
    assert torch.equal(out.sequences, reference_greedy(target, ids, torch.ones_like(ids), 30))
    assert len(checked) == out.stats.target_forwards - 1 and max(checked) > 1 and max(drafted) > 1


def test_phrase_pool_lru_capacity_and_persistence(tmp_path):
    pool = PhrasePool(capacity=2)
    for phrase in [(1, 2, 3), (1, 4, 5), (1, 2, 3), (1, 6, 7), (2, 9), (5,)]:
        pool.add(phrase)
    # (1, 2, 3) was refreshed, so (1, 4, 5) is the least recent and dropped; most recent first; (5,) is no phrase
    assert pool.get(1) == [(6, 7), (2, 3)] and pool.get(1, limit=1) == [(6, 7)] and pool.get(2) == [(9,)]
    assert pool.get(3) == [] and len(pool) == 3
    pool.discard(1, (6, 7))
    assert pool.get(1) == [(2, 3)]
    pool.save(tmp_path / "pool.json")
    again = PhrasePool.load(tmp_path / "pool.json")
    assert again.table == pool.table and again.capacity == 2
    assert PhrasePool.load(tmp_path / "pool.json", capacity=1).get(1) == [(2, 3)]
    assert not list(tmp_path.glob(".tmp-*"))                  # written atomically
    with pytest.raises(ConfigError, match="no such file"):
        PhrasePool.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ConfigError, match="not a saved PhrasePool"):
        PhrasePool.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="capacity"):
        PhrasePool(0)


def test_harvesting_rules(models):
    """§3.3: matched sub-segments of a rejected draft tail (Fig. 4), and corrected phrases after a full accept."""
    # draft tail 10 11 12 13 14 vs the target's 10 99 12 13 77 (+ 15 after the last): runs [10] and [12, 13]
    assert matched_segments([10, 11, 12, 13, 14], [10, 99, 12, 13, 77, 15]) == [[10, 99], [12, 13, 77]]
    assert matched_segments([10, 11], [10, 11, 5]) == [[10, 11, 5]] and matched_segments([4], [6, 7]) == []

    decoder = ouroboros(models["llama"], models["llama"], ngram=3)
    # tokens [pending, d1..d4] = [9, 20, 21, 22, 23]; the target accepts 20, says 30 instead of 21, then agrees
    # with 22 and 23 and says 40 after them: the matched run [22, 23] + 40 gives phrases
    decoder._harvest([9, 20, 21, 22, 23], 4, [], [20, 30, 22, 23, 40], path=[1])
    assert decoder.pool.get(22) == [(23, 40)] and decoder.pool.get(23) == [(40,)] and len(decoder.pool) == 2
    decoder.pool.clear()
    # a full accept of draft [20, 21] lengthened by phrases (21 ->) [5, 6] and [7, 8]; the path took [7, 8]'s first
    decoder.pool.add([21, 5, 6])
    decoder.pool.add([21, 7, 8])
    tokens = [9, 20, 21, 5, 6, 7, 8]
    predicted = [20, 21, 7, 60, 61, 62, 63]      # after 21 the target says 7; after 5: 60; after 7: 62
    decoder._harvest(tokens, 2, [[5, 6], [7, 8]], predicted, path=[1, 2, 5])
    # [5, 6] is replaced by the target's correction [7, 60]; the accepted [7, 8] is refreshed (most recent)
    assert decoder.pool.get(21) == [(7, 8), (7, 60)]


def test_each_ablation_switch_changes_only_its_component(models):
    target = models["qwen2"]
    draft = noisy_copy(target, 0.02)
    ids, mask = random_prompts(1, [6], seed=11)
    other, _ = random_prompts(1, [9], seed=12)
    ref = reference_greedy(target, ids, mask, 30)
    off = dict(draft_lookahead=False, lengthen=False, harvest=False, reuse=False)

    def run(decoder, prompt=ids):
        out = decoder.generate(prompt, max_new_tokens=30)
        if prompt is ids:
            assert torch.equal(out.sequences, ref)
        return out

    # all off: speculative decoding with gamma draft tokens, round for round, and nothing enters the pool
    plain = ouroboros(target, draft, gamma=3, **off)
    out, spec = run(plain), generate(target, ids, "speculative", max_new_tokens=30, draft_model=draft, gamma=3)
    assert out.stats.accepted_per_forward == spec.stats.accepted_per_forward and len(plain.pool) == 0
    assert out.stats.draft_forwards == out.stats.drafted_tokens    # token by token: one draft forward per token

    # draft_lookahead: the draft's window fills the pool; a draft forward may yield a phrase
    on = ouroboros(target, draft, gamma=3, **{**off, "draft_lookahead": True})
    out = run(on)
    assert len(on.pool) > 0 and out.extras["phrase_tokens"] == 0 and out.stats.draft_forwards > 0

    # harvest alone: phrases come from verification only, and nothing lengthens the drafts
    harvesting = ouroboros(target, draft, gamma=3, **{**off, "harvest": True})
    out = run(harvesting)
    assert len(harvesting.pool) > 0 and out.extras["phrase_tokens"] == 0
    assert out.stats.draft_forwards == out.stats.drafted_tokens    # the draft still drafts token by token

    # lengthen: blocks grow beyond [pending + draft] only when it is on
    fed = []
    forward = DecodeState.forward

    def spy(state, block, *args, **kwargs):
        fed.append(block.size(1))
        return forward(state, block, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DecodeState, "forward", spy)
        for lengthen in (False, True):
            fed.clear()
            decoder = ouroboros(target, draft, gamma=3, **{**off, "harvest": True, "lengthen": lengthen})
            decoder.pool.add([int(t) for t in ref[0, 6:10]])       # a phrase the target will verify
            run(decoder)
            assert (max(fed) > 4) == lengthen                     # 1 pending + at most gamma = 3 draft tokens

    # reuse: off, every prompt starts from an empty pool (the same as a fresh decoder); on, the pool carries over
    cold = ouroboros(target, draft, gamma=3, reuse=False)
    run(cold, other)
    fresh = ouroboros(target, draft, gamma=3, reuse=False)
    assert run(cold).stats.accepted_per_forward == run(fresh).stats.accepted_per_forward
    warm = ouroboros(target, draft, gamma=3, reuse=True)
    run(warm, other)
    carried = set(warm.pool.table)
    run(warm)
    assert carried and carried <= set(warm.pool.table)     # keys are never evicted, only their oldest phrases
    warm.reset()
    assert len(warm.pool) == 0


def test_pool_path_starts_warm(models, tmp_path):
    target = models["llama"]
    ids, mask = random_prompts(1, [6], seed=13)
    decoder = ouroboros(target, target, gamma=2)
    decoder.generate(ids, max_new_tokens=20)
    decoder.pool.save(tmp_path / "pool.json")
    loaded = ouroboros(target, target, gamma=2, pool_path=str(tmp_path / "pool.json"), reuse=False)
    assert loaded.pool.table == decoder.pool.table
    out = loaded.generate(ids, max_new_tokens=20)
    assert torch.equal(out.sequences, reference_greedy(target, ids, mask, 20))
    loaded.reset()                                     # back to the saved pool, not to empty
    assert loaded.pool.table == decoder.pool.table


def test_bad_input_is_a_config_error(models, tmp_path):
    target = models["llama"]
    ids, mask = random_prompts(2, [4, 6])
    small_vocab = random_model("llama", seed=3, layers=1, hidden=32, vocab=50)
    cases = [({}, "needs a draft_model"), ({"draft_model": small_vocab}, "vocabulary"),
             ({"gamma": 0}, "gamma"), ({"window": 0}, "window"), ({"ngram": 1}, "ngram"), ({"guesses": 0}, "guesses"),
             ({"phrases": 0}, "phrases"), ({"pool_capacity": 0}, "pool_capacity"), ({"temperature": -0.7}, "temperature"),
             ({"pool_path": str(tmp_path / "none.json")}, "no such file"), ({"init": "zeros"}, "init")]
    for params, message in cases:
        params = {"draft_model": target, **params} if "draft_model" not in params and message != cases[0][1] \
            else params
        with pytest.raises(ConfigError, match=message):
            generate(target, ids[:1], "ouroboros", max_new_tokens=4, **params)
    with pytest.raises(ConfigError, match="batch size 1"):
        generate(target, ids, "ouroboros", attention_mask=mask, max_new_tokens=4, draft_model=target)
