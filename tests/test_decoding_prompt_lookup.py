"""Prompt lookup decoding (Saxena 2023): token-identical to ``model.generate`` on three architectures for several
parameter settings, drafts accepted where the text repeats, EOS inside an accepted draft, max_new_tokens exact, the
cache rolled back to the accepted prefix, the n-gram matcher on hand-made sequences, clear errors."""

from __future__ import annotations

import pytest
import torch
from hand_models import bigram_model
from random_models import (ARCHS, check_cache_after_each_commit, greedy_with_mid_output_eos, random_prompts,
                           reference_greedy, tokens_until_eos)

from lit_spec.decoding import DECODERS, generate
from lit_spec.decoding.phrases import ngram_continuation
from lit_spec.errors import ConfigError


SETTINGS = [{}, {"num_draft_tokens": 2, "max_ngram": 1}, {"num_draft_tokens": 5, "max_ngram": 4, "min_ngram": 2}]


def cycle(period: int, first: int = 3):
    """Successor function of a bigram model that repeats first, first + 1, ..., first + period - 1 forever."""
    return lambda t: first + (t - first + 1) % period if first <= t < first + period else first


def check_counters(stats, new: int) -> None:
    assert stats.new_tokens == new == stats.row_forwards + stats.accepted_tokens
    assert stats.accepted_tokens <= stats.drafted_tokens and stats.draft_forwards == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_to_generate(models, arch):
    """Random prompts, some repeated two or three times (random models fall into loops, so their outputs repeat
    too): drafts are accepted and rejected, the output is the greedy one all the same."""
    model = models[arch]
    fewer_forwards = accepted = rejected = 0
    for p, (length, repeats, new) in enumerate([(5, 1, 24), (6, 3, 30), (10, 2, 20)]):
        ids, _ = random_prompts(1, [length], seed=60 + 10 * ARCHS.index(arch) + p)
        ids = ids.repeat(1, repeats)
        ref = reference_greedy(model, ids, torch.ones_like(ids), new)
        for params in SETTINGS:
            out = generate(model, ids, "prompt_lookup", max_new_tokens=new, **params)
            assert torch.equal(out.sequences, ref), (p, params)
            s = out.stats
            check_counters(s, new)
            accepted += s.accepted_tokens
            rejected += s.drafted_tokens - s.accepted_tokens
            fewer_forwards += s.target_forwards < new
    assert accepted > 0 and rejected > 0 and fewer_forwards > 0


def test_left_padded_prompt(models):
    """A batch-1 prompt with left padding: the matcher reads only the real tokens, the target skips the padding."""
    model = models["qwen2"]
    ids, mask = random_prompts(2, [4, 9], seed=2)
    ids, mask = ids[:1], mask[:1]                     # 5 pad tokens, then 4 real ones
    out = generate(model, ids, "prompt_lookup", max_new_tokens=24, attention_mask=mask)
    assert torch.equal(out.sequences, reference_greedy(model, ids, mask, 24))
    assert out.stats.accepted_tokens > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_copying_model_accepts_whole_drafts(arch):
    """A model that cycles through 12 tokens, the prompt a whole lap and then some: from the second step on every
    draft is the continuation in the prompt and is accepted whole (the target's own token after it)."""
    model = bigram_model(cycle(12), arch=arch)
    ids = torch.tensor([[1] + list(range(3, 15)) + [3, 4, 5]])
    ref = reference_greedy(model, ids, torch.ones_like(ids), 21)
    out = generate(model, ids, "prompt_lookup", max_new_tokens=21, num_draft_tokens=4)
    assert torch.equal(out.sequences, ref)
    assert out.stats.accepted_per_forward == [1, 5, 5, 5, 5] and out.stats.acceptance_rate == 1.0


def test_no_match_is_a_plain_step():
    """Output tokens that never occurred before: nothing to draft, one token per target forward."""
    model = bigram_model(lambda t: (t + 1) % 32)
    ids = torch.tensor([[1, 20, 21]])
    out = generate(model, ids, "prompt_lookup", max_new_tokens=8)
    assert torch.equal(out.sequences, reference_greedy(model, ids, torch.ones_like(ids), 8))
    assert out.stats.drafted_tokens == 0 and out.stats.target_forwards == 8


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_inside_accepted_draft(models, arch):
    # output 6 | 7 8 9 10 11 | 12 13 (EOS), the draft [12, 13, 14, 3] accepted whole and cut after its 2nd token
    model = bigram_model(cycle(12), arch=arch)
    ids = torch.tensor([[1] + list(range(3, 15)) + [3, 4, 5]])
    ref = tokens_until_eos(reference_greedy(model, ids, torch.ones_like(ids), 30, eos_token_id=13)[0], ids.size(1), 13)
    assert ref == list(range(6, 14))
    out = generate(model, ids, "prompt_lookup", max_new_tokens=30, eos_token_id=13, num_draft_tokens=4)
    assert tokens_until_eos(out.sequences[0], ids.size(1), 13) == ref
    s = out.stats
    assert s.accepted_per_forward == [1, 5, 2] and s.accepted_tokens == 5 and s.drafted_tokens == 8

    # random models: EOS a late token of the output (seeds whose decode accepts drafts before it)
    model = models[arch]
    ids, mask = random_prompts(1, [6], seed={"llama": 72, "qwen2": 72, "mistral": 77}[arch])
    ids, mask = ids.repeat(1, 2), mask.repeat(1, 2)
    _, eos, ref = greedy_with_mid_output_eos(model, ids, mask, 30, not_before=6)
    for params in SETTINGS:
        out = generate(model, ids, "prompt_lookup", max_new_tokens=30, eos_token_id=eos, **params)
        assert tokens_until_eos(out.sequences[0], ids.size(1), eos) == ref
        check_counters(out.stats, len(ref))


def test_max_new_tokens_is_exact():
    """Drafts never run past max_new_tokens: on the copying model every drafted token is accepted and output."""
    model = bigram_model(cycle(12))
    ids = torch.tensor([[1] + list(range(3, 15)) + [3, 4, 5]])
    ref = reference_greedy(model, ids, torch.ones_like(ids), 14)
    for new in range(1, 15):
        out = generate(model, ids, "prompt_lookup", max_new_tokens=new, num_draft_tokens=4)
        assert torch.equal(out.sequences, ref[:, : ids.size(1) + new]), new
        check_counters(out.stats, new)
        assert out.stats.accepted_tokens == out.stats.drafted_tokens == new - out.stats.target_forwards


def test_cache_holds_exactly_the_committed_prefix(models, monkeypatch):
    """After every step the target's KV cache equals a fresh forward of the prompt and every committed token but the
    pending one: rejected draft tokens' entries were dropped."""
    model = models["mistral"]
    ids, _ = random_prompts(1, [6], seed=61)
    ids = ids.repeat(1, 3)
    checked = check_cache_after_each_commit(monkeypatch, model, ids[0].tolist())
    out = generate(model, ids, "prompt_lookup", max_new_tokens=30)
    assert torch.equal(out.sequences, reference_greedy(model, ids, torch.ones_like(ids), 30))
    s = out.stats
    assert 0 < s.accepted_tokens < s.drafted_tokens       # some drafts were rejected part-way
    assert len(checked) == s.target_forwards - 1 and max(checked) > 1


def test_ngram_continuation():
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]
    assert ngram_continuation(tokens, 3, 10) == [7, 1, 2, 3]       # the latest earlier (1, 2, 3) wins
    assert ngram_continuation(tokens, 3, 2) == [7, 1]               # at most num_tokens
    # the longest n first: (5, 1, 2) occurred before 8, (1, 2) last before 6, (2) last before 5
    tokens = [5, 1, 2, 8, 1, 2, 6, 4, 2, 5, 1, 2]
    assert [ngram_continuation(tokens, n, 1) for n in (3, 2, 1)] == [[8], [6], [5]]
    # min_ngram: only a 1-gram matches, so a minimum of 2 finds nothing
    assert ngram_continuation([4, 7, 5, 7], 3, 4) == [5, 7]
    assert ngram_continuation([4, 7, 5, 7], 3, 4, min_ngram=2) == []
    # no earlier occurrence: the final n-gram itself, at the very end, has nothing after it
    assert ngram_continuation([1, 2, 3, 4], 3, 4) == []
    assert ngram_continuation([1], 3, 4) == [] and ngram_continuation([], 3, 4) == []
    # an occurrence overlapping the final n-gram counts: a run continues itself
    assert ngram_continuation([8, 5, 5, 5], 2, 4) == [5]


def test_bad_input_is_a_config_error(models):
    model = models["llama"]
    ids, mask = random_prompts(2, [4, 6])
    cases = [({"num_draft_tokens": 0}, "num_draft_tokens"), ({"num_draft_tokens": 2.5}, "num_draft_tokens"),
             ({"max_ngram": 0}, "max_ngram"), ({"min_ngram": 0}, "min_ngram"),
             ({"min_ngram": 3, "max_ngram": 2}, "min_ngram=3 > max_ngram=2"), ({"temperature": -0.7}, "temperature"),
             ({"temperature": 0.7, "top_p": 0}, "top_p")]
    for params, message in cases:
        with pytest.raises(ConfigError, match=message):
            DECODERS["prompt_lookup"](model, **params)
    with pytest.raises(ConfigError, match="batch size 1"):
        generate(model, ids, "prompt_lookup", attention_mask=mask, max_new_tokens=4)
