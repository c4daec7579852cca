"""Export the trained model with ``save_pretrained``, whatever strategy trained it.

Replicated weights (single device, DDP, DeepSpeed ZeRO-1/2) are saved straight from rank 0. Sharded weights are
first consolidated: DeepSpeed ZeRO-3 through a checkpoint and DeepSpeed's own
``convert_zero_checkpoint_to_fp32_state_dict``, FSDP2 (``ModelParallelStrategy``) by gathering the full state dict
onto rank 0's CPU; rank 0 writes from that.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy

from lit_spec.io import atomic_dir
from lit_spec.strategies import weights_sharded


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
    with atomic_dir(directory) as tmp:
        module.export(tmp, state_dict=state)
    if scratch.exists():
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    return directory
