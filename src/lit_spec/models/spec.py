"""What a config's ``model`` group builds: a *spec* that knows where a causal LM lives and how to load it.

Methods receive the spec, not the model, and load the weights in ``LightningModule.configure_model`` so that
DeepSpeed ZeRO-3 / FSDP can shard the initialisation.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lit_spec.config import config_hash
from lit_spec.errors import ConfigError

log = logging.getLogger(__name__)

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
ATTENTION = (None, "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
# the sizes a model's weights depend on: a checkpoint saved at other sizes cannot load into it
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads")
DTYPES = {"auto": "auto", "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def model_shape(config) -> dict:
    """``SHAPE_KEYS`` of a transformers config (the ones it has)."""
    return {k: getattr(config, k) for k in SHAPE_KEYS if getattr(config, k, None) is not None}


def damaged_weights(directory: Path) -> str | None:
    """Why the safetensors files of a model directory cannot be read (truncated, not safetensors), else None: each
    file's header is checked against its size, which reads no weights."""
    from safetensors import safe_open

    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt"):
                pass
        except Exception as e:   # SafetensorError: truncated or overwritten; OSError: unreadable
            return f"{file.name} is damaged ({str(e).splitlines()[0]})"
    return None


@dataclass
class HFModelSpec:
    """Any ``AutoModelForCausalLM`` + tokenizer, from a hub id or a local ``save_pretrained`` directory.

    Args:
        name_or_path: hub id (``meta-llama/Llama-2-7b-hf``) or local directory.
        dtype: ``auto`` (the checkpoint's), ``float32``, ``bfloat16`` or ``float16``.
        attn_implementation: ``sdpa``, ``eager``, ``flash_attention_2`` or null for transformers' default.
        gradient_checkpointing: trade compute for activation memory while training.
        trust_remote_code: run model code shipped with the checkpoint (off unless you trust it).
        revision: hub branch, tag or commit.
        gguf_file: a GGUF file in ``name_or_path`` (a directory, a hub id, or ``pkg://<package>``: an installed
            package's directory), or an absolute path: the ``gguf`` stage (``lit_spec.stages``) de-quantises it once
            into ``cache_dir/gguf-<key>`` in ``dtype`` and points ``name_or_path`` there (``gguf_file`` is then null).
        cache_dir: where stages are cached.
        keep_layers: keep only the first this many decoder layers (with the embeddings, final norm and LM
            head): a small draft initialised from the model's own weights (``method=draft_distill``'s student);
            null: all of them.
    """

    name_or_path: str
    dtype: str = "auto"
    attn_implementation: str | None = "sdpa"
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    revision: str | None = None
    gguf_file: str | None = None
    cache_dir: str | None = None
    keep_layers: int | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype={self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.attn_implementation not in ATTENTION:
            raise ConfigError(f"model.attn_implementation={self.attn_implementation!r}: choose one of {ATTENTION}")
        layers = self.keep_layers
        if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
            raise ConfigError(f"model.keep_layers={self.keep_layers!r}: give a layer count >= 1, or "
                              "null for all of the model's layers")

    def _load_kwargs(self) -> dict:
        return {"trust_remote_code": self.trust_remote_code, "revision": self.revision}

    def validate(self) -> None:
        """Fail early, with a message, if the model cannot be found or its tokenizer does not fit it."""
        if self.gguf_file:
            raise ConfigError(f"model.gguf_file={self.gguf_file}: a GGUF model is de-quantised by its stage first "
                              "(lit_spec.stages.ensure_stages(cfg), python -m lit_spec.stages)")
        if not self.name_or_path:
            raise ConfigError("model.name_or_path is empty: a model built by a stage (model=tiny, tiny_target, ...) "
                              "gets its path from lit_spec.stages.ensure_stages(cfg) (python -m lit_spec.stages)")
        path = Path(os.path.expanduser(self.name_or_path))
        if path.is_file():
            raise ConfigError(f"model.name_or_path={self.name_or_path} is a file: point it at a save_pretrained "
                              "directory (a GGUF file: model.name_or_path=DIR model.gguf_file=NAME)")
        if path.exists():
            if not (path / "config.json").is_file():
                raise ConfigError(f"model.name_or_path={self.name_or_path}: a directory without config.json; "
                                  "point it at a save_pretrained directory")
            if not any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES):
                raise ConfigError(f"model.name_or_path={self.name_or_path}: config.json but no weights "
                                  f"({', '.join(WEIGHT_FILES)}); point it at a complete save_pretrained directory")
            damage = damaged_weights(path)
            if damage:
                raise ConfigError(f"model.name_or_path={self.name_or_path}: {damage}; save the model there again "
                                  "(save_pretrained) or point at an intact copy")
        elif self.name_or_path.startswith((".", "/", "~")):
            raise ConfigError(f"model.name_or_path={self.name_or_path}: no such directory")
        try:
            vocab = self.config_vocab_size()
            tokenizer = self.load_tokenizer()
        except (OSError, ValueError) as e:
            why = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            if path.exists():       # a local directory: nothing to download, something missing in it
                raise ConfigError(
                    f"model.name_or_path={self.name_or_path}: its config or tokenizer could not be loaded ({why}); "
                    "a model directory needs config.json and the tokenizer's files (tokenizer.json / "
                    "tokenizer_config.json): save them there with tokenizer.save_pretrained(DIR)") from e
            raise ConfigError(
                f"model '{self.name_or_path}' could not be loaded ({why}). If it is a hub id and this machine is "
                "offline, download it elsewhere (`hf download <id> --local-dir DIR`) and set model.name_or_path=DIR"
            ) from e
        if vocab is not None and len(tokenizer) > vocab:
            raise ConfigError(f"tokenizer of {self.name_or_path} has {len(tokenizer)} tokens but the model's "
                              f"embedding has {vocab}: the tokenizer does not belong to this model")

    def load_config(self):
        """The model's transformers config as this spec loads it (``keep_layers`` applied); reads config.json only."""
        config = AutoConfig.from_pretrained(self.name_or_path, **self._load_kwargs())
        layers = getattr(config, "num_hidden_layers", None)
        if self.keep_layers is not None and layers is not None:
            if self.keep_layers > layers:
                raise ConfigError(f"model.keep_layers={self.keep_layers}: {self.name_or_path} has only "
                                  f"{layers} layers")
            config.num_hidden_layers = self.keep_layers
        return config

    def identity(self) -> str:
        """What names these weights without reading them: a hash of config.json and of the weight files' names and
        sizes (a sharded checkpoint's index lists its tensors). A resumed frozen-base run checks it."""
        directory = Path(self.name_or_path)
        files = sorted(p for p in directory.glob("*") if p.suffix in (".json", ".safetensors", ".bin", ".gguf")
                       and not p.name.startswith(("tokenizer", "special_tokens", "generation_config")))
        listing = [(p.name, p.read_text() if p.suffix == ".json" else p.stat().st_size) for p in files]
        return config_hash({"name_or_path": self.name_or_path if not directory.is_dir() else None, "files": listing,
                            "keep_layers": self.keep_layers, "gguf_file": self.gguf_file})

    def config_vocab_size(self) -> int | None:
        """The vocabulary size the model's config names (reads config.json only, no weights)."""
        config = self.load_config()
        return getattr(config, "vocab_size", None) or getattr(config.get_text_config(), "vocab_size", None)

    def load_tokenizer(self):
        tokenizer = AutoTokenizer.from_pretrained(self.name_or_path, **self._load_kwargs())
        if tokenizer.pad_token_id is None:  # Llama-2 and friends ship none; padding is always masked anyway
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def load_model(self, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """The model in ``dtype`` (a trained model: the precision policy's), else in ``model.dtype``."""
        kwargs = self._load_kwargs() | {"dtype": dtype or DTYPES[self.dtype]}
        if self.attn_implementation:
            kwargs["attn_implementation"] = self.attn_implementation
        if self.keep_layers is not None:      # a config override: the later layers' weights are not loaded
            kwargs["num_hidden_layers"] = self.keep_layers
        try:
            model = AutoModelForCausalLM.from_pretrained(self.name_or_path, **kwargs)
        except RuntimeError as e:
            if "ignore_mismatched_sizes" not in str(e):
                raise
            raise ConfigError(f"model.name_or_path={self.name_or_path}: its weights do not fit its config.json (a "
                              "size mismatch, listed above: e.g. vocab_size); use the config the weights were saved "
                              "with") from None
        if self.gradient_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):   # transformers >= 5.2x's name for it
                model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        return model

    def to_dict(self) -> dict:
        return {"class": f"{type(self).__module__}.{type(self).__qualname__}", **asdict(self)}
