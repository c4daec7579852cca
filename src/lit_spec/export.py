"""Export the trained model with ``save_pretrained``, whatever strategy trained it.

Replicated weights (single device, DDP, DeepSpeed ZeRO-1/2) are saved straight from rank 0. Sharded weights are
first consolidated: DeepSpeed ZeRO-3 through a checkpoint and DeepSpeed's own
``convert_zero_checkpoint_to_fp32_state_dict``, FSDP2 (``ModelParallelStrategy``) by gathering the full state dict
onto rank 0's CPU; rank 0 writes from that.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

from lit_spec.errors import ConfigError
from lit_spec.io import atomic_dir, check_writable, write_json
from lit_spec.strategies import weights_sharded

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


def consolidated_state_dict(trainer: L.Trainer, scratch: Path) -> dict | None:
    """The full state dict of the LightningModule's sharded weights on rank 0 (None elsewhere); every rank calls it."""
    strategy = trainer.strategy
    if isinstance(strategy, DeepSpeedStrategy):
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        trainer.save_checkpoint(scratch / "zero")
        if trainer.is_global_zero:
            convert_zero_checkpoint_to_fp32_state_dict(scratch / "zero", scratch / "full.ckpt")
            return torch.load(scratch / "full.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    elif isinstance(strategy, ModelParallelStrategy):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(trainer.lightning_module, options=StateDictOptions(full_state_dict=True,
                                                                                         cpu_offload=True))
        return state if trainer.is_global_zero else None
    return None


def export_pretrained(trainer: L.Trainer, module, directory: str | Path) -> Path | None:
    """Write ``module.export`` atomically into ``directory``; returns it on rank 0."""
    directory = Path(directory)
    scratch = directory.parent / f".{directory.name}-consolidate"
    state = consolidated_state_dict(trainer, scratch) if weights_sharded(trainer.strategy) else None
    trainer.strategy.barrier("export")
    if not trainer.is_global_zero:
        return None
    check_export_dir(directory)      # nothing of the user's may have appeared there while training
    with atomic_dir(directory) as tmp:
        module.export(tmp, state_dict=state)
        write_json(tmp / MARK, {"method": type(module).__name__, "global_step": trainer.global_step,
                                "run": str(trainer.default_root_dir)})
    shutil.rmtree(scratch, ignore_errors=True)
    return directory
