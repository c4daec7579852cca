"""The precision policy, the one place that decides the dtype of every part of a run from the trainer's precision
and its strategy: the weights that train (a fine-tuned model, heads, maps, a draft) as each rank holds them, the
optimizer's master copy, and the dtype forwards compute in. A frozen base keeps ``model.dtype``: it has no optimizer.
The export is in ``export_dtype`` (default: the model's own), whatever the strategy.

| strategy  | precision            | trained weights | masters         | compute |
|-----------|----------------------|-----------------|-----------------|---------|
| DeepSpeed | bf16-mixed/bf16-true | bf16            | fp32 (DeepSpeed)| bf16    |
| DeepSpeed | 16-mixed/16-true     | fp16            | fp32 (DeepSpeed)| fp16    |
| any other | X-mixed              | fp32            | the weights     | X (autocast; FSDP2 gathers in X) |
| any       | X-true               | X               | the weights     | X       |

DeepSpeed casts what it wraps to its low precision and keeps fp32 masters in its optimizer; under ZeRO-3 the base is
built in that dtype by ``zero.Init``, so a part built beside it must be cast alike (DeepSpeed skips its own cast once a
parameter is partitioned). Elsewhere mixed precision means fp32 weights under autocast: a ``model.dtype=bfloat16``
model that trains is loaded in fp32, or AdamW would update bf16 weights with no fp32 copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from lit_spec.models.spec import DTYPES
from lit_spec.strategies import is_deepspeed

log = logging.getLogger(__name__)

LOW = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32, "64": torch.float64}


@dataclass(frozen=True)
class PrecisionPolicy:
    trained: torch.dtype            # what trains, as each rank holds it
    masters: torch.dtype | None     # the optimizer's master copy; None: the trained weights themselves
    compute: torch.dtype

    def describe(self) -> str:
        name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        masters = f"{name(self.masters)} masters" if self.masters else "no separate masters"
        return f"trained weights {name(self.trained)}, {masters}, compute {name(self.compute)}"


def precision_policy(strategy, precision: str | int | None) -> PrecisionPolicy:
    """The policy for a strategy (a Lightning strategy instance or class) and a precision as Lightning names it
    (``bf16-mixed``, ``32-true``, ...; a bare ``bf16``/``16``/``32`` as Lightning reads it)."""
    text = str(precision or "32-true")
    if "-" not in text:
        text = f"{text}-{'true' if text in ('32', '64') else 'mixed'}"
    bits, mode = text.split("-", 1)
    dtype = LOW.get(bits, torch.float32)     # transformer-engine and the like: fp32 weights
    if is_deepspeed(strategy) and dtype in (torch.bfloat16, torch.float16):
        return PrecisionPolicy(trained=dtype, masters=torch.float32, compute=dtype)
    if mode == "mixed":
        return PrecisionPolicy(trained=torch.float32, masters=None, compute=dtype)
    return PrecisionPolicy(trained=dtype, masters=None, compute=dtype)


def fsdp_mixed_precision(policy: PrecisionPolicy):
    """FSDP2's ``MixedPrecisionPolicy`` for a policy: under mixed precision the units all-gather their weights in the
    compute dtype (half fp32's traffic) and reduce gradients in fp32 into the fp32 shards; otherwise FSDP's default."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if policy.compute == policy.trained:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=policy.compute, reduce_dtype=torch.float32)


def check_policy(policy: PrecisionPolicy, strategy_name: str, precision: str) -> None:
    """Warn, once before work, about the combination that trains badly: low-precision weights updated in place."""
    if policy.masters is None and policy.trained in (torch.bfloat16, torch.float16):
        log.warning("trainer.precision=%s with %s: the optimizer updates %s weights with no fp32 master copy (small "
                    "updates round away); use trainer.precision=bf16-mixed, or a DeepSpeed strategy",
                    precision, strategy_name, policy.trained)


def export_dtype(name: str, spec) -> torch.dtype:
    """The export's dtype: ``export_dtype`` where it names one; ``auto``: the exported model's own, ``model.dtype``
    or, where that is ``auto`` too, the dtype its config.json records (fp32 if none). Never the strategy's."""
    chosen = DTYPES[name] if name != "auto" else DTYPES[spec.dtype]
    if chosen == "auto":
        chosen = getattr(spec.load_config(), "dtype", None) or torch.float32
    return getattr(torch, chosen) if isinstance(chosen, str) else chosen
