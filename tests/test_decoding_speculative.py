"""Speculative decoding: greedy token-identical to ``model.generate`` on three architectures, the sampled distribution
equals the target's (chi-square), both KV caches roll back to the accepted prefix, clear errors."""

from __future__ import annotations

import math

import pytest
import torch
from random_models import (ARCHS, assert_same_cache, check_cache_after_each_commit, greedy_with_mid_output_eos,
                           noisy_copy, random_model, random_prompts, reference_greedy)

from lit_spec.decoding import DECODERS, generate
from lit_spec.decoding.verify import logits_to_probs, speculative_accept
from lit_spec.errors import ConfigError


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile for ``df`` degrees of freedom at 1 - 0.001 (z = 3.09), Wilson-Hilferty."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson's statistic of observed ``counts`` against ``probs``; cells expecting < 5 are pooled."""
    expected = probs.double() * n
    small = expected < 5
    obs, exp = counts.double()[~small], expected[~small]
    if small.any():
        obs, exp = torch.cat([obs, counts.double()[small].sum()[None]]), torch.cat([exp, expected[small].sum()[None]])
    return float(((obs - exp) ** 2 / exp).sum()), obs.numel() - 1




@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_to_generate(models, arch):
    target = models[arch]
    drafts = {"independent": random_model(arch, seed=7, layers=1, hidden=32), "noisy": noisy_copy(target, 0.01),
              "self": target}
    drafted = accepted = 0
    for p, (length, new) in enumerate([(5, 21), (11, 14), (3, 26)]):
        ids, mask = random_prompts(1, [length], seed=100 * ARCHS.index(arch) + p)
        ref = reference_greedy(target, ids, mask, new)
        for kind, draft in drafts.items():
            for gamma in ((4,) if kind == "self" else (1, 3, 6)):
                out = generate(target, ids, "speculative", max_new_tokens=new, draft_model=draft, gamma=gamma)
                assert torch.equal(out.sequences, ref), (kind, gamma, p)
                s = out.stats
                assert s.new_tokens == new and s.draft_forwards > 0 and s.drafted_tokens > 0
                assert s.mean_accepted == pytest.approx(new / s.target_forwards)
                if kind == "noisy":
                    drafted, accepted = drafted + s.drafted_tokens, accepted + s.accepted_tokens
                if kind == "self":
                    assert s.acceptance_rate == 1.0
                    # every verification commits gamma + 1 tokens except possibly the last one
                    assert s.target_forwards <= 1 + math.ceil((new - 1) / (gamma + 1))
    assert 0 < accepted < drafted  # the noisy draft exercised both acceptance and rejection


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_eos_inside_accepted_block(models, arch):
    target = models[arch]
    ids, mask = random_prompts(1, [6], seed=5 + ARCHS.index(arch))
    # the first token that appears only from position >= 8 on serves as EOS: decoding stops in the middle
    k, eos, ref = greedy_with_mid_output_eos(target, ids, mask, 40, not_before=8)
    for draft in (target, noisy_copy(target, 0.01)):
        for gamma in (2, 5):
            out = generate(target, ids, "speculative", max_new_tokens=40, eos_token_id=eos, draft_model=draft,
                           gamma=gamma)
            assert out.sequences[0, ids.size(1):].tolist() == ref
            assert out.stats.new_tokens == len(ref)


def test_caches_roll_back_to_accepted_prefix(models, monkeypatch):
    """After every verification (rejections included), the target's cache equals the cache of the committed tokens
    but the pending one, and the draft's cache equals the cache of the tokens it holds."""
    from lit_spec.decoding import draft as draft_module

    target = models["qwen2"]
    draft_model = noisy_copy(target, 0.01)
    ids, _ = random_prompts(1, [7], seed=3)
    checked = {"target": check_cache_after_each_commit(monkeypatch, target, ids[0].tolist()), "draft": 0}
    sync = draft_module.DraftRunner.sync

    def checked_sync(runner, sequence):
        n = sync(runner, sequence)
        if runner.ids:
            assert runner.ids == sequence[:n]
            assert_same_cache(runner.cache, draft_model, runner.ids)
            checked["draft"] += 1
        return n

    monkeypatch.setattr(draft_module.DraftRunner, "sync", checked_sync)
    out = generate(target, ids, "speculative", max_new_tokens=30, draft_model=draft_model, gamma=4)
    s = out.stats
    assert 0 < s.accepted_tokens < s.drafted_tokens  # some blocks were rejected part-way
    assert len(checked["target"]) >= 5 and checked["draft"] >= 5


def test_speculative_accept_preserves_target_distribution():
    """The rejection step alone: with the draft token drawn from q, the emitted token is distributed as p (V = 6,
    20,000 draws; Pearson's chi-square under the 0.999 quantile, while the draft's own q is far outside it)."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, 6, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(1, 6, generator=g) * 1.5, -1)
    n, counts = 20000, torch.zeros(6)
    for _ in range(n):
        x = torch.multinomial(q[0], 1, generator=g)
        accepted, extra = speculative_accept(x, q, p, generator=g)
        counts[int(x) if accepted else extra] += 1
    stat, df = chi2(counts, p[0], n)
    assert stat < chi2_critical(df), (stat, counts / n, p[0])
    assert chi2(counts, q[0], n)[0] > 10 * chi2_critical(df)  # the test can tell p from q


@pytest.mark.slow      # end to end: 800 seeded decodes a case (the accept step alone is tested above)
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampling_matches_target_distribution(top_p):
    """End to end on a vocab-8 model: the 2nd and 3rd generated tokens (drafted, verified, resampled or the target's
    extra token) follow the target's exact marginals at temperature 1 (with top-p truncation), computed by
    enumerating every continuation. 800 seeded runs; chi-square under its 0.999 quantile; the draft's own marginals
    are far outside it (the test has power)."""
    vocab, runs = 8, 800
    target = random_model("llama", vocab=vocab, hidden=32, layers=1)
    draft = random_model("llama", seed=3, vocab=vocab, hidden=32, layers=1)
    prompt = torch.tensor([[1, 5, 3, 7, 4]])

    def exact_marginals(model, steps: int) -> list[torch.Tensor]:
        seqs, weight, out = prompt, torch.ones(1), []
        with torch.no_grad():
            for _ in range(steps):
                probs = logits_to_probs(model(seqs).logits[:, -1], 1.0, top_p)     # [S, V]
                joint = weight[:, None] * probs
                out.append(joint.sum(0))
                seqs = torch.cat([seqs.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(seqs.size(0))[:, None]], 1)
                weight = joint.reshape(-1)
        return out

    counts = torch.zeros(2, vocab)
    for seed in range(runs):
        out = generate(target, prompt, "speculative", max_new_tokens=3, draft_model=draft, gamma=2,
                       temperature=1.0, top_p=top_p, seed=seed)
        new = out.sequences[0, prompt.size(1):].tolist()
        counts[0, new[1]] += 1
        counts[1, new[2]] += 1
    exact, wrong = exact_marginals(target, 3)[1:], exact_marginals(draft, 3)[1:]
    for step in range(2):
        stat, df = chi2(counts[step], exact[step], runs)
        assert stat < chi2_critical(df), (step, stat, counts[step] / runs, exact[step])
    assert max(chi2(counts[s], wrong[s], runs)[0] for s in range(2)) > 3 * chi2_critical(7)


def test_sampling_reproducible_with_seed(models):
    target = models["llama"]
    ids, _ = random_prompts(1, [6], seed=1)
    run = [generate(target, ids, "speculative", max_new_tokens=20, draft_model=noisy_copy(target, 0.01), gamma=3,
                    temperature=0.8, seed=s).sequences for s in (11, 11, 12)]
    assert torch.equal(run[0], run[1]) and not torch.equal(run[0], run[2])


def test_errors(models):
    target = models["llama"]
    ids, _ = random_prompts(1, [6])
    with pytest.raises(ConfigError, match="vocabulary"):
        DECODERS["speculative"](target, draft_model=random_model("llama", vocab=64))
    with pytest.raises(ConfigError, match="draft_model"):
        generate(target, ids, "speculative")
    with pytest.raises(ConfigError, match="gamma"):
        generate(target, ids, "speculative", draft_model=target, gamma=0)
    with pytest.raises(ConfigError, match="temperature"):
        generate(target, ids, "speculative", draft_model=target, temperature=-1.0)
    batch, mask = random_prompts(2, [4, 6])
    with pytest.raises(ConfigError, match="batch size 1"):
        generate(target, batch, "speculative", attention_mask=mask, draft_model=target)
    short = random_model("llama", seed=2)
    short.config.max_position_embeddings = 16
    with pytest.raises(ConfigError, match="draft model's context"):
        generate(target, ids, "speculative", max_new_tokens=20, draft_model=short)



@pytest.mark.parametrize("method,params", [("speculative", {"gamma": 3}), ("tree", {"tree": [2, 2, 1]})])
def test_left_padded_prompt(models, method, params):
    """A batch-1 prompt with left padding: the target skips the padding through its mask, the draft reads only the
    real tokens, at the same positions; the output still equals ``model.generate``."""
    target = models["llama"]
    ids, mask = random_prompts(2, [4, 9], seed=21)
    ids, mask = ids[:1], mask[:1]                     # 5 pad tokens, then 4 real ones
    ref = reference_greedy(target, ids, mask, 18)
    out = generate(target, ids, method, max_new_tokens=18, attention_mask=mask, draft_model=noisy_copy(target, 0.01),
                   **params)
    assert torch.equal(out.sequences, ref) and out.stats.accepted_tokens > 0
