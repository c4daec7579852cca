"""Training something small against a frozen model, the one place for it. Chimera and Medusa heads
(``methods/draft_heads.py``), Hidden Transfer's maps (``methods/hidden_transfer.py``) and a distilled draft
(``methods/draft_distill.py``) each train one part, named by ``exported``, against a base (``model``) that is loaded
frozen (eval mode, no gradient, embeddings and LM head included), never trained, checkpointed or exported.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lit_spec.errors import ConfigError
from lit_spec.methods.method_module import MethodModule
from lit_spec.models.draft_heads import DraftHeads
from lit_spec.models.saved_heads import save_heads
from lit_spec.serving.vllm_export import SUBDIR as VLLM_SUBDIR, write_vllm_export
from lit_spec.strategies import unpartitioned_init, whole_parameters


def check_cached_states(base_states, indices, num_layers: int, method: str) -> None:
    """Cached base states (``data.base_states``, when enabled) must be the draft's feature layers (``indices``,
    ``hidden_states``) and the last, in that order: what ``FrozenBaseModule.base_states`` splits them into."""
    if base_states is None:
        return
    wanted = [*indices, num_layers]
    if base_states.layers != wanted:
        raise ConfigError(f"data.base_states.layers={base_states.layers}: method={method} reads hidden_states "
                          f"{list(indices)} and the last layer; set data.base_states.layers={wanted}")


class FrozenBaseModule(MethodModule):
    """Subclasses set ``exported`` (the trained part's attribute), build it in ``build_trainable()`` (the base is
    loaded by then) and compute their loss in ``_step(batch, stage)`` (``stage``: ``train`` or ``val``)."""

    exported = "heads"
    frozen = ("model",)

    def __init__(self, model_spec, **kwargs):
        super().__init__(model_spec, **kwargs)
        setattr(self, self.exported, None)

    def build_trainable(self) -> torch.nn.Module:
        raise NotImplementedError

    def build_models(self) -> None:
        if self.model is None:
            self.model = self.load_frozen()
        if getattr(self, self.exported) is None:
            # built from the base's embeddings and LM head (what init_from_base and check_draft read), gathered alone:
            # a rank never holds the whole base (a 70B one would not fit)
            reads = (self.model.get_input_embeddings(), self.model.get_output_embeddings())
            with unpartitioned_init(), whole_parameters(*reads):
                part = self.build_trainable()
            # in the policy's dtype: under ZeRO-3 DeepSpeed casts nothing once the base is partitioned
            setattr(self, self.exported, part.to(device=self.model.device, dtype=self.policy.trained))

    def _step(self, batch: dict, stage: str) -> torch.Tensor:
        raise NotImplementedError

    def base_states(self, batch: dict, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """The frozen base's hidden states at ``indices`` (transformers' ``hidden_states``), concatenated [B, T, kH],
        and its logits [B, T, V], without gradient: from its forward, or from the ``data.base_states`` cache (those
        layers, then the last, whose LM head gives the logits)."""
        with torch.no_grad():
            if "base_hidden" in batch:
                states = batch["base_hidden"].split(self.model.config.hidden_size, dim=-1)
                head = self.model.get_output_embeddings()
                return torch.cat(states[:-1], dim=-1), head(states[-1].to(head.weight.dtype))
            out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             output_hidden_states=True)
        return torch.cat([out.hidden_states[i] for i in indices], dim=-1), out.logits

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._step(batch, "val")

    def export(self, directory, state: dict) -> None:
        """Draft heads (``DraftHeads``) go to ``save_heads``' files, which name the base, and those vLLM serves also
        to its layout in ``vllm/`` (``serving/vllm_export.py``); a draft model is a ``save_pretrained`` directory
        (``MethodModule.export``)."""
        part = getattr(self, self.exported)
        if not isinstance(part, DraftHeads):
            return super().export(directory, state)
        save_heads(part, directory, self.model_spec.to_dict(), state)
        write_vllm_export(part, state, Path(directory) / VLLM_SUBDIR, self.model.config.num_hidden_layers)
