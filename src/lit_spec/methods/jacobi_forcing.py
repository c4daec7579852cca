"""``method=jacobi_forcing``: Jacobi Forcing (Hu, Kou, Fu, Rajbhandari, Rosing, He, Deng, Zhang 2025, arXiv
2512.14681), CLLM's successor: the model learns to predict, from noisy blocks of its own Jacobi trajectories as
context, what it predicts from the clean ones.

One forward per batch over the packed sequences of ``data=noisy_trajectories`` (noisy and clean copy of every block
under the noise-aware causal mask, Fig. 6) gives both terms of L = L_consistency + ω·L_AR (ω = 10, the authors'
training code):

    L_consistency = mean over blocks j of  Σ_{t ≥ d_j} D( q_θ−(· | x, l_<j, l_j,≤t) ‖ q_θ(· | x, k_<j, k_j,≤t) )
    L_AR          = mean over answer tokens of  −log q_θ(l_i | x, l_<i)          (the clean stream is plain AR)

with d_j the first wrong token of the noisy block k_j, l the clean blocks (fixed points), x the prompt.

The teacher q_θ− is the clean copy's distribution in the same forward, detached (stop-gradient). The authors' code
takes the soft cross-entropy to that teacher, which has the gradient of D = forward KL (the default here). The
paper's section and equation numbers are not cited: its method text was not reachable from here (the abstract, Fig. 6
and the authors' code were). ``decoders()`` offers plain Jacobi and the paper's multi-block decoding with rejection
recycling over the trained model; the export is a plain HF model, as CLLM's.
"""

from __future__ import annotations

import torch

from lit_spec.data import NoisyTrajectoryDataModule
from lit_spec.decoding.jacobi import JacobiDecoder
from lit_spec.decoding.masks import attention_mask, noise_aware
from lit_spec.decoding.multiblock import MultiBlockDecoder, check_settings
from lit_spec.methods import losses
from lit_spec.methods.consistency import ConsistencyModule


class JacobiForcingModule(ConsistencyModule):
    """Args (besides ``ConsistencyModule``'s: n_tokens, the block size trained and decoded; distance; ar_weight, ω):
        blocks, spawn_ratio, pool_size: the ``multiblock`` decoder's K, r and rejection-recycling pool
            (``conf/decoding/multiblock.yaml``).
    """

    datamodule_class = NoisyTrajectoryDataModule
    data_configs = ("data=noisy_trajectories (the Jacobi trajectories of data=trajectories, packed with noisy "
                    "blocks; noisy_trajectories_tiny: the offline default's)")

    def __init__(self, model_spec, n_tokens: int = 16, distance: str = "forward_kl", jsd_beta: float = 0.5,
                 ar_weight: float = 10.0, blocks: int = 2, spawn_ratio: float = 0.85, pool_size: int = 4, **kwargs):
        decoder = {"blocks": blocks, "spawn_ratio": spawn_ratio, "pool_size": pool_size}
        check_settings(n_tokens, prefix="method.", **decoder)   # bad decoder settings fail before training
        super().__init__(model_spec, n_tokens=n_tokens, distance=distance, jsd_beta=jsd_beta, ar_weight=ar_weight,
                         **decoder, **kwargs)

    def decoders(self) -> dict:
        hp = self.hparams
        return {"jacobi": JacobiDecoder(self.model, n_tokens=hp.n_tokens),
                "multiblock": MultiBlockDecoder(self.model, n_tokens=hp.n_tokens, blocks=hp.blocks,
                                                spawn_ratio=hp.spawn_ratio, pool_size=hp.pool_size)}

    def _losses(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        hp = self.hparams
        visible = noise_aware(batch["streams"], batch["position_ids"])
        none_before = visible.new_zeros(visible.size(0), 0)        # no cache: the whole mask is the block's
        mask = attention_mask(none_before, visible, next(self.model.parameters()).dtype)
        logits = self.model(input_ids=batch["input_ids"], attention_mask=mask,
                            position_ids=batch["position_ids"]).logits
        row, noisy, clean, block = batch["pairs"].unbind(-1)
        d = losses.pointwise(logits[row, noisy], logits[row, clean], hp.distance, hp.jsd_beta)
        consistency = losses.mean_of_sums(d, block, logits)
        ar = self._ar(logits, batch["labels"], input_ids=batch["input_ids"], attention_mask=mask,
                      position_ids=batch["position_ids"])
        return consistency, ar
