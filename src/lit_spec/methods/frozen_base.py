"""Training something small against a frozen model, the one place for it. Chimera and Medusa heads
(``methods/draft_heads.py``), Hidden Transfer's maps (``methods/hidden_transfer.py``) and a distilled draft
(``methods/draft_distill.py``) each train one part, named by ``exported``, against a base (``model``) that is loaded
frozen (eval mode, no gradient, embeddings and LM head included), never trained, checkpointed or exported.
"""

from __future__ import annotations

import torch

from lit_spec.methods.method_module import MethodModule
from lit_spec.models.draft_heads import DraftHeads
from lit_spec.models.saved_heads import heads_like, save_heads
from lit_spec.strategies import is_deepspeed, is_fsdp, unpartitioned_init, whole_parameters


class FrozenBaseModule(MethodModule):
    """Subclasses set ``exported`` (the trained part's attribute), build it in ``build_trainable()`` (the base is
    loaded by then) and compute their loss in ``_step(batch, stage)`` (``stage``: ``train`` or ``val``)."""

    exported = "heads"

    def __init__(self, model_spec, **kwargs):
        super().__init__(model_spec, **kwargs)
        setattr(self, self.exported, None)

    def build_trainable(self) -> torch.nn.Module:
        raise NotImplementedError

    def build_models(self) -> None:
        if self.model is None:
            self.model = self.model_spec.load_model().eval().requires_grad_(False)
        if getattr(self, self.exported) is None:
            # built from the base's embeddings and LM head (what init_from_base and check_draft read), gathered alone:
            # a rank never holds the whole base (a 70B one would not fit)
            reads = (self.model.get_input_embeddings(), self.model.get_output_embeddings())
            with unpartitioned_init(), whole_parameters(*reads):
                part = self.build_trainable()
            # in the policy's dtype: under ZeRO-3 DeepSpeed casts nothing once the base is partitioned
            setattr(self, self.exported, part.to(device=self.model.device, dtype=self.policy.trained))

    def train(self, mode: bool = True):
        super().train(mode)
        if self.model is not None:
            self.model.eval()              # the frozen base never trains (no dropout)
        return self

    def _step(self, batch: dict, stage: str) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._step(batch, "val")

    # ---- checkpoints and export ---------------------------------------------------------------------------------
    @property
    def strict_loading(self) -> bool:
        """DeepSpeed checkpoints leave the frozen base out (the strategies' ``exclude_frozen_parameters``): its keys
        are missing by design there. Elsewhere ``on_load_checkpoint`` puts them back, and loading stays strict."""
        return not (self._trainer is not None and is_deepspeed(self.trainer.strategy))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The base is rebuilt from ``hparams.model_spec`` (its identity is kept, and checked on resume): checkpoints
        hold the trained part only. Except under FSDP (``ModelParallelStrategy``), whose distributed checkpoint is
        loaded for every key of the live module."""
        super().on_save_checkpoint(checkpoint)
        checkpoint["base_identity"] = self.model_spec.identity()
        if "state_dict" in checkpoint and not is_fsdp(self.trainer.strategy):
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items()
                                        if not k.startswith("model.")}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Put the (rebuilt) base's own weights back, so the trained part loads strictly: a missing or unexpected
        key of it still fails. Lightning calls ``configure_model`` before this hook."""
        state = checkpoint.get("state_dict")
        if state is None:                    # DeepSpeed restores module states itself
            return
        if self.model is None:
            self.build_models()
        for k, v in self.model.state_dict().items():
            state.setdefault(f"model.{k}", v)

    def export(self, directory, state_dict: dict | None = None) -> None:
        """Draft heads (``DraftHeads``) go to ``save_heads``' files, which name the base; a draft model is a
        ``save_pretrained`` directory (``MethodModule.export``)."""
        part = getattr(self, self.exported)
        if not isinstance(part, DraftHeads):
            return super().export(directory, state_dict)
        if state_dict is not None:          # gathered from shards: loaded into a whole copy
            prefix, part = f"{self.exported}.", heads_like(part)
            part.load_state_dict({k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)})
        save_heads(part, directory, self.model_spec.to_dict())
