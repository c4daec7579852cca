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
import os
import socket
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
    default, 1e5, keeps a small model whole) and ``zero_optimization``, any other key of DeepSpeed's section of that
    name (``stage3_max_reuse_distance``, ``stage3_prefetch_bucket_size``, ...); runs on CUDA or on the CPU;
    checkpoints whole or not at all."""

    def __init__(self, *args, param_persistence_threshold: int | None = None, zero_optimization: dict | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        if self.config is not None:
            zero = self.config.setdefault("zero_optimization", {})
            zero.update(zero_optimization or {})
            if param_persistence_threshold is not None:
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
    While it loads an op, a lit_spec process records its host and pid beside the baton (``holding_baton``): a baton
    found later is removed only where that record proves it stale (``clear_stale_baton``); one that another node
    sharing the home directory may be building under is left. A loaded op is cached, so DeepSpeed's own load later
    does not touch the baton."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory, get_default_build_root

    ops = [get_accelerator().create_op_builder(name) for name in builders]
    ops = [op for op in ops if op is not None and deepspeed.ops.__compatible_ops__.get(op.NAME, False)]
    root = Path(get_default_build_root())
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "lit_spec.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        for op in ops:
            build = Path(_get_build_directory(op.NAME, verbose=False))   # torch's, where the op's baton goes
            clear_stale_baton(build)
            with holding_baton(build):
                op.load()


HOLDER = "lit_spec.holder"     # beside torch's baton: "<host> <pid>" of the lit_spec process loading that op


@contextmanager
def holding_baton(build: Path):
    """Record this process (host, pid) as the one that may hold ``build``'s baton while it loads the op: killed in the
    build, it leaves a record that proves the baton stale."""
    record = build / HOLDER
    record.write_text(f"{socket.gethostname()} {os.getpid()}\n")
    try:
        yield
    finally:
        record.unlink(missing_ok=True)


def clear_stale_baton(build: Path) -> None:
    """Remove ``build``'s baton where its holder record names this host and a process no longer alive; leave any other
    (another host's, a live process's, or one no lit_spec process recorded) with one warning: torch waits on it."""
    baton = build / "lock"
    if not baton.exists():
        return
    host, pid = _baton_holder(build / HOLDER)
    if host == socket.gethostname() and not _alive(pid):
        log.warning("removed %s, a build lock left by pid %d of this host, killed while loading (DeepSpeed would wait "
                    "on it forever)", baton, pid)
        baton.unlink(missing_ok=True)
    else:
        holder = f"pid {pid} on {host}" if host else "no lit_spec process (no holder record)"
        log.warning("waiting on %s, a torch build lock held by %s: if no build is running there, it is stale; "
                    "remove it by hand (rm %s)", baton, holder, baton)


def _baton_holder(record: Path) -> tuple[str | None, int]:
    """(host, pid) from a holder record; (None, 0) where there is none."""
    try:
        host, pid = record.read_text().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None, 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # another user's process
        pass
    return True


class FSDPStrategy(WholeDirectorySave, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (torch's FSDP2 here), its checkpoints whole or not at all."""


def fully_shard_model(model: torch.nn.Module, mesh, mp_policy=None) -> None:
    """FSDP2 over ``mesh``: every repeated block a unit of its own (a transformers model's decoder layers, named by
    its ``_no_split_modules``; otherwise the members of each ``nn.ModuleList``, e.g. draft heads), then the model as a
    whole; ``mp_policy``: FSDP2's ``MixedPrecisionPolicy`` (``lit_spec.precision.fsdp_mixed_precision``). A model
    already sharded (``configure_model`` called again) is left as it is."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from transformers import PreTrainedModel

    if isinstance(model, FSDPModule):
        return
    if isinstance(model, PreTrainedModel):
        layers = set(model._no_split_modules or ())
        blocks = [m for m in model.modules() if type(m).__name__ in layers]
    else:
        blocks = [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]
    mp_policy = mp_policy or MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    for unit in (*blocks, model):   # entry points besides forward (Chimera's head_inputs, a DFlash layer's context_kv)
        for name in getattr(unit, "forward_methods", ()):
            register_fsdp_forward_method(unit, name)


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
    that reads a weight directly (a slice of it, its shape) works as without sharding, and a forward inside leaves
    them whole. Nothing happens otherwise. Name only the submodules that are read: each rank then holds those whole,
    not the model. After, every FSDP2 unit reshards as it did before (the root, by FSDP's default, not after forward).
    """
    from torch.distributed.fsdp import FSDPModule

    units = list({id(m): m for module in modules for m in module.modules() if isinstance(m, FSDPModule)}.values())
    settings = [_reshard_setting(unit) for unit in units]
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
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
        for unit, setting in zip(units, settings):
            _restore_reshard_setting(unit, setting)
            unit.reshard()


def _reshard_setting(unit) -> tuple:
    """An FSDP2 unit's reshard-after-forward setting as FSDP keeps it (``set_reshard_after_forward`` can only
    overwrite it, and would take the root's special default away)."""
    state = unit._get_fsdp_state()
    return state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups]


def _restore_reshard_setting(unit, setting: tuple) -> None:
    state = unit._get_fsdp_state()
    state._auto_reshard_after_forward, infos = setting
    for group, info in zip(state._fsdp_param_groups, infos):
        group.post_forward_mesh_info = info


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


def resharded(module: torch.nn.Module) -> None:
    """Every FSDP2 unit of ``module`` back to its shards: FSDP leaves the root unit whole after a forward with no
    backward (a validation's), its parameters then plain tensors rather than the DTensors its state dict holds."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def whole_weights(module: torch.nn.Module, masters: bool = False):
    """Yields ``(name, parameter, whole tensor)`` for every parameter of ``module`` (its FSDP2 units ``resharded``
    first), one submodule's at a time, each whole only until the next is yielded (collective: every rank iterates to
    the end). ``masters``: DeepSpeed's fp32 master where it keeps one, else the gathered weight (what an export
    takes). The export and the speedup callback's decoding copy both take their weights from here."""
    resharded(module)
    for prefix, sub in module.named_modules():
        own = [(f"{prefix}.{n}" if prefix else n, p) for n, p in sub.named_parameters(recurse=False)]
        fp32 = [full_precision(p) if masters else None for _, p in own]
        with gathered([p for (_, p), m in zip(own, fp32) if m is None]) as whole:
            rest = iter(whole)
            for (name, param), master in zip(own, fp32):
                yield name, param, master if master is not None else next(rest)


def whole_numel(param: torch.nn.Parameter) -> int:
    """A parameter's number of elements, whole (ZeRO-3 keeps it in ``ds_numel``; a DTensor's shape is global)."""
    return getattr(param, "ds_numel", None) or whole_shape(param).numel()


@torch.no_grad()
def copy_whole(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Copy ``source``'s weights and buffers, whole and in their own dtypes and device, into ``target``, a module of
    the same structure (built on the meta device: each tensor is replaced, a tied one once), one submodule's weights
    gathered at a time (collective: every rank calls it)."""
    copies = {}     # target parameter -> its copy: a tied one (embeddings and LM head) stays tied
    for name, _, tensor in whole_weights(source):
        owner, attr = _owner(target, name)
        old = getattr(owner, attr)
        if id(old) not in copies:
            copies[id(old)] = torch.nn.Parameter(tensor.detach().clone(), requires_grad=old.requires_grad)
        setattr(owner, attr, copies[id(old)])
    for name, buffer in source.named_buffers():
        owner, attr = _owner(target, name)
        setattr(owner, attr, buffer.detach().clone())


def _owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    prefix, _, attr = name.rpartition(".")
    return module.get_submodule(prefix), attr


def all_gather_object(obj) -> list:
    """``obj`` from every rank, in rank order (``torch.distributed.all_gather_object``); ``[obj]`` in one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    gathered_objects = [None] * dist.get_world_size()
    dist.all_gather_object(gathered_objects, obj)
    return gathered_objects


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
