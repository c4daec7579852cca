"""Model specs: checking a save_pretrained directory or hub id, and the offline tiny model built from config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from conftest import MICRO_MODEL
from lit_spec.config import compose_config
from lit_spec.stages import ensure_stages, find_stages
from lit_spec.errors import ConfigError
from lit_spec.models import HFModelSpec, StageModelSpec, TinyModelSpec, spec_from_dict, train_bpe_tokenizer
from lit_spec.models import tiny

CODE = ("class Stack:\n    def push(self, x):\n\tself.items.append(x)  # tab-indented\n\n\n"
        "    def pop(self) -> int:\n        return self.items.pop()   \n# ünïcode, emoji 🐍, \\n literal\n")


def save_llama(out: Path, tokenizer, vocab_size: int) -> Path:
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def bpe():
    return train_bpe_tokenizer(["def f(x):\n    return x\n", "hello world, hello models"] * 4, vocab_size=300)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, bpe) -> Path:
    """A random Llama with a tokenizer that ships no pad token (like Llama-2)."""
    no_pad = PreTrainedTokenizerFast(tokenizer_object=bpe.backend_tokenizer, bos_token="<s>", eos_token="</s>")
    return save_llama(tmp_path_factory.mktemp("llama"), no_pad, vocab_size=len(bpe))


def micro_spec(*overrides: str, built: bool = False) -> TinyModelSpec:
    """The micro tiny model's spec, its path filled in by the tiny_base stage (built first when ``built``)."""
    cfg = compose_config([*MICRO_MODEL, *overrides])
    (ensure_stages if built else find_stages)(cfg.model)
    return instantiate(cfg.model, _convert_="all")


# ---- HFModelSpec ------------------------------------------------------------------------------------------------
def test_hf_spec_validates_and_loads_a_local_directory(llama_dir):
    spec = HFModelSpec(name_or_path=str(llama_dir), dtype="bfloat16", attn_implementation="eager")
    spec.validate()
    tokenizer = spec.load_tokenizer()
    assert tokenizer.pad_token_id == tokenizer.eos_token_id, "a tokenizer without pad token pads with EOS"
    model = spec.load_model()
    assert isinstance(model, LlamaForCausalLM) and model.dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    assert HFModelSpec(name_or_path=str(llama_dir), dtype="float32").load_model().dtype == torch.float32


def test_hf_spec_through_the_hf_config(llama_dir):
    spec = instantiate(compose_config(["model=hf", f"model.name_or_path={llama_dir}"]).model, _convert_="all")
    assert type(spec) is HFModelSpec and spec.name_or_path == str(llama_dir) and spec.dtype == "auto"
    spec.validate()


def test_hf_spec_without_weights_or_with_other_sizes_is_one_clear_error(tmp_path, bpe):
    import json

    save_llama(tmp_path, bpe, vocab_size=len(bpe))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"vocab_size": len(bpe) + 8}))
    with pytest.raises(ConfigError, match="weights do not fit its config.json"):
        HFModelSpec(name_or_path=str(tmp_path)).load_model()
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="config.json but no weights"):
        HFModelSpec(name_or_path=str(tmp_path)).validate()


def test_hf_spec_keeps_the_first_layers(tmp_path, bpe):
    """keep_layers=N: the model's first N layers, embeddings, final norm and LM head, with their weights."""
    config = LlamaConfig(vocab_size=len(bpe), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    full = LlamaForCausalLM(config)
    full.save_pretrained(tmp_path)
    bpe.save_pretrained(tmp_path)
    spec = HFModelSpec(name_or_path=str(tmp_path), dtype="float32", keep_layers=2)
    spec.validate()
    cut = spec.load_model()
    assert len(cut.model.layers) == cut.config.num_hidden_layers == 2
    kept = cut.state_dict()
    assert kept and all(torch.equal(v, full.state_dict()[k]) for k, v in kept.items())
    assert set(full.state_dict()) - set(kept) == {k for k in full.state_dict() if k.startswith("model.layers.2.")}
    with pytest.raises(ConfigError, match="only 3 layers"):
        HFModelSpec(name_or_path=str(tmp_path), keep_layers=4).validate()
    with pytest.raises(ConfigError, match="keep_layers"):
        HFModelSpec(name_or_path=str(tmp_path), keep_layers=0)


@pytest.mark.parametrize("relative", [False, True])
def test_hf_spec_missing_local_directory(tmp_path, monkeypatch, relative):
    monkeypatch.chdir(tmp_path)
    missing = "./no_such_model" if relative else str(tmp_path / "no_such_model")
    with pytest.raises(ConfigError, match="no such directory") as e:
        HFModelSpec(name_or_path=missing).validate()
    assert f"model.name_or_path={missing}" in str(e.value)


def test_hf_spec_directory_without_config(tmp_path, bpe):
    bpe.save_pretrained(tmp_path)  # a tokenizer, but no model
    with pytest.raises(ConfigError, match="without config.json") as e:
        HFModelSpec(name_or_path=str(tmp_path)).validate()
    assert str(tmp_path) in str(e.value)


def test_hf_spec_hub_id_offline():
    with pytest.raises(ConfigError) as e:
        HFModelSpec(name_or_path="no-such-org/no-such-model").validate()
    msg = str(e.value)
    assert "no-such-org/no-such-model" in msg and "download" in msg and "model.name_or_path" in msg


def test_hf_spec_tokenizer_larger_than_the_model(tmp_path, bpe):
    small = save_llama(tmp_path / "small", bpe, vocab_size=len(bpe) - 10)
    with pytest.raises(ConfigError, match=rf"has {len(bpe)} tokens but the model's embedding has {len(bpe) - 10}"):
        HFModelSpec(name_or_path=str(small)).validate()
    # a model with spare embedding rows (padded vocabularies are common) is fine
    HFModelSpec(name_or_path=str(save_llama(tmp_path / "big", bpe, vocab_size=len(bpe) + 64))).validate()


@pytest.mark.parametrize("dtype", ["int8", "float64", "half", ""])
def test_bad_dtype(llama_dir, dtype):
    with pytest.raises(ConfigError, match="model.dtype") as e:
        HFModelSpec(name_or_path=str(llama_dir), dtype=dtype)
    assert repr(dtype) in str(e.value) and "bfloat16" in str(e.value)
    with pytest.raises(ConfigError, match="model.dtype"):
        TinyModelSpec(cache_dir=str(llama_dir), dtype=dtype)


# ---- TinyModelSpec ----------------------------------------------------------------------------------------------
def test_tiny_stage_builds_a_standard_checkpoint_and_reuses_it(stage_cache, monkeypatch):
    spec = micro_spec()
    out = Path(spec.name_or_path)
    assert out.parent == stage_cache and out.name.startswith("tiny_base-")
    with pytest.raises(ConfigError, match="name_or_path is empty"):      # a spec whose stage was not resolved
        TinyModelSpec(cache_dir=str(stage_cache)).validate()
    assert micro_spec(built=True) == spec
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    spec.validate()

    # the same path as model=hf: plain transformers loading, nothing lit_spec-specific
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert isinstance(model, LlamaForCausalLM)
    c = model.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads) == (32, 64, 2, 2, 2)
    assert c.vocab_size == len(tokenizer) <= 512
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3
    hf = HFModelSpec(name_or_path=str(out))
    hf.validate()
    assert hf.load_model().config.to_dict() == c.to_dict()

    # lossless on code: indentation, tabs, blank lines, trailing spaces, non-ASCII; BOS first, no EOS
    ids = tokenizer(CODE)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.eos_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == CODE
    assert tokenizer.decode(tokenizer(CODE, add_special_tokens=False)["input_ids"]) == CODE
    assert len(ids) < len(CODE.encode()), "the BPE merges learned something"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), c.vocab_size)

    # the stage again (a fresh spec of the same architecture) reuses the cache: no rebuild
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the tiny_base stage rebuilt a cached tiny model")

    monkeypatch.setattr(tiny, "train_bpe_tokenizer", no_rebuild)
    monkeypatch.setattr(tiny, "stdlib_corpus", no_rebuild)
    again = micro_spec(built=True)
    assert again.name_or_path == spec.name_or_path
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps


def test_tiny_name_follows_the_architecture():
    base = micro_spec()
    for override in ["model.hidden_size=64", "model.num_hidden_layers=3", "model.vocab_size=1024",
                     "model.tie_word_embeddings=false", "model.seed=1", "model.max_position_embeddings=512"]:
        changed = micro_spec(override)
        assert changed.name_or_path != base.name_or_path, override
        assert Path(changed.name_or_path).parent == Path(base.name_or_path).parent
    # how a model is loaded or trained is not its architecture: same weights, same directory
    for override in ["model.dtype=bfloat16", "model.attn_implementation=eager", "model.gradient_checkpointing=true"]:
        assert micro_spec(override).name_or_path == base.name_or_path, override
    assert micro_spec("model.cache_dir=/elsewhere").name_or_path.startswith("/elsewhere/tiny_base-")


def test_a_stage_models_seed_builds_another_model(stage_cache):
    """model.seed of model=tiny_target is the initial-weights seed of the model its experiment pretrains: that
    experiment's own seed names the same cache entry as null, another seed another entry, and the default's
    trajectories follow it (keys only: nothing is built)."""
    def stage(*overrides):
        target = find_stages(compose_config(["model=tiny_target", *overrides]).model)[-1]
        return target.output.name, target.config.model.seed

    own = compose_config(["+experiment=tiny_target"]).model.seed
    assert stage() == stage(f"model.seed={own}") == stage("model.seed=null") == (stage()[0], own)
    other, seed = stage(f"model.seed={own + 1}")
    assert seed == own + 1 and other != stage()[0] and other.startswith("tiny_target-")
    assert f"model.seed={own + 1}" in compose_config([f"model.seed={own + 1}"]).data.collect


def test_spec_round_trips_through_a_dict(llama_dir):
    specs = [micro_spec("model.dtype=bfloat16", "model.gradient_checkpointing=true"),
             HFModelSpec(name_or_path=str(llama_dir), dtype="float16", attn_implementation=None, revision="main"),
             StageModelSpec(name_or_path=str(llama_dir), cache_dir=str(llama_dir))]
    for spec in specs:
        d = spec.to_dict()
        assert d["class"] == f"{type(spec).__module__}.{type(spec).__qualname__}"
        back = spec_from_dict(d)
        assert type(back) is type(spec) and back == spec
        assert back.to_dict() == d
