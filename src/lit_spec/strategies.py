"""Lightning's DeepSpeed strategy, also on a machine without CUDA, and with transformers' ZeRO-3 loading.

On CPU, DeepSpeed runs on its CPU accelerator with gloo between processes: slow, but the same engine, partitioning,
checkpoints and collectives as on GPUs, so a run can be validated on CPU before it goes to GPUs. Two of Lightning's
checks stand in the way and are stepped around here, nothing else: ``setup_environment`` refuses any accelerator but
CUDA, and ``setup_distributed`` wants device indices equal to the local ranks (a CPU device has none; rank r gets
``cpu:r``, which torch treats as the CPU). Under ZeRO-3 ``from_pretrained`` runs inside ``deepspeed.zero.Init``;
transformers loads into partitioned parameters only while an ``HfDeepSpeedConfig`` is alive, so one is held here.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy


class DeepSpeedStrategy(LightningDeepSpeedStrategy):
    """``lightning.pytorch.strategies.DeepSpeedStrategy`` with the same arguments; runs on CUDA or on the CPU."""

    def _on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    def setup_environment(self) -> None:
        if self._on_cpu():
            DDPStrategy.setup_environment(self)   # the parent's, less its CUDA-only guard
        else:
            super().setup_environment()

    def setup_distributed(self) -> None:
        if self._on_cpu():
            self.parallel_devices = [torch.device("cpu", rank) for rank in range(len(self.parallel_devices))]
        super().setup_distributed()

    @contextmanager
    def model_sharded_context(self):
        hf_config = None
        if self.zero_stage_3:
            from transformers.integrations import HfDeepSpeedConfig

            self._init_config_if_needed()
            hf_config = HfDeepSpeedConfig(self.config)  # transformers holds a weak reference: keep it alive here
        try:
            with super().model_sharded_context():
                yield
        finally:
            # only while the model is built: a from_pretrained after it (the export, on rank 0 alone) is not sharded
            del hf_config


def _partitioned(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if hasattr(p, "ds_id")]   # ZeRO-3 parameters carry a DeepSpeed id


@contextmanager
def whole_parameters(module: torch.nn.Module):
    """Inside, the module's ZeRO-3 partitioned parameters are whole on every rank (read-only); code that reads a
    weight directly (a slice of it, its shape) works as without ZeRO-3. Nothing happens for other parameters."""
    params = _partitioned(module)
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params):
        yield


@contextmanager
def unpartitioned_init():
    """Modules built inside are not partitioned as they are built, even within ``deepspeed.zero.Init`` (their own
    initialisation code runs on whole weights); the DeepSpeed engine partitions them when it starts."""
    from deepspeed.runtime.zero import partition_parameters as zero

    if zero.top_level_context is None:
        yield
        return
    zero.shutdown_init_context()
    try:
        yield
    finally:
        zero.restore_init_context()
