"""What every method module shares: the model spec, lazy weight loading, optimizer, export.

Contract (see DESIGN.md): a method module owns its trainable parameters, logs each loss term by name, and offers
``export(dir)`` -> files that plain transformers (or our loader) read back.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import lightning as L
import torch

from lit_spec.data import AnswerBatches
from lit_spec.methods.optim import build_optimizer, check_optim
from lit_spec.models import spec_from_dict
from lit_spec.models.lora import add_lora, merge_lora
from lit_spec.models.spec import model_shape
from lit_spec.precision import PrecisionPolicy, fsdp_mixed_precision, precision_policy
from lit_spec.strategies import fully_shard_model, is_fsdp

if TYPE_CHECKING:
    from lit_spec.decoding import Decoder


# Frozen parts (``MethodModule.frozen``: a frozen base, the original model an AR term distils from; and any weight that
# does not train, as a LoRA run's adapted model's own) are rebuilt from ``hparams.model_spec`` (its identity is kept in
# checkpoints, and checked on resume), so the module's state dict leaves them out under every strategy (Lightning's,
# DeepSpeed's and FSDP's distributed checkpoints all read ``state_dict()``), and loading puts the live weights back: a
# missing or unexpected key of what trains still fails a strict load.
def _frozen_state(module, prefix: str) -> dict:
    state = {f"{prefix}{name}.{key}": value for name in module.frozen if getattr(module, name, None) is not None
             for key, value in getattr(module, name).state_dict().items()}
    return state | {prefix + name: p.detach() for name, p in module.named_parameters() if not p.requires_grad}


def _without_frozen(module, state: dict, prefix: str, local_metadata) -> None:
    for key in _frozen_state(module, prefix):
        state.pop(key, None)


def _with_frozen(module, state: dict, prefix: str, *args) -> None:
    for key, value in _frozen_state(module, prefix).items():
        state.setdefault(key, value)


class MethodModule(L.LightningModule):
    """Args:
        model_spec: the ``model`` group's spec (or its dict, when restored from a checkpoint).
        lr, weight_decay, betas, warmup_steps, scheduler, min_lr_ratio: AdamW + warmup/decay schedule.
        lora: a full fine-tune trains low-rank adapters only (``lit_spec.models.lora``); None: every weight.
    """

    #: the datamodule whose batches ``training_step`` reads (checked from the config before any work), and the
    #: data configs that build it
    datamodule_class: type = AnswerBatches
    data_configs: str = ("a prompt dataset (data=stdlib_code, gsm8k, spider, code_search_net, sharegpt) or the "
                         "target's own answers (data=self_distilled)")
    #: the attribute holding the model ``export`` writes (``model``; a distilled draft: ``student``)
    exported: str = "model"
    #: the attributes holding frozen models (eval mode, no gradient, never checkpointed or exported)
    frozen: tuple[str, ...] = ()
    #: read by Lightning's ThroughputMonitor: None, FLOPs are not counted (its tokens/s is our throughput figure)
    flops_per_batch: float | None = None

    def __init__(self, model_spec, lr: float = 2e-5, weight_decay: float = 0.0, betas: tuple = (0.9, 0.999),
                 warmup_steps: int = 0, scheduler: str = "cosine", min_lr_ratio: float = 0.1, lora: dict | None = None,
                 **method_hparams):
        super().__init__()
        check_optim(lr, weight_decay, betas, warmup_steps, scheduler, min_lr_ratio)
        self.model_spec = spec_from_dict(model_spec) if isinstance(model_spec, dict) else model_spec
        # Primitives only (torch>=2.6 loads checkpoints with weights_only=True): the spec is kept as a dict, so
        # ``load_from_checkpoint(path)`` rebuilds the module with no other argument.
        self.save_hyperparameters(ignore=["model_spec"])
        self.hparams["model_spec"] = self.model_spec.to_dict()
        self.model: torch.nn.Module | None = None
        self._policy: PrecisionPolicy | None = None
        self.register_state_dict_post_hook(_without_frozen)
        self.register_load_state_dict_pre_hook(_with_frozen)

    def configure_model(self) -> None:
        """Build the models (``build_models``); under ``strategy=fsdp`` (Lightning's ``ModelParallelStrategy``) shard
        what trains (the exported model) with FSDP2 over its data-parallel mesh, in the precision policy's mixed
        precision. A frozen base stays whole on every rank: it has no gradients or optimizer states to shard."""
        self.build_models()
        if self._trainer is not None and is_fsdp(self.trainer.strategy):
            fully_shard_model(getattr(self, self.exported), self.device_mesh["data_parallel"],
                              fsdp_mixed_precision(self.policy))

    @property
    def policy(self) -> PrecisionPolicy:
        """The dtypes of this run's parts (``lit_spec.precision``); outside a trainer, fp32 as on one CPU, unless
        set (a module built to mirror one inside a trainer takes that one's policy)."""
        if self._policy is not None:
            return self._policy
        trainer = self._trainer
        return precision_policy(trainer.strategy if trainer else None, trainer.precision if trainer else None)

    @policy.setter
    def policy(self, policy: PrecisionPolicy) -> None:
        self._policy = policy

    def build_models(self) -> None:
        if self.model is None:   # from_pretrained returns eval mode
            model = self.model_spec.load_model(self.policy.trained).train()
            self.model = add_lora(model, self.hparams.lora) if self.hparams.lora else model

    def load_frozen(self) -> torch.nn.Module:
        """The model spec's weights as a frozen part: eval mode, no gradient, in ``model.dtype``."""
        return self.model_spec.load_model().eval().requires_grad_(False)

    def train(self, mode: bool = True):
        super().train(mode)
        for name in self.frozen:
            if getattr(self, name, None) is not None:
                getattr(self, name).eval()      # a frozen part never trains (no dropout)
        return self

    def decoders(self, **sampling) -> dict[str, Decoder]:
        """The fast decoders this method trains the model for, by name, built over ``self.model`` (e.g. CLLM's
        ``{"jacobi": JacobiDecoder(self.model, n_tokens=...)}``); the speedup callback measures each against AR.
        With ``sampling`` (temperature > 0, top_p, seed) those that can sample, sampling."""
        return {}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Name the method (its class and the method classes it extends) and the model's sizes in every checkpoint,
        and the identity of the weights its frozen parts are rebuilt from: resuming it with another method, a model of
        other sizes or other frozen weights is refused (``check_checkpoint``)."""
        checkpoint["method"] = [c.__name__ for c in type(self).__mro__
                                if issubclass(c, MethodModule) and c is not MethodModule]
        checkpoint["model_shape"] = model_shape(self.model.config)
        if self.frozen or self.hparams.lora:
            checkpoint["base_identity"] = self.model_spec.identity()

    def configure_optimizers(self):
        return build_optimizer(self, self.hparams)

    @property
    def exported_spec(self):
        """The spec of what ``export`` writes: ``<exported>_spec`` (a distilled draft's), else the model's."""
        return getattr(self, f"{self.exported}_spec", self.model_spec)

    def export(self, directory, state: dict) -> None:
        """Write ``state`` (the whole exported model's weights, ``lit_spec.export.exported_state``) and the target's
        tokenizer with ``save_pretrained`` (safetensors); plain transformers loads them. The model is written through
        a weightless (meta) copy of the exported one in ``state``'s dtype: nothing is held twice. LoRA adapters are
        merged into the weights they adapt."""
        model = getattr(self, self.exported)
        if self.hparams.lora:
            state = merge_lora(state, model)
        dtype = next(v.dtype for v in state.values() if v.is_floating_point())
        with torch.device("meta"):   # config.json records the ghost's dtype; the live config stays as it was
            ghost = type(model)(copy.deepcopy(model.config)).to(dtype)
        ghost.generation_config = model.generation_config
        ghost.save_pretrained(directory, state_dict=state, safe_serialization=True)
        self.model_spec.load_tokenizer().save_pretrained(directory)
