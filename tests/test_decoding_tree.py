"""Tree verification: ``TreeSpec`` structure, greedy acceptance, token identity with ``model.generate`` on three
architectures for several tree shapes, accepted-path KV kept, more than one token per forward with a perfect draft;
typical acceptance at temperature > 0."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from random_models import (ARCHS, check_cache_after_each_commit, greedy_with_mid_output_eos, noisy_copy, random_model,
                           random_prompts, reference_greedy)

from lit_spec.decoding import generate
from lit_spec.decoding.tree import TreeSpec
from lit_spec.decoding.verify import TypicalAcceptance, greedy_tree_accepts, tree_accept_path
from lit_spec.errors import ConfigError

MEDUSA_LIKE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]
SHAPES = {"chain3": [1, 1, 1], "topk221": [2, 2, 1], "wide4": [4], "medusa_like": MEDUSA_LIKE}




def test_tree_spec_structure():
    spec = TreeSpec.from_topk([2, 2])
    assert spec.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1))
    assert spec.parents == [-1, -1, 0, 0, 1, 1]
    assert spec.depths == [1, 1, 2, 2, 2, 2] and spec.ranks == [0, 1, 0, 1, 0, 1]
    assert spec.depth == 2 and spec.top_k == 2 and len(spec) == 6
    assert spec.block_parents == [-1, 0, 0, 1, 1, 2, 2]

    medusa = TreeSpec.from_paths([(1, 0), (0,), (0, 0), (1,), (2,)])   # any order; sorted by depth then ranks
    assert medusa.paths == ((0,), (1,), (2,), (0, 0), (1, 0))
    assert medusa.parents == [-1, -1, -1, 0, 1] and medusa.depths == [1, 1, 1, 2, 2]
    assert medusa.top_k == 3 and medusa.depth == 2
    assert TreeSpec.chain(3).parents == [-1, 0, 1]

    # the same tree from a list of ints, a list of paths, or Hydra's ListConfig
    assert TreeSpec.parse([2, 2]) == spec == TreeSpec.parse(OmegaConf.create([2, 2]))
    assert TreeSpec.parse(OmegaConf.create([[0], [1], [2], [0, 0], [1, 0]])) == medusa
    assert medusa.truncated(1).paths == ((0,), (1,), (2,)) and len(medusa.truncated(0)) == 0

    # candidates per position [depth, k] -> one token per node: node (r1, .., rd) takes rank rd at depth d
    top = torch.tensor([[10, 11, 12], [20, 21, 22]])
    assert medusa.build_candidates(top).tolist() == [10, 11, 12, 20, 20]
    assert spec.build_candidates(top).tolist() == [10, 11, 20, 21, 20, 21]
    with pytest.raises(ValueError, match="candidates of shape"):
        medusa.build_candidates(top[:1])

    for bad in ([[0, 1]], [[0], [-1]], [0, 2], []):
        with pytest.raises(ConfigError):
            TreeSpec.parse(bad)


def test_tree_accept_path():
    # block: root(pending) 0, depth-1 nodes 1,2; node 3 under 1, node 4 under 2, node 5 under 4
    parents = [-1, 0, 0, 1, 2, 4]
    tokens = [9, 5, 6, 7, 8, 4]

    def greedy(target):
        return tree_accept_path(parents, greedy_tree_accepts(parents, tokens, target))

    # target argmax at each position: after root 6 (node 2 ok), after node 2 -> 8 (node 4 ok), after node 4 -> 4
    assert greedy([6, 0, 8, 0, 4, 3]) == [2, 4, 5]
    assert greedy([5, 7, 0, 1, 0, 0]) == [1, 3]                                   # the other branch
    assert greedy([1, 1, 1, 1, 1, 1]) == []                                       # nothing matches
    assert tree_accept_path([-1, 0, 0], [False, True, True]) == [1]              # tie: first in block order
    assert tree_accept_path(parents, [False, False, True, True, False, True]) == [2]   # node 3's parent failed


def test_typical_acceptance_threshold():
    """p(x) > min(epsilon, delta * exp(-H)): a confident parent (low entropy) accepts only its likely tokens, a
    flat one (high entropy, lower threshold) accepts a token that a confident one would reject."""
    typical = TypicalAcceptance(temperature=1.0, epsilon=0.09, delta=0.3)
    probs = torch.tensor([[0.90, 0.05, 0.05, 0.00],     # root: H = 0.39, threshold min(0.09, 0.20) = 0.09
                          [0.25, 0.25, 0.25, 0.25],     # node 1: H = ln 4, threshold min(0.09, 0.075) = 0.075
                          [0.00, 0.00, 0.00, 1.00],
                          [0.00, 0.00, 0.00, 1.00]])
    parents, tokens = [-1, 0, 0, 1], [2, 0, 1, 3]
    accepted = typical.accepts(probs, parents, tokens)
    assert accepted == [False, True, False, True]
    assert tree_accept_path(parents, accepted) == [1, 3]
    assert typical.accepts(probs, [-1, 0], [0, 3]) == [False, False]               # p = 0 never passes
    for bad in ({"temperature": 0.0}, {"temperature": 1.0, "epsilon": 0.0}, {"temperature": 1.0, "delta": -1.0}):
        with pytest.raises(ConfigError):
            TypicalAcceptance(**bad)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_to_generate(models, arch):
    target = models[arch]
    drafts = {"independent": random_model(arch, seed=7, layers=1, hidden=32), "noisy": noisy_copy(target, 0.01)}
    accepted = drafted = 0
    for p, (length, new) in enumerate([(5, 19), (10, 13)]):
        ids, mask = random_prompts(1, [length], seed=200 + 10 * ARCHS.index(arch) + p)
        ref = reference_greedy(target, ids, mask, new)
        for kind, draft in drafts.items():
            for name, tree in SHAPES.items():
                out = generate(target, ids, "tree", max_new_tokens=new, draft_model=draft, tree=tree)
                assert torch.equal(out.sequences, ref), (kind, name, p)
                s = out.stats
                assert s.new_tokens == new and s.draft_forwards > 0
                assert s.mean_accepted == pytest.approx(new / s.target_forwards)
                if kind == "noisy":
                    accepted, drafted = accepted + s.accepted_tokens, drafted + s.drafted_tokens
    assert 0 < accepted < drafted


@pytest.mark.parametrize("name", list(SHAPES))
def test_perfect_draft_accepts_the_top1_path(models, name):
    """Draft = target: the top-1 path is always right, so every forward but the last commits depth + 1 tokens."""
    target = models["llama"]
    spec = TreeSpec.parse(SHAPES[name])
    ids, mask = random_prompts(1, [7], seed=4)
    new = 1 + 3 * (spec.depth + 1)          # the prefill's token, then three full paths
    out = generate(target, ids, "tree", max_new_tokens=new, draft_model=target, tree=SHAPES[name])
    assert torch.equal(out.sequences, reference_greedy(target, ids, mask, new))
    s = out.stats
    assert s.target_forwards == 4 and s.acceptance_rate == 1.0
    assert s.accepted_per_forward == [1] + [spec.depth + 1] * 3 and s.mean_accepted > 1


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_eos_inside_accepted_path(models, arch):
    target = models[arch]
    ids, mask = random_prompts(1, [6], seed=15 + ARCHS.index(arch))
    k, eos, ref = greedy_with_mid_output_eos(target, ids, mask, 40, not_before=6)
    for tree in ([3, 1, 1, 1, 1], MEDUSA_LIKE):
        for draft in (target, noisy_copy(target, 0.01)):
            out = generate(target, ids, "tree", max_new_tokens=40, eos_token_id=eos, draft_model=draft, tree=tree)
            assert out.sequences[0, ids.size(1):].tolist() == ref


def test_cache_keeps_only_the_accepted_path(models, monkeypatch):
    """After every tree verification the target's cache equals the cache of the committed tokens but the pending one:
    the accepted path's entries, moved together; the rejected branches gone."""
    target = models["mistral"]
    draft = noisy_copy(target, 0.01)
    ids, _ = random_prompts(1, [8], seed=6)
    checked = check_cache_after_each_commit(monkeypatch, target, ids[0].tolist())
    out = generate(target, ids, "tree", max_new_tokens=30, draft_model=draft, tree=MEDUSA_LIKE)
    assert len(checked) >= 5 and max(checked) > 2    # paths of several nodes were kept, not only the root
    assert 0 < out.stats.accepted_tokens < out.stats.drafted_tokens


def test_custom_candidate_source(models):
    """Later methods plug in their own candidates(state, depth, k) -> [depth, k]: here an oracle that knows the
    reference continuation (rank 0) plus a wrong rank 1: every path is accepted, no draft model needed."""
    target = models["qwen2"]
    ids, mask = random_prompts(1, [6], seed=8)
    ref = reference_greedy(target, ids, mask, 21)[0, ids.size(1):]
    calls = []

    def oracle(state, depth, k):
        done = len(state.out[0])
        calls.append((depth, k))
        right = ref[done: done + depth]
        return torch.stack([right, (right + 1) % target.config.vocab_size], 1)[:, :k]

    out = generate(target, ids, "tree", max_new_tokens=21, candidates=oracle, tree=[2, 1, 1, 1])
    assert out.sequences[0, ids.size(1):].tolist() == ref.tolist()
    assert out.stats.target_forwards == 5 and out.stats.draft_forwards == 0    # 1 + 4 x (4 + 1) tokens
    assert calls == [(4, 2)] * 4


def test_errors(models):
    target = models["llama"]
    ids, _ = random_prompts(1, [6])
    with pytest.raises(ConfigError, match="draft_model"):
        generate(target, ids, "tree")
    with pytest.raises(ConfigError, match="vocabulary"):
        generate(target, ids, "tree", draft_model=random_model("llama", vocab=64))
    with pytest.raises(ConfigError, match="temperature"):
        generate(target, ids, "tree", draft_model=target, temperature=-0.7)
    with pytest.raises(ConfigError, match="posterior_threshold"):
        generate(target, ids, "tree", draft_model=target, temperature=0.7, acceptance="typical", posterior_threshold=0)
    with pytest.raises(ConfigError, match="acceptance='greedy'"):
        generate(target, ids, "tree", draft_model=target, temperature=0.7, acceptance="greedy")
    with pytest.raises(ConfigError, match="acceptance=rejection"):
        generate(target, ids, "tree", draft_model=target, temperature=0.7, acceptance="typical", top_p=0.9)
    with pytest.raises(ConfigError, match="lacks its parent"):
        generate(target, ids, "tree", draft_model=target, tree=[[0], [1, 0]])
    batch, mask = random_prompts(2, [4, 6])
    with pytest.raises(ConfigError, match="batch size 1"):
        generate(target, batch, "tree", attention_mask=mask, draft_model=target)


def test_typical_acceptance_decoding(models):
    """Temperature > 0: reproducible with a seed and accepting drafts; with a threshold no token can pass (epsilon 1)
    every step commits one token sampled from the target, i.e. AR sampling with the same seed; near temperature 0
    the target's distributions are one-hot and the output is the greedy one."""
    target = models["llama"]
    draft = noisy_copy(target, 0.01)
    ids, mask = random_prompts(1, [7], seed=21)

    def tree(**kw):
        return generate(target, ids, "tree", max_new_tokens=24, draft_model=draft, tree=MEDUSA_LIKE,
                        acceptance="typical", **kw)

    sampled = tree(temperature=1.0, seed=3)
    assert torch.equal(sampled.sequences, tree(temperature=1.0, seed=3).sequences)
    assert sampled.stats.new_tokens == 24 and sampled.stats.mean_accepted > 1
    assert not torch.equal(sampled.sequences, reference_greedy(target, ids, mask, 24))
    nothing_passes = tree(temperature=1.0, seed=3, posterior_threshold=1.0, posterior_alpha=1e9)
    assert nothing_passes.stats.accepted_tokens == 0
    ar = generate(target, ids, "ar", max_new_tokens=24, temperature=1.0, seed=3)
    assert torch.equal(nothing_passes.sequences, ar.sequences)
    assert torch.equal(tree(temperature=1e-4, seed=3).sequences, reference_greedy(target, ids, mask, 24))
