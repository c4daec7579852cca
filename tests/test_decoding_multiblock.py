"""Multi-block Jacobi decoding with rejection recycling (Jacobi Forcing): token-identical to ``model.generate`` on three
architectures for K blocks, pool sizes and block sizes, through EOS and max_new_tokens cuts; K=1 without a pool is
``jacobi`` forward for forward; recycled branches commit tokens with the cache kept exact; K>1 opens more blocks;
clear errors."""

from __future__ import annotations

import pytest
import torch
from random_models import (ARCHS, check_cache_after_each_commit, greedy_with_mid_output_eos, random_prompts,
                           reference_greedy, tokens_until_eos)

from lit_spec.decoding import DECODERS, generate
from lit_spec.errors import ConfigError


REPETITIVE = torch.tensor([[1, 40, 41] * 4])   # the mistral random model answers it with long runs of one token


def check_counters(out, blocks: int) -> None:
    s, x = out.stats, out.extras
    assert s.new_tokens == s.row_forwards + s.accepted_tokens and s.accepted_tokens <= s.drafted_tokens
    assert x["iterations"] == s.target_forwards - 1 and 0 <= x["recycled_tokens"] <= s.accepted_tokens
    assert x["fast_forward_count"] == pytest.approx((s.new_tokens - 1) / x["iterations"])
    assert 1.0 <= x["mean_blocks"] <= blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_to_generate(models, arch):
    model = models[arch]
    settings = [(k, pool, n) for k in (1, 2, 3) for pool in (0, 4) for n in (2, 4, 8)]
    for p, (length, new) in enumerate([(5, 37), (9, 24)]):     # 37: the last block is cut by max_new_tokens
        ids, mask = random_prompts(1, [length], seed=10 * ARCHS.index(arch) + p)
        ref = reference_greedy(model, ids, mask, new)
        for k, pool, n in settings:
            out = generate(model, ids, "multiblock", max_new_tokens=new, n_tokens=n, blocks=k, pool_size=pool,
                           spawn_ratio=0.5 if p else 0.85)
            assert torch.equal(out.sequences, ref), (k, pool, n)
            check_counters(out, k)


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_cut(models, arch):
    model = models[arch]
    ids, mask = random_prompts(1, [6], seed=20 + ARCHS.index(arch))
    _, eos, ref = greedy_with_mid_output_eos(model, ids, mask, 40, not_before=9)
    for k, pool, n in [(1, 4, 4), (2, 0, 8), (3, 4, 2), (2, 4, 64)]:
        out = generate(model, ids, "multiblock", max_new_tokens=40, n_tokens=n, blocks=k, pool_size=pool,
                       eos_token_id=eos)
        assert tokens_until_eos(out.sequences[0], ids.size(1), eos) == ref, (k, pool, n)
        check_counters(out, k)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_block_without_pool_is_jacobi(models, arch):
    """Same guesses (init=prefix, same seed), same Jacobi iterations: the same tokens committed by every forward."""
    ids, mask = random_prompts(1, [7], seed=30 + ARCHS.index(arch))
    for n in (1, 3, 8):
        jacobi = generate(models[arch], ids, "jacobi", max_new_tokens=30, n_tokens=n, init="prefix", seed=5)
        multi = generate(models[arch], ids, "multiblock", max_new_tokens=30, n_tokens=n, blocks=1, pool_size=0,
                         init="prefix", seed=5)
        assert torch.equal(multi.sequences, jacobi.sequences)
        assert multi.stats.target_forwards == jacobi.stats.target_forwards, n
        assert multi.stats.accepted_per_forward == jacobi.stats.accepted_per_forward
        assert multi.extras["fast_forward_count"] == pytest.approx(jacobi.extras["fast_forward_count"])
        assert multi.extras["recycled_tokens"] == 0 and multi.extras["mean_blocks"] == 1.0


def test_recycled_branches_commit_tokens_and_keep_the_cache_exact(models, monkeypatch):
    """On a repetitive answer rejected guesses come back right: recycled branches commit tokens (here saving
    forwards), and after every step the cache holds exactly the committed prefix (the winning branch's KV kept)."""
    model = models["mistral"]
    ref = reference_greedy(model, REPETITIVE, torch.ones_like(REPETITIVE), 48)
    plain = generate(model, REPETITIVE, "multiblock", max_new_tokens=48, n_tokens=8, blocks=1, pool_size=0)
    checked = check_cache_after_each_commit(monkeypatch, model, REPETITIVE[0].tolist())
    for k in (1, 2):
        out = generate(model, REPETITIVE, "multiblock", max_new_tokens=48, n_tokens=8, blocks=k, pool_size=4)
        assert torch.equal(out.sequences, ref) and torch.equal(plain.sequences, ref)
        assert out.extras["recycled_tokens"] > 0
        assert out.stats.target_forwards < plain.stats.target_forwards
        check_counters(out, k)
    assert len(checked) > 0 and max(checked) > 1


def test_more_blocks_open_when_the_newest_converges(models):
    model = models["mistral"]
    ref = reference_greedy(model, REPETITIVE, torch.ones_like(REPETITIVE), 48)
    for k in (1, 2, 3):
        for n, ratio in [(8, 0.85), (16, 0.5)]:
            out = generate(model, REPETITIVE, "multiblock", max_new_tokens=48, n_tokens=n, blocks=k,
                           spawn_ratio=ratio)
            assert torch.equal(out.sequences, ref)
            assert (out.extras["mean_blocks"] > 1.0) == (k > 1), (k, n)
            check_counters(out, k)


def test_bad_settings_are_one_line_config_errors(models):
    model = models["llama"]
    ids, _ = random_prompts(1, [4])
    cases = [({"blocks": 0}, "blocks"), ({"spawn_ratio": 1.5}, "spawn_ratio"), ({"spawn_ratio": 0}, "spawn_ratio"),
             ({"pool_size": -1}, "pool_size"), ({"n_tokens": 0}, "n_tokens"), ({"temperature": 0.7}, "greedy by definition"),
             ({"init": "zeros"}, "init")]
    for params, name in cases:
        with pytest.raises(ConfigError, match=name) as error:
            generate(model, ids, "multiblock", max_new_tokens=4, **params)
        assert "\n" not in str(error.value)
    two, mask = random_prompts(2, [4, 6])
    with pytest.raises(ConfigError, match="batch size 1") as error:
        generate(model, two, "multiblock", attention_mask=mask, max_new_tokens=4)
    assert "\n" not in str(error.value)
    assert "multiblock" in DECODERS
