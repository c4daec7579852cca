"""Export the trained model with ``save_pretrained``, whatever strategy trained it.

Whole full-precision weights (one device, DDP) are saved straight from rank 0. Under DeepSpeed (its fp32 masters,
not the bf16 weights) and FSDP2 the exported part alone (a fine-tuned model, heads, maps, a draft; never a frozen
base) is consolidated onto rank 0's CPU one parameter at a time, with no scratch checkpoint; rank 0 writes from that.
Either way the export is in the model's own dtype (``model.dtype``), whatever the strategy and precision.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from lit_spec.errors import ConfigError
from lit_spec.io import atomic_dir, check_writable, write_json
from lit_spec.strategies import full_precision, gathered, is_deepspeed, weights_sharded

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


def consolidated_state_dict(trainer: L.Trainer, module) -> dict | None:
    """The exported part's full state dict (keys ``<exported>.*``) on rank 0, one parameter gathered at a time, in
    full precision: DeepSpeed's fp32 masters where it keeps them. None elsewhere, and where the live weights are the
    whole full-precision ones already (one device, DDP, FSDP2 off). Every rank calls it."""
    strategy = trainer.strategy
    if not (is_deepspeed(strategy) or weights_sharded(strategy)):
        return None
    name, state = module.exported, {}
    for key, value in getattr(module, module.exported).state_dict(keep_vars=True).items():
        if isinstance(value, torch.nn.Parameter):
            master = full_precision(value)
            if master is None:
                with gathered([value]) as (whole,):
                    master = whole.detach().clone()
            value = master
        if trainer.is_global_zero:
            state[f"{name}.{key}"] = value.detach().to("cpu", copy=True)
    return state if trainer.is_global_zero else None


def export_pretrained(trainer: L.Trainer, module, directory: str | Path) -> Path | None:
    """Write ``module.export`` atomically into ``directory``; returns it on rank 0."""
    directory = Path(directory)
    state = consolidated_state_dict(trainer, module)
    trainer.strategy.barrier("export")
    if not trainer.is_global_zero:
        return None
    check_export_dir(directory)      # nothing of the user's may have appeared there while training
    with atomic_dir(directory) as tmp:
        module.export(tmp, state_dict=state)
        write_json(tmp / MARK, {"method": type(module).__name__, "global_step": trainer.global_step,
                                "run": str(trainer.default_root_dir)})
    return directory
