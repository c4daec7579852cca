"""The decoding engine core: AR token-identical to ``model.generate`` on three architectures (batched, different
prompt lengths, EOS), seeded sampling, masks, cache surgery against directly built caches, rollback, bad input."""

from __future__ import annotations

import pytest
import torch
from random_models import ARCHS, PAD, assert_same_cache, random_model, random_prompts, reference_greedy, tokens_until_eos

from lit_spec.decoding import cache as kv
from lit_spec.decoding import generate
from lit_spec.decoding.masks import attention_mask, causal, depths, from_parents
from lit_spec.decoding.state import DecodeState
from lit_spec.errors import ConfigError




# ---- AR ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_ar_batch_identical_to_generate(models, arch):
    model = models[arch]
    ids, mask = random_prompts(4, [3, 9, 6, 12], seed=ARCHS.index(arch))
    ref = reference_greedy(model, ids, mask, 20)
    out = generate(model, ids, "ar", max_new_tokens=20, attention_mask=mask)
    assert torch.equal(out.sequences, ref)
    s = out.stats
    assert s.new_tokens == 80 and s.target_forwards == 20 and s.row_forwards == 80 and s.mean_accepted == 1.0
    assert s.draft_forwards == 0 and s.wall_time > 0

    # EOS: a token row 0 produces mid-way; rows stop at different steps, the rest are padded as generate pads them
    eos = ref[0, ids.size(1) + 7].item()
    ref = reference_greedy(model, ids, mask, 20, eos_token_id=eos)
    out = generate(model, ids, "ar", max_new_tokens=20, attention_mask=mask, eos_token_id=eos)
    for r in range(ids.size(0)):
        assert tokens_until_eos(out.sequences[r], ids.size(1), eos) == tokens_until_eos(ref[r], ids.size(1), eos)
    assert out.sequences[0, ids.size(1):].tolist().index(eos) <= 7
    assert (out.sequences[0, ids.size(1) + 8:] == PAD).all()


def test_ar_sampling_reproducible_with_seed(models):
    model = models["qwen2"]
    ids, mask = random_prompts(3, [4, 8, 6], seed=3)

    def run(seed, **kw):
        return generate(model, ids, "ar", max_new_tokens=16, attention_mask=mask, temperature=0.9, seed=seed,
                        **kw).sequences

    assert torch.equal(run(5), run(5)) and not torch.equal(run(5), run(6))
    assert torch.equal(run(5, top_p=0.7), run(5, top_p=0.7))
    assert not torch.equal(run(5), reference_greedy(model, ids, mask, 16))


# ---- masks ------------------------------------------------------------------------------------------------------
def test_masks():
    assert causal(3).tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    # root 0 with children 1, 2; node 3 under 1; node 4 a second root (a parallel branch)
    parents = [-1, 0, 0, 1, -1]
    assert from_parents(parents).int().tolist() == [[1, 0, 0, 0, 0],
                                                    [1, 1, 0, 0, 0],
                                                    [1, 0, 1, 0, 0],
                                                    [1, 1, 0, 1, 0],
                                                    [0, 0, 0, 0, 1]]
    assert depths(parents) == [0, 1, 1, 2, 0]
    assert torch.equal(from_parents([-1, 0, 1, 2]), causal(4))
    with pytest.raises(ValueError, match="must come before"):
        from_parents([-1, 2, 0])

    past_valid = torch.tensor([[True, True, False], [False, True, True]])   # a hole in row 0, padding in row 1
    m = attention_mask(past_valid, causal(2), torch.float32)
    assert m.shape == (2, 1, 2, 5) and m.dtype == torch.float32
    allowed = m[:, 0] == 0
    assert allowed.tolist() == [[[True, True, False, True, False], [True, True, False, True, True]],
                                [[False, True, True, True, False], [False, True, True, True, True]]]
    assert (m[~allowed[:, None]] == torch.finfo(torch.float32).min).all()
    per_row = torch.stack([causal(2), torch.eye(2, dtype=torch.bool)])           # [B, q, q] visibility
    assert attention_mask(past_valid, per_row, torch.float16)[1, 0, 1].eq(0).tolist() == [False, True, True, False, True]


# ---- cache surgery and rollback ---------------------------------------------------------------------------------
def test_crop_and_keep_positions_match_direct_cache(models):
    model = models["mistral"]   # sliding-window cache layers: their own length bookkeeping must follow
    seq = random_prompts(1, [14], seed=2)[0][0].tolist()
    with torch.no_grad():
        cache = model(torch.tensor([seq]), use_cache=True).past_key_values
    kv.crop(cache, 9)
    assert_same_cache(cache, model, seq[:9])
    with pytest.raises(ValueError):
        kv.crop(cache, 10)

    # keep_positions: run a block after a prefix, keep offsets 0, 2, 3 -> the cache of prefix + those tokens when the
    # block was a tree whose path is 0 -> 2 -> 3 (its tokens see only their ancestors, at depth positions)
    prefix, block = seq[:6], seq[6:11]
    parents = [-1, 0, 0, 2, 3]
    state = DecodeState(model, torch.tensor([prefix]), None, 8, None)
    state.prefill()                                      # block[0] plays the pending token
    state.forward(torch.tensor([block]), from_parents(parents), torch.tensor(depths(parents)))
    state.keep_path(len(block), [0, 2, 3])
    assert_same_cache(state.cache, model, prefix + [block[0], block[2], block[3]])
    assert state.past_valid.shape == (1, 9) and state.past_valid.all()


@pytest.mark.parametrize("keep", [[0], [0, 1, 2], [0, 2, 3], [0, 7, 8, 9], [0, 1, 3, 4, 5], [0, 2, 5, 6, 9],
                                  [1, 2, 3, 4], [3]])
def test_keep_positions_moves_the_kept_entries_like_a_gather(keep):
    """The slice copies (runs of consecutive offsets, overlapping ones included: [0, 1, 3, 4, 5] moves 3..5 onto
    2..4) leave exactly what gathering the kept entries would."""
    from transformers.cache_utils import DynamicLayer

    g = torch.Generator().manual_seed(1)
    layer = kv.GrowingLayer()
    layer.update(torch.randn(1, 2, 30, 4, generator=g), torch.randn(1, 2, 30, 4, generator=g))
    expected = [t[..., list(range(20)) + [20 + k for k in keep], :].clone() for t in (layer.keys, layer.values)]
    kv.keep_positions(type("C", (), {"layers": [layer]})(), 20, keep)
    assert torch.equal(layer.keys, expected[0]) and torch.equal(layer.values, expected[1])
    assert isinstance(layer, DynamicLayer) and layer.get_seq_length() == 20 + len(keep)


def test_growing_layer_equals_dynamic_layer():
    """``GrowingLayer`` (appends in place) holds what transformers' ``DynamicLayer`` holds through appends that outgrow
    its buffer, crops, in-place moves (``keep_positions``) and row selection."""
    from transformers.cache_utils import DynamicLayer

    g = torch.Generator().manual_seed(0)
    ours, theirs = kv.GrowingLayer(), DynamicLayer()

    def append(n: int) -> None:
        rows = 3 if ours.keys is None else ours.keys.size(0)
        k, v = torch.randn(rows, 2, n, 4, generator=g), torch.randn(rows, 2, n, 4, generator=g)
        for layer in (ours, theirs):
            out = layer.update(k, v)
        assert torch.equal(out[0], theirs.keys) and torch.equal(ours.keys, theirs.keys)
        assert torch.equal(ours.values, theirs.values)

    append(40)
    append(50)                                   # past the first buffer (64): regrown, old entries copied
    for layer in (ours, theirs):
        layer.crop(-7)
    append(5)
    cache_like = type("C", (), {"layers": [ours]})()
    kv.keep_positions(cache_like, 80, [0, 2, 3])  # the block's entries 80.. -> 80, 82, 83
    theirs.keys = torch.cat([theirs.keys[..., :80, :], theirs.keys[..., [80, 82, 83], :]], dim=-2)
    theirs.values = torch.cat([theirs.values[..., :80, :], theirs.values[..., [80, 82, 83], :]], dim=-2)
    assert torch.equal(ours.keys, theirs.keys)
    append(2)
    for layer in (ours, theirs):
        layer.batch_select_indices(torch.tensor([0, 2]))
    append(3)                                    # a replaced tensor becomes the new buffer
    assert ours.keys.shape == (2, 2, 88, 4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rollback_after_rejection(models, arch):
    """Batch of two: a 4-token block of which row 0 keeps 2 and row 1 keeps 3; row 0's rejected tail becomes a
    masked hole. The next step's logits equal a fresh forward of each row's accepted sequence; once row 1 finishes,
    the cache is cropped to exactly row 0's accepted prefix."""
    model = models[arch]
    ids, mask = random_prompts(2, [7, 7], seed=11)
    state = DecodeState(model, ids, mask, 8, None)
    first = state.prefill().argmax(-1)
    state.commit([[t] for t in first.tolist()], advance=[0, 0])
    guess = torch.randint(3, 90, (2, 3), generator=torch.Generator().manual_seed(0))
    block = torch.cat([state.pending[:, None], guess], 1)
    state.forward(block, causal(4))
    state.keep_prefix(4, [2, 3])
    state.commit([guess[0, :1].tolist() + [5], guess[1, :2].tolist() + [6]], advance=[2, 3])
    logits = state.forward(state.pending[:, None], causal(1))[:, -1]
    state.keep_prefix(1, [1, 1])
    with torch.no_grad():
        for r in range(2):
            seq = ids[r].tolist() + state.out[r]
            direct = model(torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(logits[r], direct, atol=1e-4, rtol=1e-4)
    # row 1 finishes (max_new_tokens reached): only row 0 stays and the shared trailing hole is cropped
    state.commit([[7], [8, 9, 10, 11]], advance=[1, 1])
    assert state.active == [0]
    state.keep_prefix(1, [1])
    assert state.past_valid.size(1) == state.cache.get_seq_length()


def test_rollback_single_row_equals_accepted_prefix(models):
    model = models["llama"]
    ids, _ = random_prompts(1, [9], seed=4)
    state = DecodeState(model, ids, None, 10, None)
    state.commit([[int(state.prefill()[0].argmax())]], advance=[0])
    block = torch.cat([state.pending, torch.tensor([40, 41, 42, 43])])[None]
    state.forward(block, causal(5))
    state.keep_prefix(5, [3])   # pending + 2 accepted, 2 rejected
    assert_same_cache(state.cache, model, ids[0].tolist() + block[0, :3].tolist())
    assert state.past_valid.shape == (1, 12)


# ---- bad input --------------------------------------------------------------------------------------------------
def test_bad_input(models):
    model = models["llama"]
    ids, mask = random_prompts(2, [4, 6])
    with pytest.raises(ConfigError, match="non-empty"):
        generate(model, ids[:, :0], "ar")
    with pytest.raises(ConfigError, match="empty"):
        generate(model, ids, "ar", attention_mask=torch.cat([mask[:1], torch.zeros_like(mask[:1])]))
    with pytest.raises(ConfigError, match="context"):
        generate(model, torch.ones(1, 510, dtype=torch.long), "ar", max_new_tokens=10)
    with pytest.raises(ConfigError, match="context"):
        generate(model, torch.ones(1, 600, dtype=torch.long), "ar", max_new_tokens=1)
    for bad in (0, -3):
        with pytest.raises(ConfigError, match="max_new_tokens"):
            generate(model, ids, "ar", max_new_tokens=bad, attention_mask=mask)
    with pytest.raises(ConfigError, match="unknown decoding method 'nope'"):
        generate(model, ids, "nope")
    for method, extra in (("ar", {}), ("speculative", {"draft_model": model}), ("tree", {"draft_model": model})):
        for bad, match in (({"temperature": -0.5}, "temperature=-0.5"), ({"temperature": "hot"}, "must be a number"),
                           ({"temperature": 1.0, "top_p": 0.0}, "top_p=0.0"), ({"top_p": 1.5}, "top_p=1.5")):
            if method == "tree" and "top_p" in bad:
                continue                        # typical acceptance has no nucleus cut
            with pytest.raises(ConfigError, match=match):
                generate(model, ids, method, **extra, **bad)


@pytest.mark.parametrize("method, params", [("ar", {}), ("jacobi", {"n_tokens": 5}),
                                            ("lookahead", {"window": 3, "ngram": 3, "guesses": 3}),
                                            ("speculative", {"gamma": 3}), ("tree", {"tree": [2, 2, 1]})])
def test_stats_are_counted_the_same_way_for_every_method(method, params):
    """One rule for all: each target forward yields one token of its own; the rest of what it commits are accepted
    proposals. So new tokens = row forwards + accepted tokens, and τ = new tokens / row forwards."""
    from lit_spec.decoding import generate
    from random_models import noisy_copy

    model = random_model("llama")
    if method in {"speculative", "tree"}:
        params = {**params, "draft_model": noisy_copy(model, 0.02)}
    ids, mask = random_prompts(1, [7], seed=3)
    eos = int(reference_greedy(model, ids, mask, 30)[0, 7 + 20])  # an EOS the output reaches mid-way
    stats = generate(model, ids, method=method, max_new_tokens=30, eos_token_id=eos, **params).stats
    assert stats.new_tokens == stats.row_forwards + stats.accepted_tokens
    assert stats.accepted_tokens <= stats.drafted_tokens
    assert stats.mean_accepted == pytest.approx(stats.new_tokens / stats.target_forwards)
    assert sum(stats.accepted_per_forward) == stats.new_tokens
    # the clock: time inside model forwards is part of the wall time; drafts only where there is a draft model
    assert 0 < stats.forward_time and stats.forward_time + stats.draft_time <= stats.wall_time
    assert (stats.draft_time > 0) == (method in {"speculative", "tree"}) == (stats.draft_forwards > 0)
    if method == "ar":
        assert stats.mean_accepted == 1.0 and stats.drafted_tokens == 0
