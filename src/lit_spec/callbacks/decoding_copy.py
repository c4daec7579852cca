"""What the speedup callback decodes where the weights are sharded (ZeRO-3, FSDP2), the one place for it: the plain
copy's size, the decision to take it, building it and freeing it.

Through DeepSpeed's per-module hooks every one-token forward gathers each layer again (~6-15x slower), so the callback
decodes a plain copy of the parts the decoders run: the model and the trained part, built weightless on the meta
device and filled from the gathered weights, one submodule at a time. A part already whole on this rank (FSDP2's
frozen base) is shared, not copied. The copy lives for one measurement and is freed after it, so it never sits beside
training's activations or optimizer states. It is taken where it fits in 80% of the room every rank has at that moment
(``decode_copy=auto``), a decision all ranks agree on: ranks that disagreed would issue different collectives and
hang. Otherwise every rank decodes the sharded model collectively, layer by layer through the strategy's own hooks,
with only what the decoders read directly made whole (the embeddings, the LM head, a trained part beside the model).
"""

from __future__ import annotations

import copy as copies
import logging
from contextlib import contextmanager

import lightning as L
import torch
from transformers import PreTrainedModel

from lit_spec.models.lora import add_lora
from lit_spec.strategies import copy_whole, local_tensor, weights_sharded, whole_numel, whole_parameters

log = logging.getLogger(__name__)

SHARE = 0.8     # of the room a rank has: what the copy may take


def decoded_parts(module: L.LightningModule) -> dict[str, torch.nn.Module]:
    """The parts of a method module its decoders run: the model, and the trained part where it is another (heads,
    maps, a draft). Not a frozen original an AR term distils from."""
    return {name: getattr(module, name) for name in dict.fromkeys(("model", module.exported))}


def _sharded(part: torch.nn.Module) -> bool:
    return any(local_tensor(p) is not p for p in part.parameters())     # a ZeRO-3 partition or an FSDP2 shard


def _plain_class(part: torch.nn.Module) -> type:
    """The module's own class (FSDP2 swaps in a subclass of it)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(part).__mro__ if not issubclass(c, FSDPModule))


class DecodingCopy:
    """Args:
        mode: ``True`` always decode a copy, ``False`` never (decode the sharded model collectively), ``auto`` the copy
            where it fits (the decision agreed by every rank).
    """

    def __init__(self, mode: bool | str = "auto"):
        self.mode = mode
        self.peak_bytes = 0          # the largest copy held (MemoryMonitor reports it)
        self._said: bool | None = None

    # ---- size and decision ------------------------------------------------------------------------------------
    @staticmethod
    def copied(module: L.LightningModule) -> dict[str, torch.nn.Module]:
        """The decoded parts that are sharded on this rank: what the copy holds (the others it shares)."""
        return {name: part for name, part in decoded_parts(module).items() if _sharded(part)}

    def bytes(self, module: L.LightningModule) -> int:
        """The copy's stated bound: every weight of the copied parts whole, in its live dtype (buffers are small)."""
        return sum(whole_numel(p) * p.element_size() for part in self.copied(module).values()
                   for p in part.parameters())

    @staticmethod
    def room(trainer: L.Trainer, device: torch.device) -> int:
        """Bytes this rank could allocate now: free device memory plus what torch's allocator holds unused (CUDA);
        on CPU, this rank's share of the node's available RAM."""
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
            return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        import psutil

        return psutil.virtual_memory().available // max(1, trainer.num_devices)

    def decide(self, trainer: L.Trainer, module: L.LightningModule) -> bool:
        """Take the copy? ``auto``: where it fits on every rank, one answer for all (collective)."""
        if self.mode != "auto":
            return bool(self.mode)
        fits = self.bytes(module) <= SHARE * self.room(trainer, module.device)
        return trainer.strategy.reduce_boolean_decision(fits, all=True)

    # ---- building ---------------------------------------------------------------------------------------------
    def build(self, module: L.LightningModule) -> L.LightningModule:
        """A module of the same class holding the decoded parts: the sharded ones built on the meta device (a model
        from its config, adapters included; a trained part by the method's own ``build_trainable``) and filled from
        the gathered weights in their live dtypes (collective); the others shared."""
        copied = self.copied(module)
        # as load_from_checkpoint builds it (no trainer, no hooks), moved to the module's device before any part joins
        # it: its `device`, where the callback puts the prompts, says so (on a GPU it once said cpu), and no part is
        # moved (moving FSDP2's shared base after it joined gave Medusa's decode DTensors beside plain tensors)
        clone = type(module)(**module.hparams).to(module.device)
        clone.policy = module.policy
        for name, part in decoded_parts(module).items():
            if name not in copied:
                setattr(clone, name, part)
        with torch.device("meta"):
            for name, part in copied.items():     # the model first: a trained part is built from it
                setattr(clone, name, self._weightless(clone, name, part))
        for name, part in copied.items():
            copy_whole(part, getattr(clone, name))
        return clone.eval()

    @staticmethod
    def _weightless(clone: L.LightningModule, name: str, part: torch.nn.Module) -> torch.nn.Module:
        if not isinstance(part, PreTrainedModel):
            return clone.build_trainable()
        ghost = _plain_class(part)(copies.deepcopy(part.config))
        ghost.generation_config = part.generation_config
        lora = clone.hparams.get("lora") if name == "model" else None     # a LoRA run's adapted model
        return add_lora(ghost, lora) if lora else ghost

    # ---- the module to decode ---------------------------------------------------------------------------------
    @contextmanager
    def decoding(self, trainer: L.Trainer, module: L.LightningModule):
        """Yields ``(the module to decode, local)``: ``local`` when its forwards are this rank's alone (the ranks may
        then decode different prompts), not when every forward is collective (every rank runs the same ones)."""
        if not weights_sharded(trainer.strategy):
            yield module, True
            return
        take = self.decide(trainer, module)
        self._say(take)
        if not take:
            reads = [module.model.get_input_embeddings(), module.model.get_output_embeddings()]
            reads += [part for name, part in decoded_parts(module).items() if name != "model"]
            with whole_parameters(*reads):
                yield module, False
            return
        clone = self.build(module)     # freed with the measurement's last reference to it (its decoders)
        self.peak_bytes = max(self.peak_bytes, self.bytes(module))
        yield clone, True

    def _say(self, take: bool) -> None:
        if take != self._said:
            log.info("speedup callback: %s (decode_copy=%s)", "decoding a plain copy of the sharded model" if take
                     else "decoding the sharded model collectively, layer by layer", self.mode)
            self._said = take
