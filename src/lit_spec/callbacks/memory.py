"""``+callbacks.memory._target_=lit_spec.callbacks.MemoryMonitor``: what each rank holds under the run's strategy.

At the end of training every rank counts the bytes of model parameters it holds (a ZeRO-3 partition, an FSDP2
shard, or the whole model), of its optimizer (states, plus the fp32 master copies DeepSpeed's ZeRO optimizers keep
of their partitions), the dtypes of the frozen and trained weights and of the optimizer's masters (the precision
policy, ``lit_spec.precision``, as it came out), the largest decoding copy the speedup callback held, its peak
resident memory and its peak CUDA memory when there is a GPU, and the median time of a training step; it writes them
to ``memory.rank<r>.json`` in the run directory and logs ``memory/*`` on rank 0. ``experiments/strategy_memory.py``
tabulates them per strategy.
"""

from __future__ import annotations

import resource
import statistics
import time
from pathlib import Path

import lightning as L
import torch

from lit_spec.callbacks.speedup import SpeedupCallback
from lit_spec.io import write_json
from lit_spec.strategies import local_tensor, resharded, whole_numel

MB = 2**20


def _bytes(t: torch.Tensor) -> int:
    t = local_tensor(t)
    return t.numel() * t.element_size()


def _storage(t: torch.Tensor) -> int:
    return local_tensor(t).untyped_storage().data_ptr()


def _dtypes(tensors) -> list[str]:
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors})


def optimizer_held(optimizer, params: list[torch.Tensor]) -> tuple[int, list[str]]:
    """Bytes of the states of the optimizer that steps (through DeepSpeed's ZeRO wrapper to the torch or CPU Adam
    inside), plus the master copies it steps that are not the model's own storage (ZeRO's fp32 partitions; none where
    the weights are fp32 already and ZeRO steps them in place); and the masters' dtypes."""
    levels = [optimizer]         # LightningOptimizer -> the configured or ZeRO optimizer -> the torch or CPU Adam
    while hasattr(levels[-1], "optimizer"):
        levels.append(levels[-1].optimizer)
    inner = levels[-1]
    states = sum(_bytes(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    # ZeRO-3 keeps its fp32 partitions on its own optimizer (the inner Adam's groups may be swapped out), ZeRO-1/2 too
    candidates = [t for level in levels for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups")
                  for t in getattr(level, name, None) or []] + [p for g in inner.param_groups for p in g["params"]]
    model = {_storage(p) for p in params if local_tensor(p).numel()}
    masters = {_storage(t): t for t in candidates if t.numel() and _storage(t) not in model}
    return states + sum(_bytes(t) for t in masters.values()), _dtypes(masters.values())


class MemoryMonitor(L.Callback):
    def __init__(self):
        self.step_times: list[float] = []
        self._started = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step_times.append(time.perf_counter() - self._started)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        resharded(pl_module)      # what is held between steps, not the root unit the last validation left whole
        params = list(pl_module.parameters())
        held = [optimizer_held(o, params) for o in trainer.optimizers]
        report = {
            "rank": trainer.global_rank, "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "param_count": sum(whole_numel(p) for p in params),
            "trainable_count": sum(whole_numel(p) for p in params if p.requires_grad),
            "params_mb": sum(_bytes(p) for p in params) / MB,
            "optimizer_mb": sum(b for b, _ in held) / MB,
            "dtypes": {"frozen": _dtypes(p for p in params if not p.requires_grad),
                       "trained": _dtypes(p for p in params if p.requires_grad),
                       "masters": sorted({d for _, dtypes in held for d in dtypes})},
            "decode_copy_mb": sum(c.copy.peak_bytes for c in trainer.callbacks if isinstance(c, SpeedupCallback)) / MB,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,   # Linux reports KiB
            "step_s": statistics.median(self.step_times[1:] or self.step_times or [0.0]),   # the first one warms up
        }
        if torch.cuda.is_available():
            report["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / MB
        write_json(Path(trainer.default_root_dir, f"memory.rank{trainer.global_rank}.json"), report)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({f"memory/{k}": v for k, v in report.items() if isinstance(v, float)},
                                   step=trainer.global_step)
