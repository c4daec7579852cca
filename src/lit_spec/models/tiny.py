"""The tiny offline model: a small Llama built from a config, with a byte-level BPE tokenizer trained by the
``tokenizers`` library on the stdlib-code corpus. Both are written with ``save_pretrained``, so everything downstream
loads them through the same path as any hub model.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lit_spec.config import cache_entry, config_hash
from lit_spec.io import atomic_dir
from lit_spec.models.spec import HFModelSpec

log = logging.getLogger(__name__)

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
    """A randomly initialised Llama-architecture model + its BPE tokenizer, built once into ``cache_dir``.

    The directory name carries a hash of the architecture, so changing any size builds a new model.
    """

    name_or_path: str = ""
    cache_dir: str = ".cache/lit_spec"
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

    def __post_init__(self):
        super().__post_init__()
        arch = {k: v for k, v in asdict(self).items() if k not in {"name_or_path", "cache_dir", "dtype",
                                                                       "attn_implementation", "gradient_checkpointing",
                                                                       "trust_remote_code", "revision"}}
        self.name_or_path = str(cache_entry(self.cache_dir, f"tiny_base-{config_hash(arch)}"))

    def prepare(self) -> None:
        out = Path(self.name_or_path)
        if (out / "config.json").is_file():
            return
        log.info("building the tiny model and training its tokenizer into %s", out)
        tokenizer = train_bpe_tokenizer(stdlib_corpus(), self.vocab_size)
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(self.seed)
        model = LlamaForCausalLM(config)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        with atomic_dir(out) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
