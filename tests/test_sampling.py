"""Sampling that leaves the target unchanged (issue 62): at temperature > 0 every drafting decoder commits tokens from
the target's own sampling distribution. Checked exactly, not by eye: one tree node's accept/reject step against the
target's probabilities, and whole decoders' empirical distributions over every 3-token continuation of a 4-token
model against the exact one, with a total-variation threshold derived from the sample size; the same checks fail on
typical acceptance (Medusa's), which is lossy."""

from __future__ import annotations

import math

import pytest
import torch
from random_models import BOS, noisy_copy, random_model
from test_chimera import chimera, medusa
from test_dflash import dflash
from test_eagle3 import eagle3

from lit_spec.decoding import DECODERS
from lit_spec.decoding.verify import RejectionSampling, TypicalAcceptance, logits_to_probs

VOCAB = 4
NEW = 3            # the first token comes from the prefill; the next two from a drafting step
DELTA = 1e-6       # the chance that an exact sampler fails a check


def tv_threshold(outcomes: int, samples: int) -> float:
    """Bretagnolle-Huber-Carol: P(TV(empirical, true) >= eps) <= 2^K exp(-2 N eps^2) for K outcomes and N samples, so
    an exact sampler passes eps = sqrt((K ln 2 + ln(1 / DELTA)) / 2N) but with probability DELTA."""
    return math.sqrt((outcomes * math.log(2) + math.log(1 / DELTA)) / (2 * samples))


def total_variation(counts: dict, exact: dict, samples: int) -> float:
    return 0.5 * sum(abs(counts.get(k, 0) / samples - p) for k, p in exact.items())


def test_one_node_commits_each_token_with_the_targets_probability():
    """A root with three point-mass children (one duplicate): the committed token is distributed as the target's p,
    and a child is accepted with probability p(a) + p(b), computed analytically; typical acceptance, on a flat p,
    commits its first candidate whenever it passes and fails the same check (8000 draws of each)."""
    logits = torch.tensor([[0.3, -1.0, 1.2, 0.1]]).repeat(3, 1)
    p = torch.softmax(logits[0], -1)
    parents, tokens = [-1, 0, 0, 0], [0, 2, 3, 2]
    n = 8000
    eps = tv_threshold(VOCAB, n)
    for sampler, lossless in ((RejectionSampling(1.0, seed=0), True), (TypicalAcceptance(1.0, seed=0), False)):
        counts, accepted = {}, 0
        for _ in range(n):
            path, extra = sampler.choose(parents, tokens, logits.repeat(2, 1))
            first = tokens[path[0]] if path else extra
            counts[first] = counts.get(first, 0) + 1
            accepted += bool(path)
        tv = total_variation(counts, dict(enumerate(p.tolist())), n)
        assert (tv < eps) == lossless, (type(sampler).__name__, tv, eps)
        if lossless:     # Hoeffding on the acceptance rate
            assert abs(accepted / n - float(p[2] + p[3])) < math.sqrt(math.log(2 / DELTA) / (2 * n))


def exact_continuations(model, prompt: list[int], temperature: float, top_p: float = 1.0, top_k: int = 0) -> dict:
    """The target's probability of every ``NEW``-token continuation of ``prompt`` under its sampling distribution (the
    chain rule over full forwards, no cache)."""
    exact = {(): 1.0}
    for _ in range(NEW):
        prefixes = list(exact)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(c) for c in prefixes])).logits[:, -1]
        probs = logits_to_probs(logits, temperature, top_p, top_k)
        exact = {c + (x,): exact[c] * float(probs[i, x]) for i, c in enumerate(prefixes) for x in range(VOCAB)}
    return exact


def sampled_continuations(decoder, prompt: list[int], samples: int) -> tuple[dict, int]:
    """How often each continuation came out of ``samples`` decodes, and how many tokens they drafted in all."""
    counts: dict = {}
    ids, drafted = torch.tensor([prompt]), 0
    for _ in range(samples):
        out = decoder.generate(ids, max_new_tokens=NEW)
        key = tuple(out.sequences[0, len(prompt):].tolist())
        counts[key] = counts.get(key, 0) + 1
        drafted += out.stats.drafted_tokens
    return counts, drafted


@pytest.fixture(scope="module")
def small():
    """A 4-token Llama (two layers) and a prompt where every token has a successor, so prompt lookup drafts."""
    return random_model("llama", vocab=VOCAB), [BOS, 3, 0, 2, BOS, 3, 0, 2]


def cases(model) -> dict[str, tuple[str, dict, dict]]:
    """name -> (method, its parameters, the sampling settings: temperature, top_p, top_k). At temperature 3 the
    target is nearly flat, where typical acceptance passes nearly every candidate."""
    t1 = {"temperature": 1.0}
    return {
        "speculative": ("speculative", {"draft_model": noisy_copy(model, 0.05), "gamma": 2}, t1),
        "tree_top_k_top_p": ("tree", {"draft_model": noisy_copy(model, 0.05), "tree": [2, 1]},
                             {"temperature": 0.7, "top_k": 3, "top_p": 0.9}),
        "tree_flat": ("tree", {"draft_model": noisy_copy(model, 0.05), "tree": [2, 2]}, {"temperature": 3.0}),
        "prompt_lookup": ("prompt_lookup", {"num_draft_tokens": 2, "max_ngram": 2}, t1),
        "lookahead": ("lookahead", {"window": 2, "ngram": 3, "guesses": 3, "pool_from_prompt": True}, t1),
        "ouroboros": ("ouroboros", {"draft_model": noisy_copy(model, 0.05), "gamma": 1, "window": 2, "ngram": 2,
                                    "phrases": 2}, t1),
        "medusa_chain": ("medusa", {"heads": medusa(model), "tree": [1, 1]}, t1),
        "chimera_tree": ("chimera", {"heads": chimera(model), "tree": [2, 1]}, t1),
        "dflash_chain": ("dflash", {"heads": dflash(model, block_size=3)}, t1),
        "eagle3_dynamic": ("eagle3", {"heads": eagle3(model, vocab=VOCAB), "depth": 2, "top_k": 2,     # the tree's
                                      "total_tokens": 4}, t1),                                         # top-k
        "typical_tree": ("tree", {"draft_model": noisy_copy(model, 0.05), "tree": [2, 2], "acceptance": "typical"},
                         {"temperature": 3.0}),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["speculative", "tree_top_k_top_p", "tree_flat", "prompt_lookup", "lookahead",
                                  "ouroboros", "medusa_chain", "chimera_tree", "dflash_chain",
                                  "eagle3_dynamic", "typical_tree"])
def test_a_decoder_samples_the_targets_distribution_exactly(small, name):
    """1000 decodes of 3 tokens (64 outcomes): an exact sampler stays within the threshold (0.171) but with
    probability 1e-6; typical acceptance, on the nearly flat target, does not. Every drafting step drafts."""
    model, prompt = small
    method, params, sampling = cases(model)[name]
    exact = exact_continuations(model, prompt, **sampling)
    decoder = DECODERS[method](model, seed=0, **params, **sampling)
    n = 1000
    counts, drafted = sampled_continuations(decoder, prompt, n)
    tv, eps = total_variation(counts, exact, n), tv_threshold(len(exact), n)
    lossless = params.get("acceptance") != "typical"
    assert (tv < eps) == lossless, (name, tv, eps)
    assert drafted > n / 2, name          # drafting steps, not AR sampling in disguise
