"""Distances between a teacher's and a student's next-token distributions, shared by every method.

``distance(student_logits, teacher_logits, mask, kind, reduction)`` compares the two at the positions ``mask`` marks.
Its reductions (``REDUCTIONS``) are the two that the papers and their authors' code use: ``sum``, each row's sum over
its positions averaged over the rows (CLLM eq. 4 sums over the block's positions), and ``mean``, the mean over every
marked position of the batch (the authors' ``soft_cross_entropy``). The teacher is detached inside: it is the
stop-gradient model q_θ− of CLLM eq. 4-5.

Kinds (p: teacher, q: student, per position, over the vocabulary):
- ``forward_kl``: KL(p‖q), CLLM's D(q_θ−‖q_θ) and the paper's default (§3.2.2, "we primarily experiment with the
  forward KL");
- ``reverse_kl``: KL(q‖p);
- ``jsd``: the generalized Jensen-Shannon divergence of GKD (Agarwal et al. 2023), with the teacher first:
  JSD(β) = β·KL(p‖m) + (1-β)·KL(q‖m), m = β·p + (1-β)·q. β=0.5 is the symmetric JSD; β must lie in (0, 1)
  (at 0 or 1, m equals one of the two and the divergence is identically 0).
"""

from __future__ import annotations

import math

import torch

from lit_spec.errors import ConfigError

DISTANCES = ("forward_kl", "reverse_kl", "jsd")
REDUCTIONS = ("mean", "sum")


def check_distance(kind: str, beta: float = 0.5) -> None:
    if kind not in DISTANCES:
        raise ConfigError(f"distance={kind!r}: choose one of {list(DISTANCES)}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 < beta < 1:
        raise ConfigError(f"jsd_beta={beta!r}: must be a number in (0, 1) (0.5: the symmetric JSD)")


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p‖q) over the last dimension from log-probabilities; 0·log 0 = 0."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)


def pointwise(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str = "forward_kl",
              beta: float = 0.5) -> torch.Tensor:
    """D between paired rows of logits [N, V] (teacher detached here): [N], one distance per compared position."""
    check_distance(kind, beta)
    log_q = student_logits.float().log_softmax(-1)
    log_p = teacher_logits.detach().float().log_softmax(-1)
    if kind == "forward_kl":
        return _kl(log_p, log_q)
    if kind == "reverse_kl":
        return _kl(log_q, log_p)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
    return beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)


def soft_cross_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """-sum_v p(v) log q(v) between paired rows [N, V] (teacher detached): forward KL plus the teacher's entropy,
    the loss EAGLE-3's authors write (its gradient is forward KL's)."""
    p = teacher_logits.detach().float().softmax(-1)
    return -(p * student_logits.float().log_softmax(-1)).sum(-1)


def check_reduction(name: str, reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ConfigError(f"{name}={reduction!r}: choose one of {list(REDUCTIONS)} (mean: the authors' code; sum: "
                          "the paper's equation)")


def group_sums(values: torch.Tensor, groups: torch.Tensor, count: int) -> torch.Tensor:
    """[count]: the sum of ``values`` [N] within each group (``groups`` [N], ids in [0, count))."""
    return values.new_zeros(count).index_add(0, groups, values)


def token_mean(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The mean of ``values``; 0 in the graph of ``like`` when there are none."""
    return values.mean() if values.numel() else like.sum() * 0.0


def mean_of_sums(values: torch.Tensor, groups: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The sum of ``values`` [N] within each group (``groups`` [N], ids >= 0), averaged over the groups present; 0
    in the graph of ``like`` when there is nothing to sum."""
    if values.numel() == 0:
        return like.sum() * 0.0
    ids, groups = torch.unique(groups, return_inverse=True)
    return group_sums(values, groups, len(ids)).mean()


def distance(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
             kind: str = "forward_kl", beta: float = 0.5, reduction: str = "sum") -> torch.Tensor:
    """Args: logits [B, T, V] (teacher detached here), mask [B, T] bool. Returns a scalar (see the module doc; under
    ``sum`` a row with nothing marked counts as 0)."""
    mask = mask.bool()
    d = pointwise(student_logits[mask], teacher_logits[mask], kind, beta)   # only the compared positions
    if reduction == "mean" or d.numel() == 0:
        return token_mean(d, student_logits)
    return group_sums(d, mask.nonzero()[:, 0], mask.size(0)).mean()
