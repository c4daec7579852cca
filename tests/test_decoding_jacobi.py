"""Jacobi decoding (CLLM Algorithm 3): token-identical to ``model.generate`` on three architectures, alone and in
batches of prompts of different lengths, EOS inside an accepted block; trajectories are true Jacobi trajectories; the
fast-forward and stationary counts follow the paper's definitions; clear errors."""

from __future__ import annotations

import pytest
import torch
from hand_models import bigram_model
from random_models import (ARCHS, PAD, check_cache_after_each_commit, greedy_with_mid_output_eos, random_prompts,
                           reference_greedy, tokens_until_eos)

from lit_spec.decoding import DECODERS, generate
from lit_spec.decoding.jacobi import JacobiDecoder, stationary_tokens
from lit_spec.errors import ConfigError




def new_tokens(out, prompt_len: int, row: int = 0, eos=None) -> list[int]:
    return tokens_until_eos(out.sequences[row], prompt_len, eos)


# ---- independent reading of the paper's definitions, from a trajectory ------------------------------------------
def prefix_len(s, y):
    n = 0
    while n < len(y) and s[n] == y[n]:
        n += 1
    return n


def expected_commits(states, first_known: int) -> list[int]:
    """Tokens each Jacobi iteration of a block fixes (KV-cache Jacobi, Algorithm 3): iteration j fixes everything up to
    one past the correct prefix of the state it was fed, s^(j-1). The trajectory omits the repeated last state."""
    y, m = states[-1], len(states[-1])
    done, commits, j = first_known, [], 0
    while done < m:
        fed = states[min(j, len(states) - 1)]
        fixed = min(m, prefix_len(fed, y) + 1)
        commits.append(fixed - done)
        done, j = fixed, j + 1
    return commits


def expected_stationary(states) -> int:
    """Positions i for which some predicted state s^(j) (j >= 1) has the fixed-point token at i while a position
    before i is wrong, and every state after s^(j) keeps that token."""
    y = states[-1]
    count = 0
    for i in range(len(y)):
        if any(states[j][i] == y[i] and prefix_len(states[j], y) < i
               and all(states[k][i] == y[i] for k in range(j, len(states)))
               for j in range(1, len(states))):
            count += 1
    return count


def check_trajectories(out, prompt_len: int, n: int, eos=None) -> None:
    """Structure of ``extras["trajectories"]`` and the counters derived from it, for every row."""
    stats, total_iterations, total_ff, total_stationary = out.stats, 0, 0, 0
    for row, blocks in enumerate(out.extras["trajectories"]):
        output = new_tokens(out, prompt_len, row, eos)
        assert [t for block in blocks for t in block[-1]] == output          # fixed points concatenated
        for b, states in enumerate(blocks):
            m = len(states[-1])
            assert 1 <= m <= n and all(len(s) == m for s in states)
            assert all(states[j] != states[j + 1] for j in range(len(states) - 1))
            assert len(states) <= m + 1                                       # >= one token fixed per iteration
            if b == 0:
                assert states[0][0] == output[0]                              # the prefill's token
            commits = expected_commits(states, 1 if b == 0 else 0)
            total_iterations += len(commits)
            total_ff += sum(c - 1 for c in commits)
            total_stationary += expected_stationary(states)
            assert stationary_tokens(states, states[-1]) == expected_stationary(states)
    assert stats.fast_forwarded == total_ff == stats.accepted_tokens
    assert stats.stationary == total_stationary
    assert out.extras["jacobi_iterations"] == total_iterations == stats.row_forwards - len(out.extras["trajectories"])
    assert stats.new_tokens == stats.row_forwards + stats.accepted_tokens
    assert stats.mean_accepted >= 1.0
    assert out.extras["fast_forward_count"] == pytest.approx((total_ff + total_iterations) / total_iterations)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_to_generate(models, arch):
    model = models[arch]
    settings = [(1, "pad"), (3, "random"), (7, "prefix"), (16, "repeat_last")]
    for p, (length, new) in enumerate([(4, 30), (9, 24)]):
        ids, mask = random_prompts(1, [length], seed=10 * ARCHS.index(arch) + p)
        ref = reference_greedy(model, ids, mask, new)
        for n, init in settings:
            out = generate(model, ids, "jacobi", max_new_tokens=new, n_tokens=n, init=init, return_trajectory=True)
            assert torch.equal(out.sequences, ref), (n, init, p)
            assert out.stats.new_tokens == new and out.stats.mean_accepted >= 1.0
            assert out.stats.target_forwards == out.stats.row_forwards <= new
            check_trajectories(out, ids.size(1), n)
        settings = settings[1:] + settings[:1]   # the other prompt pairs each n with another init


@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_prompts_of_different_lengths(models, arch, align):
    model = models[arch]
    lengths = [5, 11, 8, 3]
    ids, mask = random_prompts(4, lengths, seed=3 + ARCHS.index(arch))
    ref = reference_greedy(model, ids, mask, 28)
    free = ref[0, ids.size(1):].tolist()
    eos = free[6]      # a token the first row outputs mid-way: rows stop at different steps, some never
    ref_eos = reference_greedy(model, ids, mask, 28, eos_token_id=eos)
    for n, init in [(4, "prefix"), (9, "pad")]:
        out = generate(model, ids, "jacobi", attention_mask=mask, max_new_tokens=28, n_tokens=n, init=init,
                       return_trajectory=True, align_blocks=align)
        assert torch.equal(out.sequences, ref), n
        check_trajectories(out, ids.size(1), n)
        assert out.stats.new_tokens == out.stats.row_forwards + out.stats.accepted_tokens
        out = generate(model, ids, "jacobi", attention_mask=mask, max_new_tokens=28, n_tokens=n, init=init,
                       eos_token_id=eos, return_trajectory=True, align_blocks=align)
        for r in range(len(lengths)):
            assert new_tokens(out, ids.size(1), r, eos) == tokens_until_eos(ref_eos[r], ids.size(1), eos), (n, r)
        check_trajectories(out, ids.size(1), n, eos)


class OracleJacobi(JacobiDecoder):
    """Guesses the true greedy continuation: every block is accepted whole by one forward."""

    def __init__(self, model, continuation: list[int], **kwargs):
        super().__init__(model, **kwargs)
        self.continuation = continuation    # prompt + greedy output

    def initial_guess(self, context, size):
        guess = self.continuation[len(context): len(context) + size]
        return guess + [PAD] * (size - len(guess))


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_inside_accepted_block(models, arch):
    model = models[arch]
    ids, mask = random_prompts(1, [6], seed=20 + ARCHS.index(arch))
    n, new = 5, 36
    free = reference_greedy(model, ids, mask, new)[0].tolist()
    # EOS: a token first output at a position in the middle of a block (not its first or last token)
    k, eos, ref = greedy_with_mid_output_eos(model, ids, mask, new, not_before=7,
                                             where=lambda i: i % n not in (0, n - 1))
    out = OracleJacobi(model, free, n_tokens=n, return_trajectory=True).generate(ids, new, eos_token_id=eos)
    assert new_tokens(out, ids.size(1)) == ref
    # prefill + one forward per block; the last forward accepted tokens past EOS that were cut
    assert out.stats.target_forwards == 1 + (k // n + 1)
    assert out.stats.accepted_per_forward[-1] == k % n + 1
    assert out.stats.mean_accepted > 1.0
    check_trajectories(out, ids.size(1), n, eos)
    assert all(len(states) == 1 for states in out.extras["trajectories"][0])   # the guess was the fixed point
    # plain Jacobi through the same EOS
    for init in ("prefix", "repeat_last"):
        out = generate(model, ids, "jacobi", max_new_tokens=new, n_tokens=n, init=init, eos_token_id=eos)
        assert new_tokens(out, ids.size(1), eos=eos) == ref


def test_trajectory_states_are_jacobi_iterations(models):
    """Every state after the first is the target's argmax at each position given the prefix (prompt + earlier
    fixed points) and the previous state (CLLM eq. 3), checked with plain full-sequence forwards; guesses start as
    ``init`` says."""
    model = models["mistral"]
    ids, mask = random_prompts(1, [7], seed=4)
    prompt = ids[0].tolist()
    for init in ("pad", "repeat_last"):
        out = generate(model, ids, "jacobi", max_new_tokens=26, n_tokens=6, init=init, return_trajectory=True)
        prefix = list(prompt)
        for b, states in enumerate(out.extras["trajectories"][0]):
            first, last = (states[0][1:], states[0][0]) if b == 0 else (states[0], prefix[-1])
            assert first == [PAD if init == "pad" else last] * len(first)
            for prev, cur in zip(states, states[1:]):
                logits = model(torch.tensor([prefix + prev])).logits[0]
                assert logits[len(prefix) - 1:-1].argmax(-1).tolist() == cur
            prefix += states[-1]


def test_aligned_blocks_in_a_batch_are_jacobi_iterations_in_phase(models):
    """``align_blocks``: every row's states are still Jacobi iterations of its own prefix (eq. 3), a row at its
    fixed point waits (its next block opens with the others'), and the rows' blocks stay in phase."""
    model = models["llama"]
    ids, mask = random_prompts(3, [7, 4, 9], seed=5)
    n = 5
    out = generate(model, ids, "jacobi", attention_mask=mask, max_new_tokens=22, n_tokens=n, init="prefix",
                   return_trajectory=True, align_blocks=True)
    assert torch.equal(out.sequences, reference_greedy(model, ids, mask, 22))
    for r, blocks in enumerate(out.extras["trajectories"]):
        prefix = ids[r][mask[r].bool()].tolist()
        for states in blocks:
            for prev, cur in zip(states, states[1:]):
                logits = model(torch.tensor([prefix + prev])).logits[0]
                assert logits[len(prefix) - 1: len(prefix) - 1 + len(cur)].argmax(-1).tolist() == cur
            prefix += states[-1]
    # in phase: each round of blocks takes the forwards of its slowest row's block (one per state after the first,
    # plus at most one that only confirms the last state), after the prefill
    slowest = [max(len(states) for states in blocks) for blocks in zip(*out.extras["trajectories"])]
    assert 1 + sum(s - 1 for s in slowest) <= out.stats.target_forwards <= 1 + sum(slowest)
    free = generate(model, ids, "jacobi", attention_mask=mask, max_new_tokens=22, n_tokens=n, init="prefix")
    assert torch.equal(free.sequences, out.sequences)
    assert free.stats.target_forwards <= out.stats.target_forwards  # waiting costs forwards, saves padding


def test_fast_forward_and_stationary_on_hand_built_models():
    # every token's successor is itself: the repeated guess is the fixed point, whole blocks are accepted at once
    model = bigram_model(lambda t: t)
    ids = torch.tensor([[1, 9, 4, 7]])
    out = generate(model, ids, "jacobi", max_new_tokens=14, n_tokens=4, init="repeat_last", return_trajectory=True)
    assert new_tokens(out, 4) == [7] * 14 == reference_greedy(model, ids, torch.ones_like(ids), 14)[0, 4:].tolist()
    # blocks [0,4) [4,8) [8,12) [12,14): fixes 3 (the prefill gave 1), 4, 4, 2 tokens in one iteration each
    s = out.stats
    assert (s.target_forwards, s.fast_forwarded, s.stationary) == (5, 2 + 3 + 3 + 1, 0)
    assert s.mean_accepted == pytest.approx(14 / 5) and out.extras["fast_forward_count"] == pytest.approx(13 / 4)
    assert out.extras["trajectories"] == [[[[7] * 4], [[7] * 4], [[7] * 4], [[7] * 2]]]   # one prompt, 4 blocks

    # stationary tokens: c follows everything but s -> w; guessing [s, x, x, x] after the prefill's c gives
    #   s0 = [c s x x x] -> s1 = [c c w c c] -> s2 = [c c c c c]
    # positions 3 and 4 are right in s1 although position 2 is wrong, and never change again: 2 stationary tokens;
    # the iterations fix 1, 1 and 2 tokens: one fast-forwarded token
    c, s_, w, x = 7, 5, 6, 8
    model = bigram_model(lambda t: w if t == s_ else c)

    class Guess(JacobiDecoder):
        def initial_guess(self, context, size):
            return [s_, x, x, x][:size]

    ids = torch.tensor([[1, 9, 9]])
    out = Guess(model, n_tokens=5, return_trajectory=True).generate(ids, max_new_tokens=5)
    assert new_tokens(out, 3) == [c] * 5
    assert out.extras["trajectories"] == [[[[c, s_, x, x, x], [c, c, w, c, c], [c] * 5]]]
    s = out.stats
    assert (s.target_forwards, s.fast_forwarded, s.stationary) == (4, 1, 2)
    assert out.extras["stationary_count"] == 2 and out.extras["fast_forward_count"] == pytest.approx(4 / 3)
    check_trajectories(out, 3, 5)


def test_random_guesses_are_seeded(models):
    model = models["llama"]
    ids, _ = random_prompts(1, [5], seed=1)
    runs = [generate(model, ids, "jacobi", max_new_tokens=12, n_tokens=6, init="random", seed=seed,
                     return_trajectory=True).extras["trajectories"] for seed in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert all(0 <= t < model.config.vocab_size for blocks in runs for b in blocks[0] for s in b for t in s)


def test_bad_input_is_a_config_error(models):
    model = models["llama"]
    ids, _ = random_prompts(1, [4])
    cases = [({"n_tokens": 0}, "n_tokens"), ({"n_tokens": -3}, "n_tokens"), ({"n_tokens": 2.5}, "n_tokens"),
             ({"n_tokens": True}, "n_tokens"), ({"init": "zeros"}, "init"), ({"init_token": 96}, "init_token"),
             ({"temperature": 0.7}, "greedy by definition"), ({"seed": "x"}, "seed")]
    for params, name in cases:
        with pytest.raises(ConfigError, match=name):
            generate(model, ids, "jacobi", max_new_tokens=4, **params)
    assert "jacobi" in DECODERS


def test_cache_holds_exactly_the_committed_prefix(models, monkeypatch):
    """After every step the target's KV cache equals a fresh forward of the prompt and every committed token but the
    pending one: false guesses' entries were dropped, accepted ones kept."""
    model = models["qwen2"]
    ids, _ = random_prompts(1, [7], seed=8)
    checked = check_cache_after_each_commit(monkeypatch, model, ids[0].tolist())
    out = generate(model, ids, "jacobi", max_new_tokens=30, n_tokens=6, init="repeat_last")
    assert torch.equal(out.sequences, reference_greedy(model, ids, torch.ones_like(ids), 30))
    assert len(checked) == out.stats.target_forwards - 1 and max(checked) > 1
