"""Lookahead decoding (Fu et al. 2024): token-identical to ``model.generate`` on three architectures for several
W/N/G, EOS inside an accepted n-gram, the lookahead and verification branches of one forward see exactly their own
context (tree mask + positions), more than one token per forward on a repeating text, clear errors."""

from __future__ import annotations

import pytest
import torch
from hand_models import bigram_model
from random_models import (ARCHS, check_cache_after_each_commit, greedy_with_mid_output_eos, random_prompts,
                           reference_greedy, tokens_until_eos)

from lit_spec.decoding import DECODERS, generate
from lit_spec.decoding.lookahead import LookaheadLayout
from lit_spec.decoding.phrases import PhrasePool
from lit_spec.decoding.masks import from_parents
from lit_spec.decoding.state import DecodeState
from lit_spec.errors import ConfigError




def cycle(period: int, first: int = 3):
    """Successor function of a bigram model that repeats first, first + 1, ..., first + period - 1 forever."""
    return lambda t: first + (t - first + 1) % period if first <= t < first + period else first


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_to_generate(models, arch):
    model = models[arch]
    settings = [(1, 2, 1), (3, 3, 2), (5, 4, 5), (4, 5, 3), (2, 6, 4)]
    pooled = accepted = 0
    for p, (length, new) in enumerate([(4, 30), (9, 24)]):
        ids, mask = random_prompts(1, [length], seed=30 + 10 * ARCHS.index(arch) + p)
        ref = reference_greedy(model, ids, mask, new)
        for w, n, g in settings:
            out = generate(model, ids, "lookahead", max_new_tokens=new, window=w, ngram=n, guesses=g,
                           pool_from_prompt=p == 1)
            assert torch.equal(out.sequences, ref), (w, n, g, p)
            s = out.stats
            assert s.new_tokens == new and s.mean_accepted >= 1.0 and s.draft_forwards == 0
            assert s.new_tokens == s.row_forwards + s.accepted_tokens
            assert s.accepted_tokens <= s.drafted_tokens
            assert out.extras["steps"] == s.target_forwards - 1
            pooled, accepted = pooled + out.extras["pool_size"], accepted + s.accepted_tokens
    assert pooled > 0 and accepted > 0    # verification accepted n-gram tokens (and rejected others)


@pytest.mark.parametrize("arch", ARCHS)
def test_repeating_text_accepts_several_tokens_per_forward(arch):
    """A model that cycles through 7 tokens: the lookahead branch finds the cycle's n-grams, verification accepts
    them; lossless all the same."""
    model = bigram_model(cycle(7), arch=arch)
    ids = torch.tensor([[1, 20, 4]])
    ref = reference_greedy(model, ids, torch.ones_like(ids), 40)
    for w, n, g in [(5, 4, 5), (3, 3, 2), (7, 5, 7)]:
        out = generate(model, ids, "lookahead", max_new_tokens=40, window=w, ngram=n, guesses=g)
        assert torch.equal(out.sequences, ref), (w, n, g)
        assert out.stats.mean_accepted > 1.5 and out.stats.accepted_tokens > 0
        assert max(out.stats.accepted_per_forward) == n     # a whole n-gram: N - 1 tokens + the target's next


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_inside_accepted_ngram(models, arch):
    # the prompt holds a whole lap of a 12-token cycle: with pool_from_prompt every step accepts a full n-gram
    model = bigram_model(cycle(12), arch=arch)
    ids = torch.tensor([[1] + list(range(3, 15)) + [3, 4, 5]])
    # output 6 | 7 8 9 10 | 11 12 13 14 | 3 ...; EOS = 12 is the second token of the third forward's n-gram
    ref = tokens_until_eos(reference_greedy(model, ids, torch.ones_like(ids), 30, eos_token_id=12)[0], ids.size(1), 12)
    assert ref == list(range(6, 13))
    out = generate(model, ids, "lookahead", max_new_tokens=30, eos_token_id=12, window=3, ngram=4, guesses=2,
                   pool_from_prompt=True)
    assert tokens_until_eos(out.sequences[0], ids.size(1), 12) == ref
    assert out.stats.accepted_per_forward == [1, 4, 2] and out.stats.new_tokens == 7

    # random models: EOS some token of the output
    model = models[arch]
    ids, mask = random_prompts(1, [6], seed=40 + ARCHS.index(arch))
    _, eos, ref = greedy_with_mid_output_eos(model, ids, mask, 36, not_before=6)
    for w, n, g in [(4, 3, 4), (5, 4, 5)]:
        out = generate(model, ids, "lookahead", max_new_tokens=36, eos_token_id=eos, window=w, ngram=n, guesses=g,
                       pool_from_prompt=True)
        assert tokens_until_eos(out.sequences[0], ids.size(1), eos) == ref


@pytest.mark.parametrize("arch", ARCHS)
def test_one_forward_gives_every_branch_its_own_context(models, arch):
    """In the step's single forward, every token of the lookahead window (level l, column j: the pending token,
    level 1's columns 0..j, then column j of levels 2..l) and of each verification branch gets the logits of a plain
    forward of the prompt followed by exactly that chain."""
    model = models[arch]
    ids, _ = random_prompts(1, [6], seed=50 + ARCHS.index(arch))
    state = DecodeState(model, ids, None, 16, None)
    pending = int(state.prefill()[0].argmax(-1))
    state.commit([[pending]], advance=[0])
    g = torch.Generator().manual_seed(0)
    levels, width, branches = 3, 4, [3, 1, 2]
    layout = LookaheadLayout(levels, width, branches)
    q = len(layout)
    assert q == 1 + levels * width + sum(branches)
    tokens = [pending] + torch.randint(3, 96, (q - 1,), generator=g).tolist()
    logits = state.forward(torch.tensor([tokens]), from_parents(layout.parents), torch.tensor(layout.depths))[0]
    prompt = ids[0].tolist()
    for i in range(q):
        chain, node = [], i
        while node >= 0:
            chain.append(tokens[node])
            node = layout.parents[node]
        chain = chain[::-1]
        assert len(chain) == layout.depths[i] + 1
        plain = model(torch.tensor([prompt + chain])).logits[0, -1]
        torch.testing.assert_close(logits[i], plain, atol=1e-4, rtol=1e-4)
    # the window's layout: level l column j is at depth l + j + 1 (0-based l) and its chain climbs column j
    for level in range(levels):
        for col in range(width):
            assert layout.depths[layout.window_index(level, col)] == level + col + 1


def test_ngram_pool():
    pool = PhrasePool(capacity=2)
    for ngram in [(1, 2, 3), (1, 4, 5), (1, 2, 3), (1, 6, 7), (2, 9, 9)]:
        pool.add(ngram)
    # (1, 2, 3) was refreshed, so (1, 4, 5) is the least recent and dropped; most recent first
    assert pool.get(1) == [(6, 7), (2, 3)] and pool.get(2) == [(9, 9)] and pool.get(3) == [] and len(pool) == 3


def test_bad_input_is_a_config_error(models):
    model = models["llama"]
    ids, mask = random_prompts(2, [4, 6])
    cases = [({"window": 0}, "window"), ({"window": 2.5}, "window"), ({"ngram": 0}, "ngram"),
             ({"ngram": 1}, "ngram"), ({"guesses": 0}, "guesses"), ({"guesses": -1}, "guesses"),
             ({"init": "zeros"}, "init"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0}, "top_p")]
    for params, name in cases:
        with pytest.raises(ConfigError, match=name):
            generate(model, ids[:1], "lookahead", max_new_tokens=4, **params)
    with pytest.raises(ConfigError, match="batch size 1"):
        generate(model, ids, "lookahead", attention_mask=mask, max_new_tokens=4)
    assert "lookahead" in DECODERS


def test_cache_holds_exactly_the_committed_prefix(models, monkeypatch):
    """After every step the target's KV cache equals a fresh forward of the prompt and every committed token but the
    pending one: false guesses' entries were dropped, accepted ones kept."""
    model = models["llama"]
    ids, _ = random_prompts(1, [7], seed=8)
    checked = check_cache_after_each_commit(monkeypatch, model, ids[0].tolist())
    out = generate(model, ids, "lookahead", max_new_tokens=30, window=4, ngram=3, guesses=4, pool_from_prompt=True)
    assert torch.equal(out.sequences, reference_greedy(model, ids, torch.ones_like(ids), 30))
    assert len(checked) == out.stats.target_forwards - 1 and max(checked) > 1


def test_window_near_the_end_of_the_context(models):
    """Prompt + max_new_tokens fill the model's 512 positions: the window's far tokens get clamped positions, the
    output is unchanged."""
    model = models["qwen2"]
    ids, mask = random_prompts(1, [500], seed=9)
    out = generate(model, ids, "lookahead", max_new_tokens=12, window=6, ngram=5, guesses=3, pool_from_prompt=True)
    assert torch.equal(out.sequences, reference_greedy(model, ids, mask, 12))
