"""Export the trained model with ``save_pretrained``, whatever strategy trained it.

The exported part alone (a fine-tuned model, heads, maps, a draft; never a frozen base) is taken onto rank 0's CPU one
submodule at a time, in the export's dtype (``export_dtype``, by default the model's own, whatever the strategy and
precision): under DeepSpeed from its fp32 masters, under FSDP2 gathered, elsewhere the live weights. No scratch
checkpoint is written, and rank 0 holds the export once: ``save_pretrained`` writes it through a weightless copy.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from lit_spec.errors import ConfigError
from lit_spec.io import atomic_dir, check_writable, write_json
from lit_spec.precision import export_dtype
from lit_spec.strategies import is_deepspeed, weights_sharded, whole_weights

MARK = "lit_spec_export.json"        # in every export: what wrote it; only a directory holding one is replaced


def check_export_dir(directory: str | Path) -> None:
    """``export_dir`` is new, empty or an earlier export of ours (which the export replaces), and can be written:
    checked before training, and again just before the export replaces it."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"export_dir={directory} is a file: give a directory (new, empty or an earlier export)")
    held = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    if held and MARK not in held:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise ConfigError(f"export_dir={directory} holds files that no export of ours wrote ({shown}); an export "
                          "replaces only an earlier export: choose a new or empty directory")
    check_writable(directory.parent, "export_dir (its parent)")


def exported_state(trainer: L.Trainer, module, dtype: torch.dtype) -> dict | None:
    """The exported part's whole state dict on rank 0's CPU, its floating tensors in ``dtype``, taken one submodule at
    a time (``whole_weights``): DeepSpeed's fp32 masters where it keeps them, gathered where the weights are sharded,
    the live tensors elsewhere (copied only to change device or dtype). Rank 0 never holds more than the export. None
    on the other ranks; every rank calls it, while the strategy still holds the model (before its teardown)."""
    part = getattr(module, module.exported)
    taken = {}     # by parameter: a tied one (embeddings and LM head) is taken once, and stays shared
    if is_deepspeed(trainer.strategy) or weights_sharded(trainer.strategy):
        for _, param, tensor in whole_weights(part, masters=True):
            if id(param) not in taken:
                # a copy: a gathered tensor's storage is DeepSpeed's to reuse once the next submodule is gathered
                taken[id(param)] = tensor.detach().to("cpu", dtype, copy=True) if trainer.is_global_zero else None
    state = {}
    for key, value in part.state_dict(keep_vars=True).items():
        if id(value) not in taken:   # buffers, and every weight where nothing is sharded
            keep = dtype if value.is_floating_point() else value.dtype
            taken[id(value)] = value.detach().to("cpu", keep) if trainer.is_global_zero else None
        state[key] = taken[id(value)]
    return state if trainer.is_global_zero else None


def export_pretrained(trainer: L.Trainer, module, directory: str | Path, dtype: str = "auto") -> Path | None:
    """Write ``module.export`` atomically into ``directory`` in ``dtype`` (``export_dtype``; ``auto``: the exported
    model's own); returns it on rank 0."""
    directory = Path(directory)
    state = exported_state(trainer, module, export_dtype(dtype, module.exported_spec))
    trainer.strategy.barrier("export")
    if not trainer.is_global_zero:
        return None
    check_export_dir(directory)      # nothing of the user's may have appeared there while training
    with atomic_dir(directory) as tmp:
        module.export(tmp, state)
        write_json(tmp / MARK, {"method": type(module).__name__, "global_step": trainer.global_step,
                                "run": str(trainer.default_root_dir)})
    return directory
