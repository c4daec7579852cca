"""What CLLM and Jacobi Forcing share: a causal LM trained on its own Jacobi trajectories with a consistency loss and
an AR loss, L = L_consistency + ω·L_AR (CLLM eq. 7; Jacobi Forcing keeps the form and ω = 10). Subclasses compute the
two terms (``_losses``, the AR one through ``_ar``) and offer their decoders; this base checks the shared settings,
sums and logs.

Each term is reduced as the authors' code reduces it (``consistency_reduction=mean``, ``ar_prompt``, and for CLLM
``label_smoothing`` 0.1) or as the papers' equations write it (``sum``, the answer's tokens only, no smoothing); the
defaults are the authors' code's, whose figures the papers report.

The AR term fits either the one-hot answer tokens (``ar_teacher=labels``, CLLM eq. 6) or, to keep the model the model
it was (``ar_teacher=original``), the original model's whole next-token distribution at the same positions: forward
KL(p_original ‖ q_θ), self-distillation. The original is a frozen copy loaded beside the model (one more no-grad
forward per batch, and the model's weights once more, sharded like the model under ZeRO-3; never checkpointed).
Storing its top-k log-probabilities with the trajectories would need less memory, but would tie every cached
trajectory set to one recipe; the copy keeps the data as it is."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_spec.data import IGNORE_INDEX
from lit_spec.errors import ConfigError, check_count
from lit_spec.methods import losses
from lit_spec.methods.method_module import MethodModule


AR_TEACHERS = ("labels", "original")


class ConsistencyModule(MethodModule):
    """Args (besides ``MethodModule``'s):
        n_tokens: n, the Jacobi block size of ``decoders()``.
        distance: D of the consistency loss: ``forward_kl`` (both papers') | ``reverse_kl`` | ``jsd``; jsd_beta: β.
        ar_weight: ω.
        ar_teacher: what the AR term fits: ``labels`` (the answer tokens, CLLM eq. 6) or ``original`` (the original
            model's distribution: self-distillation, which holds the model in place).
        consistency_reduction: ``mean`` over the compared positions (the authors' code) or ``sum`` (the paper's
            equation); each subclass says over what.
        ar_prompt: the AR term also fits the prompt's next-token pairs (the authors' code) or the answer's alone.
        label_smoothing: ε of the AR term's cross-entropy (CLLM's code: 0.1); read with ``ar_teacher=labels``.
    """

    def __init__(self, model_spec, n_tokens: int = 16, distance: str = "forward_kl", jsd_beta: float = 0.5,
                 ar_weight: float = 10.0, ar_teacher: str = "labels", consistency_reduction: str = "mean",
                 ar_prompt: bool = True, label_smoothing: float = 0.0, **kwargs):
        if ar_teacher not in AR_TEACHERS:
            raise ConfigError(f"method.ar_teacher={ar_teacher!r}: choose one of {list(AR_TEACHERS)}")
        check_count("method.n_tokens", n_tokens)
        losses.check_distance(distance, jsd_beta)
        losses.check_reduction("method.consistency_reduction", consistency_reduction)
        if isinstance(ar_weight, bool) or not isinstance(ar_weight, (int, float)) or not ar_weight >= 0:
            raise ConfigError(f"method.ar_weight={ar_weight!r}: must be a number >= 0 (ω of CLLM eq. 7)")
        if not isinstance(ar_prompt, bool):
            raise ConfigError(f"method.ar_prompt={ar_prompt!r}: true (the prompt's pairs too) or false")
        if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) or \
                not 0 <= label_smoothing < 1:
            raise ConfigError(f"method.label_smoothing={label_smoothing!r}: must be a number in [0, 1)")
        super().__init__(model_spec, n_tokens=n_tokens, distance=distance, jsd_beta=jsd_beta, ar_weight=ar_weight,
                         ar_teacher=ar_teacher, consistency_reduction=consistency_reduction, ar_prompt=ar_prompt,
                         label_smoothing=label_smoothing, **kwargs)
        self.original: torch.nn.Module | None = None

    @property
    def frozen(self) -> tuple[str, ...]:
        return ("original",) if self.hparams.ar_teacher == "original" else ()

    def build_models(self) -> None:
        super().build_models()
        if self.frozen and self.original is None:
            self.original = self.load_frozen()

    def _ar_labels(self, labels: torch.Tensor, ids: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        """``labels`` (``logits[t]`` predicts ``labels[t]``: the answer's tokens), with the prompt's next-token pairs
        (t -> ids[t+1], both in the ``prompt`` mask) added under ``ar_prompt``."""
        if not self.hparams.ar_prompt:
            return labels
        pairs = F.pad(prompt[:, :-1] & prompt[:, 1:], (0, 1), value=False)
        return torch.where(pairs, F.pad(ids[:, 1:], (0, 1)), labels)

    @staticmethod
    def _logits(model: torch.nn.Module, read: torch.Tensor, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``model``'s logits [B, K, V] at the K columns where ``read`` [B, T] marks a row, and those columns: the LM
        head runs there alone (transformers' ``logits_to_keep``), so a position no loss reads costs it nothing."""
        columns = read.any(0).nonzero()[:, 0]
        return model(**inputs, logits_to_keep=columns).logits, columns

    def _ar(self, logits: torch.Tensor, labels: torch.Tensor, columns: torch.Tensor, **inputs) -> torch.Tensor:
        """L_AR at the positions ``labels`` marks (``logits`` at ``columns`` of them; ``logits[t]`` predicts
        ``labels[t]``): the mean cross-entropy of the labels (eq. 6; label-smoothed by ε), or the mean forward KL
        from the original model's distribution there, the original run on the same ``inputs``; 0 in the graph when
        no position is marked."""
        labels = labels[:, columns]
        at = labels != IGNORE_INDEX
        if not at.any():
            return logits.sum() * 0.0
        if self.hparams.ar_teacher == "labels":
            return F.cross_entropy(logits[at].float(), labels[at], label_smoothing=self.hparams.label_smoothing)
        with torch.no_grad():
            original = self.original(**inputs, logits_to_keep=columns).logits
        return losses.pointwise(logits[at], original[at], "forward_kl").mean()

    def _losses(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(L_consistency, L_AR) of a batch."""
        raise NotImplementedError

    def _step(self, batch: dict, stage: str) -> torch.Tensor:
        consistency, ar = self._losses(batch)
        loss = consistency + self.hparams.ar_weight * ar  # CLLM eq. 7
        rows = batch["input_ids"].size(0)
        self.log(f"{stage}/consistency", consistency, batch_size=rows, sync_dist=True)
        self.log(f"{stage}/ar", ar, batch_size=rows, sync_dist=True)
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=rows, sync_dist=True)
        return loss

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._step(batch, "val")
