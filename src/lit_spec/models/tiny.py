"""The tiny offline model: a small Llama built from a config, with a byte-level BPE tokenizer trained by the
``tokenizers`` library on the stdlib-code corpus. Both are written with ``save_pretrained``, so everything downstream
loads them through the same path as any hub model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lit_spec.io import atomic_dir
from lit_spec.models.spec import HFModelSpec

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (lossless on any text, code whitespace included); prepends ``<s>`` like Llama."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def stdlib_corpus() -> list[str]:
    """The texts the tiny tokenizer learns from: docstrings and code of the stdlib-code *train* split."""
    from lit_spec.data.sources import StdlibCodeSource

    train = StdlibCodeSource().load()["train"]
    return [t for r in train for t in (r["docstring"], r["code"])]


@dataclass
class TinyModelSpec(HFModelSpec):
    """A randomly initialised Llama-architecture model + its BPE tokenizer. The ``tiny_base`` stage
    (``lit_spec.stages``) builds it with ``build_tiny_model`` into a directory keyed by ``architecture()`` and sets
    ``name_or_path`` to it; changing any size builds a new model."""

    name_or_path: str = ""
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    seed: int = 0
    dtype: str = "float32"

    def architecture(self) -> dict:
        """What the weights depend on (not where they live or how they are loaded)."""
        loading = {f.name for f in fields(HFModelSpec)}
        return {k: v for k, v in asdict(self).items() if k not in loading}


def build_tiny_model(spec: TinyModelSpec, out: Path) -> None:
    """Train the BPE tokenizer on stdlib-code, build the model from ``spec``'s architecture, save both (atomic)."""
    tokenizer = train_bpe_tokenizer(stdlib_corpus(), spec.vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
