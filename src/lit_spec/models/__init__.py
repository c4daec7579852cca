from lit_spec.models.spec import HFModelSpec
from lit_spec.models.stage import StageModelSpec
from lit_spec.models.tiny import TinyModelSpec, train_bpe_tokenizer

__all__ = ["HFModelSpec", "StageModelSpec", "TinyModelSpec", "spec_from_dict", "train_bpe_tokenizer"]


def spec_from_dict(d: dict) -> HFModelSpec:
    """Rebuild a spec from ``HFModelSpec.to_dict()`` (used when a method is restored from a checkpoint)."""
    import dataclasses
    import importlib

    module, _, name = d["class"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{k: v for k, v in d.items() if k in names})
