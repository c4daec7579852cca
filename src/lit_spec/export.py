"""Export the trained model with ``save_pretrained``, whatever strategy trained it.

Replicated weights (single device, DDP, DeepSpeed ZeRO-1/2) are saved straight from rank 0. Sharded weights
(DeepSpeed ZeRO-3, FSDP) are first consolidated through a Lightning checkpoint — DeepSpeed's own
``convert_zero_checkpoint_to_fp32_state_dict`` for ZeRO-3 — and rank 0 writes from that full state dict.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

from lit_spec.io import atomic_dir


def _zero_stage(strategy) -> int:
    return int(strategy.config.get("zero_optimization", {}).get("stage", 0)) if isinstance(
        strategy, DeepSpeedStrategy) else 0


def consolidated_state_dict(trainer: L.Trainer, scratch: Path) -> dict | None:
    """Full state dict of the LightningModule on rank 0 (None elsewhere), or None if the weights are replicated."""
    strategy = trainer.strategy
    if _zero_stage(strategy) == 3:
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        trainer.save_checkpoint(scratch / "zero")
        if trainer.is_global_zero:
            convert_zero_checkpoint_to_fp32_state_dict(scratch / "zero", scratch / "full.ckpt")
            return torch.load(scratch / "full.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    elif isinstance(strategy, FSDPStrategy):
        trainer.save_checkpoint(scratch / "full.ckpt")  # FSDPStrategy(state_dict_type="full") gathers on rank 0
        if trainer.is_global_zero:
            return torch.load(scratch / "full.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    return None


def export_pretrained(trainer: L.Trainer, module, directory: str | Path) -> Path | None:
    """Write ``module.export`` atomically into ``directory``; returns it on rank 0."""
    directory = Path(directory)
    sharded = _zero_stage(trainer.strategy) == 3 or isinstance(trainer.strategy, FSDPStrategy)
    scratch = directory.parent / f".{directory.name}-consolidate"
    state = consolidated_state_dict(trainer, scratch) if sharded else None
    trainer.strategy.barrier("export")
    if not trainer.is_global_zero:
        return None
    with atomic_dir(directory) as tmp:
        module.export(tmp, state_dict=state)
    if scratch.exists():
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    return directory
