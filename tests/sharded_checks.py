"""A test-only callback the sharded-training tests add to their runs (``+callbacks.base_unchanged=...``): it checks,
inside the training processes, what only they can see."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from torch.distributed.tensor import DTensor

from lit_spec.strategies import DeepSpeedStrategy, FSDPStrategy, whole_numel, whole_parameters


class TeardownOffDevice:
    """A strategy whose teardown does what a GPU's does: Lightning's moves the module (and its optimizer) to the CPU,
    where NCCL's collectives and the device's reads cannot reach them. On a CPU that move changes nothing, so here the
    module then goes to the meta device (its weights gone): whatever reads or gathers them after teardown fails."""

    def teardown(self) -> None:
        module = self.lightning_module
        super().teardown()
        if module is not None:
            module.to("meta")


class SingleDeviceTeardownOffDevice(TeardownOffDevice, SingleDeviceStrategy):
    pass


class DDPTeardownOffDevice(TeardownOffDevice, DDPStrategy):
    pass


class DeepSpeedTeardownOffDevice(TeardownOffDevice, DeepSpeedStrategy):
    pass


class FSDPTeardownOffDevice(TeardownOffDevice, FSDPStrategy):
    pass


class FrozenBaseUnchanged(L.Callback):
    """At train end every rank compares its frozen base (made whole first: ZeRO-3 partitions it) with the weights it
    was loaded from, bit for bit, and writes ``base_unchanged.rank<r>.json`` into the run directory."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with whole_parameters(pl_module.model):
            live = {k: v.detach().cpu().clone() for k, v in pl_module.model.state_dict().items()}
        original = pl_module.model_spec.load_model().state_dict()
        equal = live.keys() == original.keys() and all(torch.equal(live[k], original[k]) for k in original)
        result = {"tensors": len(original), "equal": equal}
        Path(trainer.default_root_dir, f"base_unchanged.rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _speedup(trainer: L.Trainer):
    from lit_spec.callbacks import SpeedupCallback

    return next(c for c in trainer.callbacks if isinstance(c, SpeedupCallback))


def _write(trainer: L.Trainer, name: str, result: dict) -> None:
    Path(trainer.default_root_dir, f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


class LittleRoomOnRank1(L.Callback):
    """Rank 1 sees no room for the speedup callback's decoding copy (on a GPU another process may hold its memory),
    rank 0 plenty: the decision to take the copy must still be one for all ranks."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.global_rank == 1:
            _speedup(trainer).copy.room = lambda trainer, device: 0


class WholeLayersWhileDecoding(L.Callback):
    """The most of the sharded model's decoder layers whole at once (ZeRO-3: gathered, FSDP2: unsharded), in layers'
    worth of weights, seen as each of their submodules starts a forward outside training (each gathers its own
    weights then); written to ``whole_layers.rank<r>.json``."""

    def __init__(self):
        self.most = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        layers = pl_module.model.model.layers
        params = [p for p in layers.parameters()]
        # a ZeRO-3 partition's data is empty until gathered; an FSDP2 shard is a DTensor until unsharded
        whole = lambda p: p.numel() == whole_numel(p) and not isinstance(p, DTensor)   # noqa: E731
        per_layer = sum(map(whole_numel, params)) / len(layers)

        def count(module, args):
            if not torch.is_grad_enabled():
                self.most = max(self.most, sum(whole_numel(p) for p in params if whole(p)) / per_layer)

        for module in layers.modules():
            module.register_forward_pre_hook(count)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _write(trainer, "whole_layers", {"most": self.most, "layers": len(pl_module.model.model.layers)})


class DivergesOnRank1(L.Callback):
    """After the first step, rank 1's model (not rank 0's) gives other greedy answers outside training (every greedy
    choice becomes its runner-up): a rank whose decode differs, as GPU kernels can make it. Each rank writes the speedup
    callback's last figures and how many answer NLLs it computed (forwards with labels and no cache) to
    ``measured.rank<r>.json``."""

    def __init__(self):
        self.nll_forwards = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        def push(module, args, kwargs, output):
            self.nll_forwards += kwargs.get("labels") is not None and kwargs.get("use_cache") is False
            if trainer.global_rank == 1 and trainer.global_step > 0 and not torch.is_grad_enabled():
                output.logits.scatter_(-1, output.logits.argmax(-1, keepdim=True), -1e4)
            return output

        pl_module.model.register_forward_hook(push, with_kwargs=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _write(trainer, "measured", {"metrics": _speedup(trainer).last_metrics, "nll_forwards": self.nll_forwards})
