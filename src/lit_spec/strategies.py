"""Sharded training on CUDA or on the CPU: Lightning's DeepSpeed strategy without its CUDA-only guard and with
transformers' ZeRO-3 loading, FSDP2 sharding for Lightning's ``ModelParallelStrategy`` (``strategy=fsdp``), and
the one place that answers the sharding questions (is a strategy DeepSpeed, FSDP, sharding the weights, offloading
the optimizer; what a rank holds of a tensor; make some weights whole for a while; DeepSpeed's fp32 masters).

On CPU, DeepSpeed runs on its CPU accelerator with gloo between processes: slow, but the same engine, partitioning,
checkpoints and collectives as on GPUs, so a run can be validated on CPU before it goes to GPUs. Two of Lightning's
checks stand in the way and are stepped around here, nothing else: ``setup_environment`` refuses any accelerator but
CUDA, and ``setup_distributed`` wants device indices equal to the local ranks (a CPU device has none; rank r gets
``cpu:r``, which torch treats as the CPU). Under ZeRO-3 ``from_pretrained`` runs inside ``deepspeed.zero.Init``;
transformers loads into partitioned parameters only while an ``HfDeepSpeedConfig`` is alive, so one is held then.
"""

from __future__ import annotations

import fcntl
import logging
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy

from lit_spec.checkpoints import WholeDirectorySave

log = logging.getLogger(__name__)


class DeepSpeedStrategy(WholeDirectorySave, LightningDeepSpeedStrategy):
    """``lightning.pytorch.strategies.DeepSpeedStrategy`` with the same arguments, plus ZeRO-3's
    ``param_persistence_threshold`` (parameters of at most this many elements are never partitioned; DeepSpeed's
    default, 1e5, keeps a small model whole); runs on CUDA or on the CPU; checkpoints whole or not at all."""

    def __init__(self, *args, param_persistence_threshold: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if param_persistence_threshold is not None and self.config is not None:
            zero = self.config.setdefault("zero_optimization", {})
            zero["stage3_param_persistence_threshold"] = param_persistence_threshold

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
        load_ops(["ShareMemCommBuilder", *(["CPUAdamBuilder"] if offloads_optimizer(self) else [])])
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


def load_ops(builders: list[str]) -> None:
    """Load (JIT-building once) the DeepSpeed ops a run will use, one process at a time under a kernel lock.
    DeepSpeed builds them under torch's ``FileBaton``, a lock file that a process killed while holding it (a rank
    stopped mid-start, SIGKILL, the OOM killer) leaves behind, after which every later run waits on it forever.
    Under the kernel lock, released when its holder dies, no lit_spec process holds a baton, so one found is stale and
    is removed. A loaded op is cached, so DeepSpeed's own load later does not touch the baton."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import get_default_build_root

    ops = [get_accelerator().create_op_builder(name) for name in builders]
    ops = [op for op in ops if op is not None and deepspeed.ops.__compatible_ops__.get(op.NAME, False)]
    root = Path(get_default_build_root())
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "lit_spec.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        for op in ops:
            for baton in root.glob(f"*/{op.NAME}/lock"):
                log.warning("removed %s, a build lock left by a killed process (DeepSpeed would wait on it forever)",
                            baton)
                baton.unlink(missing_ok=True)
            op.load()


class FSDPStrategy(WholeDirectorySave, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (torch's FSDP2 here), its checkpoints whole or not at all."""


def fully_shard_model(model: torch.nn.Module, mesh) -> None:
    """FSDP2 over ``mesh``: every repeated block a unit of its own (a transformers model's decoder layers, named by
    its ``_no_split_modules``; otherwise the members of each ``nn.ModuleList``, e.g. draft heads), then the model as a
    whole. A model already sharded (``configure_model`` called again) is left as it is."""
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
    from transformers import PreTrainedModel

    if isinstance(model, FSDPModule):
        return
    if isinstance(model, PreTrainedModel):
        layers = set(model._no_split_modules or ())
        blocks = [m for m in model.modules() if type(m).__name__ in layers]
    else:
        blocks = [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for name in getattr(model, "forward_methods", ()):    # entry points besides forward (Chimera's head_inputs)
        register_fsdp_forward_method(model, name)


# ---- the sharding questions, asked here alone ---------------------------------------------------------------------
def _is(strategy, cls: type) -> bool:
    """``strategy`` (an instance, or a class as a config names it) is a ``cls``."""
    return isinstance(strategy, cls) or (isinstance(strategy, type) and issubclass(strategy, cls))


def is_deepspeed(strategy) -> bool:
    """DeepSpeed (any ZeRO stage): it keeps fp32 masters in its optimizer, and its checkpoints are directories."""
    return _is(strategy, LightningDeepSpeedStrategy)


def is_fsdp(strategy) -> bool:
    """FSDP2 through Lightning's ``ModelParallelStrategy`` (``strategy=fsdp``)."""
    return _is(strategy, ModelParallelStrategy)


def weights_sharded(strategy) -> bool:
    """Whether each rank holds only part of the weights (DeepSpeed ZeRO-3, FSDP2): every forward is then collective,
    so all ranks must run the same forwards, and an export must gather the weights first."""
    return is_fsdp(strategy) or (isinstance(strategy, LightningDeepSpeedStrategy) and strategy.zero_stage_3)


def offloads_optimizer(strategy) -> bool:
    """DeepSpeed ZeRO-Offload: the optimizer steps on the CPU (with DeepSpeed's own Adam)."""
    config = getattr(strategy, "config", None) or {}
    return bool(config.get("zero_optimization", {}).get("offload_optimizer"))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a tensor: its ZeRO-3 partition, its FSDP2 local shard, or itself."""
    if hasattr(t, "ds_tensor"):
        return t.ds_tensor
    return t.to_local() if _is_dtensor(t) else t


def whole_shape(param: torch.nn.Parameter) -> torch.Size:
    """A parameter's whole shape (ZeRO-3 partitions are flat and keep it in ``ds_shape``; a DTensor's is global)."""
    return getattr(param, "ds_shape", param.shape)


@contextmanager
def whole_parameters(*modules: torch.nn.Module):
    """Inside, the modules' ZeRO-3 partitioned or FSDP2 sharded parameters are whole on every rank (read-only); code
    that reads a weight directly (a slice of it, its shape) works as without sharding. Nothing happens otherwise.
    Name only the submodules that are read: each rank then holds those whole, not the model."""
    from torch.distributed.fsdp import FSDPModule

    units = list({id(m): m for module in modules for m in module.modules() if isinstance(m, FSDPModule)}.values())
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False)
    # ZeRO-3 parameters carry a DeepSpeed id; a tied one (embeddings and LM head) is gathered once
    partitioned = list({id(p): p for module in modules for p in module.parameters() if hasattr(p, "ds_id")}.values())
    try:
        if partitioned:
            import deepspeed

            with deepspeed.zero.GatheredParameters(partitioned):
                yield
        else:
            yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(True)
            unit.reshard()


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@contextmanager
def gathered(params: list[torch.nn.Parameter]):
    """Yields the whole tensors of ``params`` (ZeRO-3 partitions gathered, FSDP2 shards made full, others as they
    are), whole only inside: a caller gathers a few at a time, never the whole model."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if partitioned:
        import deepspeed

        with deepspeed.zero.GatheredParameters(partitioned):
            yield [p.data for p in params]
    else:
        yield [p.full_tensor() if _is_dtensor(p) else p.data for p in params]


def full_precision(param: torch.nn.Parameter) -> torch.Tensor | None:
    """A trained parameter's whole fp32 master where DeepSpeed keeps one apart from the (bf16) weight, gathered
    (collective under ZeRO-1/2/3: every rank calls it); None for any other parameter."""
    if not param.requires_grad or not (hasattr(param, "ds_id") or hasattr(param, "_hp_mapping")):
        return None
    from deepspeed.utils import safe_get_full_fp32_param

    return safe_get_full_fp32_param(param)


def whole_numel(param: torch.nn.Parameter) -> int:
    """A parameter's number of elements, whole (ZeRO-3 keeps it in ``ds_numel``; a DTensor's shape is global)."""
    return getattr(param, "ds_numel", None) or whole_shape(param).numel()


@torch.no_grad()
def copy_whole(source: torch.nn.Module, target: torch.nn.Module, only_trained: bool = False) -> None:
    """Copy ``source``'s weights and buffers, whole and in their own dtypes, into ``target``, a plain module of the same
    structure; one submodule's parameters are gathered at a time (collective: every rank calls it). ``only_trained``:
    the parameters that require grad (a frozen base's are copied once)."""
    params = dict(target.named_parameters(remove_duplicate=False))
    buffers = dict(target.named_buffers(remove_duplicate=False))
    for prefix, module in source.named_modules():
        dot = f"{prefix}." if prefix else ""
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad or not only_trained]
        with gathered([p for _, p in own]) as whole:
            for (name, _), tensor in zip(own, whole):
                params[dot + name].data = tensor.detach().to(params[dot + name].device, copy=True)
        for name, buffer in module.named_buffers(recurse=False):
            if dot + name in buffers:
                buffers[dot + name].data = buffer.detach().to(buffers[dot + name].device, copy=True)


@contextmanager
def unpartitioned_init():
    """Modules built inside are not partitioned as they are built, even within ``deepspeed.zero.Init`` (their own
    initialisation code runs on whole weights); the DeepSpeed engine partitions them when it starts."""
    zero = sys.modules.get("deepspeed.runtime.zero.partition_parameters")   # not imported: no zero.Init is open
    if zero is None or zero.top_level_context is None:
        yield
        return
    zero.shutdown_init_context()
    try:
        yield
    finally:
        zero.restore_init_context()
