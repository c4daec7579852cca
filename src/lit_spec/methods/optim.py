"""Optimizer and learning-rate schedule shared by every method module."""

from __future__ import annotations

import math

import torch

from lit_spec.errors import ConfigError, check_count
from lit_spec.strategies import offloads_optimizer, whole_shape


SCHEDULERS = ("cosine", "linear", "constant")


def _number(name: str, value, what: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ConfigError(f"method.{name}={value!r}: must be a number {what}")


def check_optim(lr, weight_decay, betas, warmup_steps, scheduler, min_lr_ratio) -> None:
    """The optimizer settings of ``conf/method/_optim.yaml``, each named in a ConfigError when it is out of range."""
    _number("lr", lr, "> 0", lambda v: v > 0)
    _number("weight_decay", weight_decay, ">= 0", lambda v: v >= 0)
    _number("min_lr_ratio", min_lr_ratio, "in [0, 1]", lambda v: 0 <= v <= 1)
    check_count("method.warmup_steps", warmup_steps, minimum=0)
    if len(betas) != 2:
        raise ConfigError(f"method.betas={list(betas)}: give two numbers in [0, 1)")
    for beta in betas:
        _number("betas", beta, "in [0, 1)", lambda v: 0 <= v < 1)
    if scheduler not in SCHEDULERS:
        raise ConfigError(f"method.scheduler={scheduler!r}: choose one of {list(SCHEDULERS)}")


def _lr_lambda(kind: str, warmup: int, total: int, min_ratio: float):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "linear":
            return 1.0 - (1.0 - min_ratio) * progress
        if kind == "cosine":
            return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ConfigError(f"method.scheduler={kind!r}: choose one of {list(SCHEDULERS)}")

    return f


def build_optimizer(module, hp) -> dict:
    """AdamW over the trainable parameters (no decay on biases and norms) with warmup + decay per step."""
    params = [p for p in module.parameters() if p.requires_grad]
    matrices = [len(whole_shape(p)) >= 2 for p in params]
    groups = [
        {"params": [p for p, matrix in zip(params, matrices) if matrix], "weight_decay": hp.weight_decay},
        {"params": [p for p, matrix in zip(params, matrices) if not matrix], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]   # ZeRO-3 drops an empty group, and the schedule must see as many
    betas = tuple(hp.betas)
    if offloads_optimizer(module.trainer.strategy):  # ZeRO-Offload steps the optimizer on the CPU with its own Adam
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(groups, lr=hp.lr, betas=betas, adamw_mode=True)
    else:
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=betas)
    total = module.trainer.estimated_stepping_batches
    total = int(total) if math.isfinite(total) else 0
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _lr_lambda(hp.scheduler, hp.warmup_steps, total, hp.min_lr_ratio))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
