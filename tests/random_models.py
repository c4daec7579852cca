"""Small random-initialised causal LMs of several architectures, and transformers' own greedy decode as reference.

Every greedy decoder of ``lit_spec.decoding`` must reproduce ``reference_greedy`` token for token on each of them.
"""

from __future__ import annotations

import copy

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

ARCHS = ("llama", "qwen2", "mistral")
VOCAB, PAD, BOS, EOS = 96, 0, 1, 2

_CLASSES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "mistral": (MistralConfig, MistralForCausalLM)}


def random_model(arch: str = "llama", seed: int = 0, layers: int = 2, hidden: int = 64, vocab: int = VOCAB):
    """fp32, eval mode, sdpa attention. Weights scaled up so greedy outputs are varied (not one repeated token)."""
    config_cls, model_cls = _CLASSES[arch]
    config = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False,
                        attn_implementation="sdpa")
    torch.manual_seed(seed * 10 + ARCHS.index(arch))  # different weights per architecture
    model = model_cls(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return model.eval()


def random_prompts(batch: int, lengths: list[int] | None = None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of the given lengths (random tokens, BOS first) and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or [8] * batch
    width = max(lengths)
    ids = torch.full((batch, width), PAD, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        ids[r, width - n] = BOS
        mask[r, width - n:] = 1
    return ids, mask


def reference_greedy(model, ids, mask, max_new_tokens: int, eos_token_id: int | None = None) -> torch.Tensor:
    """transformers' own greedy ``generate`` (finished rows padded with PAD)."""
    return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=eos_token_id, pad_token_id=PAD)


def tokens_until_eos(row: torch.Tensor, prompt_len: int, eos: int | None) -> list[int]:
    """The new tokens of one output row, through the first EOS (padding after it dropped)."""
    new = row[prompt_len:].tolist()
    if eos is not None and eos in new:
        new = new[: new.index(eos) + 1]
    return new


def noisy_copy(model, scale: float, seed: int = 0):
    """The model with small Gaussian weight noise: a draft that agrees with it often but not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return draft


def assert_same_cache(cache, model, ids: list[int], atol: float = 1e-4) -> None:
    """``cache`` holds exactly the keys/values of running ``ids`` (one row, no padding) through ``model`` afresh."""
    with torch.no_grad():
        direct = model(torch.tensor([ids]), use_cache=True).past_key_values
    assert cache.get_seq_length() == len(ids)
    for got, want in zip(cache.layers, direct.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=atol, rtol=atol)
        torch.testing.assert_close(got.values, want.values, atol=atol, rtol=atol)


def check_cache_after_each_commit(monkeypatch, model, prompt: list[int]) -> list[int]:
    """Patch ``DecodeState.commit`` so that after every step (while the row decodes) the target's KV cache equals a
    fresh forward of the prompt and every committed token but the pending one, with no masked hole left (batch size
    1). Returns the list that receives each step's committed-token count."""
    from lit_spec.decoding.state import DecodeState

    checked, commit = [], DecodeState.commit

    def checked_commit(state, tokens, advance, drafted=None):
        commit(state, tokens, advance, drafted)
        if not state.finished:
            assert_same_cache(state.cache, model, prompt + state.out[0][:-1])
            assert state.past_valid.shape == (1, len(prompt) + len(state.out[0]) - 1) and state.past_valid.all()
            checked.append(len(tokens[0]))

    monkeypatch.setattr(DecodeState, "commit", checked_commit)
    return checked


def greedy_with_mid_output_eos(model, ids, mask, max_new_tokens: int, not_before: int,
                               where=lambda i: True) -> tuple[int, int, list[int]]:
    """Pick as EOS the first greedy output token that appears for the first time at position >= ``not_before`` (and
    where ``where(position)`` holds), so decoding stops mid-output. Returns (its position, the EOS token, the
    reference new tokens through that EOS)."""
    free = reference_greedy(model, ids, mask, max_new_tokens)[0, ids.size(1):].tolist()
    k = next(i for i, t in enumerate(free) if i >= not_before and where(i) and t not in free[:i])
    ref = tokens_until_eos(reference_greedy(model, ids, mask, max_new_tokens, eos_token_id=free[k])[0],
                           ids.size(1), free[k])
    assert ref[-1] == free[k] and len(ref) == k + 1
    return k, free[k], ref


def check_drafting_decoder(model, method: str, trees, **draft) -> None:
    """``method`` (``draft``: its draft) under each of ``trees`` on three prompts: token-identical to transformers'
    greedy ``generate``, drafting each time; and stopped by an EOS inside an accepted path."""
    from lit_spec.decoding import generate

    for p, (length, new) in enumerate([(3, 30), (10, 24), (6, 17)]):
        ids, mask = random_prompts(1, [length], seed=20 + p)
        ref = reference_greedy(model, ids, mask, new)
        for tree in trees:
            out = generate(model, ids, method, max_new_tokens=new, tree=tree, **draft)
            assert torch.equal(out.sequences, ref), (tree, p)
            assert out.stats.new_tokens == new and out.stats.draft_forwards > 0
    ids, mask = random_prompts(1, [5], seed=9)
    _, eos, ref = greedy_with_mid_output_eos(model, ids, mask, 30, not_before=3)
    for tree in trees:
        out = generate(model, ids, method, max_new_tokens=30, eos_token_id=eos, tree=tree, **draft)
        assert out.sequences[0, ids.size(1):].tolist()[: len(ref)] == ref, tree
