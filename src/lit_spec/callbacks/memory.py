"""``+callbacks.memory._target_=lit_spec.callbacks.MemoryMonitor``: what each rank holds under the run's strategy.

At the end of training every rank counts the bytes of model parameters it holds (a ZeRO-3 partition, an FSDP2
shard, or the whole model), of its optimizer (states, plus the fp32 master copies DeepSpeed's ZeRO optimizers keep
of their partitions), its peak resident memory and its peak CUDA memory when there is a GPU, and the median time of
a training step; it writes them to ``memory.rank<r>.json`` in the run directory and logs ``memory/*`` on rank 0.
``experiments/strategy_memory.py`` tabulates them per strategy.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from pathlib import Path

import lightning as L
import torch

MB = 2**20


def _held(t: torch.Tensor) -> int:
    """Bytes this process holds of a parameter: its ZeRO-3 partition, its FSDP2 local shard, or all of it."""
    if hasattr(t, "ds_tensor"):
        t = t.ds_tensor
    elif hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def optimizer_bytes(optimizer, model_params: set[int]) -> int:
    """States of the optimizer (through DeepSpeed's wrapper to the torch optimizer it steps), plus the parameters it
    steps that are not the model's own (ZeRO's flat fp32 partitions)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    inner = getattr(inner, "optimizer", inner)          # LightningOptimizer -> DeepSpeed ZeRO -> torch / CPU Adam
    states = sum(_held(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    masters = sum(_held(p) for g in inner.param_groups for p in g["params"] if id(p) not in model_params)
    return states + masters


class MemoryMonitor(L.Callback):
    def __init__(self):
        self.step_times: list[float] = []
        self._started = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step_times.append(time.perf_counter() - self._started)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = list(pl_module.parameters())
        report = {
            "rank": trainer.global_rank, "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "param_count": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params),
            "params_mb": sum(_held(p) for p in params) / MB,
            "optimizer_mb": sum(optimizer_bytes(o, {id(p) for p in params}) for o in trainer.optimizers) / MB,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,   # Linux reports KiB
            "step_s": statistics.median(self.step_times[1:] or self.step_times or [0.0]),   # the first one warms up
        }
        if torch.cuda.is_available():
            report["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / MB
        Path(trainer.default_root_dir, f"memory.rank{trainer.global_rank}.json").write_text(json.dumps(report))
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({f"memory/{k}": v for k, v in report.items() if isinstance(v, float)},
                                   step=trainer.global_step)
