"""What CLLM and Jacobi Forcing share: a causal LM trained on its own Jacobi trajectories with a consistency loss and
an AR loss, L = L_consistency + ω·L_AR (CLLM eq. 7; Jacobi Forcing keeps the form and ω = 10). Subclasses compute the
two terms (``_losses``) and offer their decoders; this base checks the shared settings, sums and logs."""

from __future__ import annotations

import torch

from lit_spec.errors import ConfigError, check_count
from lit_spec.methods import losses
from lit_spec.methods.method_module import MethodModule


class ConsistencyModule(MethodModule):
    """Args (besides ``MethodModule``'s):
        n_tokens: n, the Jacobi block size of ``decoders()``.
        distance: D of the consistency loss: ``forward_kl`` (both papers') | ``reverse_kl`` | ``jsd``; jsd_beta: β.
        ar_weight: ω.
    """

    def __init__(self, model_spec, n_tokens: int = 16, distance: str = "forward_kl", jsd_beta: float = 0.5,
                 ar_weight: float = 10.0, **kwargs):
        check_count("method.n_tokens", n_tokens)
        losses.check_distance(distance, jsd_beta)
        if isinstance(ar_weight, bool) or not isinstance(ar_weight, (int, float)) or not ar_weight >= 0:
            raise ConfigError(f"method.ar_weight={ar_weight!r}: must be a number >= 0 (ω of CLLM eq. 7)")
        super().__init__(model_spec, n_tokens=n_tokens, distance=distance, jsd_beta=jsd_beta, ar_weight=ar_weight,
                         **kwargs)

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
