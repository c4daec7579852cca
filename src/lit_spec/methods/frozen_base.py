"""Training something small against a frozen model, the one place for it. Chimera and Medusa heads
(``methods/draft_heads.py``), Hidden Transfer's maps (``methods/hidden_transfer.py``) and a distilled draft
(``methods/draft_distill.py``) each train one part, named by ``exported``, against a base (``model``) that is loaded
frozen (eval mode, no gradient, embeddings and LM head included), never trained, checkpointed or exported.
"""

from __future__ import annotations

import torch

from lit_spec.methods.method_module import MethodModule
from lit_spec.models.draft_heads import DraftHeads
from lit_spec.models.saved_heads import save_heads
from lit_spec.strategies import unpartitioned_init, whole_parameters


# The base is rebuilt from ``hparams.model_spec`` (its identity is kept in checkpoints, and checked on resume), so the
# module's state dict leaves it out under every strategy (Lightning's, DeepSpeed's and FSDP's distributed checkpoints
# all read ``state_dict()``), and loading puts the live base's own weights back: a missing or unexpected key of the
# trained part still fails a strict load.
def _without_base(module, state: dict, prefix: str, local_metadata) -> None:
    for key in [k for k in state if k.startswith(f"{prefix}model.")]:
        del state[key]


def _with_base(module, state: dict, prefix: str, *args) -> None:
    if module.model is not None:
        for key, value in module.model.state_dict().items():
            state.setdefault(f"{prefix}model.{key}", value)


class FrozenBaseModule(MethodModule):
    """Subclasses set ``exported`` (the trained part's attribute), build it in ``build_trainable()`` (the base is
    loaded by then) and compute their loss in ``_step(batch, stage)`` (``stage``: ``train`` or ``val``)."""

    exported = "heads"

    def __init__(self, model_spec, **kwargs):
        super().__init__(model_spec, **kwargs)
        setattr(self, self.exported, None)
        self.register_state_dict_post_hook(_without_base)
        self.register_load_state_dict_pre_hook(_with_base)

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
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["base_identity"] = self.model_spec.identity()

    def export(self, directory, state: dict) -> None:
        """Draft heads (``DraftHeads``) go to ``save_heads``' files, which name the base; a draft model is a
        ``save_pretrained`` directory (``MethodModule.export``)."""
        part = getattr(self, self.exported)
        if not isinstance(part, DraftHeads):
            return super().export(directory, state)
        save_heads(part, directory, self.model_spec.to_dict(), state)
