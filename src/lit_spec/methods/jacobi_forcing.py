"""``method=jacobi_forcing``: Jacobi Forcing (Hu, Kou, Fu, Rajbhandari, Rosing, He, Deng, Zhang 2025, arXiv
2512.14681), CLLM's successor: the model learns to predict, from noisy blocks of its own Jacobi trajectories as
context, what it predicts from the clean ones.

One forward per batch over the packed sequences of ``data=noisy_trajectories`` (noisy and clean copy of every block
under the noise-aware causal mask, Fig. 6) gives both terms of L = L_consistency + ω·L_AR (ω = 10, the authors'
training code). With D_jt = D( q_θ−(· | x, l_<j, l_j,≤t) ‖ q_θ(· | x, k_<j, k_j,≤t) ), d_j the first wrong token of
the noisy block k_j, l the clean blocks (fixed points), x the prompt, K the record's compared pairs (j, t ≥ d_j) and
T its blocks:

    L_consistency = (1/T) · (1/K) Σ_j Σ_{t ≥ d_j} D_jt      (``mean``: the authors' code, the default; per record)
                  = mean over blocks j of Σ_{t ≥ d_j} D_jt   (``sum``: the paper's form)
    L_AR          = mean over x's and the answer's tokens of −log q_θ(l_i | x, l_<i)   (the clean stream is plain AR;
                    the answer's alone with ``ar_prompt=false``)

(hao-ai-lab/JacobiForcing ``soft_flexattn_cllm_trainer_multiblock.py``: ``soft_cross_entropy`` over the kept pairs,
divided by T; the AR cross-entropy over the prompt's, the bridges' and the clean blocks' pairs, ×10.)

The teacher q_θ− is the clean copy's distribution in the same forward, detached (stop-gradient). The authors' code
takes the soft cross-entropy to that teacher, which has the gradient of D = forward KL (the default here). The
paper's section and equation numbers are not cited: its method text was not reachable from here (the abstract, Fig. 6
and the authors' code were). ``decoders()`` offers plain Jacobi and the paper's multi-block decoding with rejection
recycling over the trained model; the export is a plain HF model, as CLLM's.
"""

from __future__ import annotations

import torch

from lit_spec.data import IGNORE_INDEX, NoisyTrajectoryDataModule
from lit_spec.decoding.jacobi import JacobiDecoder
from lit_spec.decoding.masks import CONTEXT, attention_mask, noise_aware
from lit_spec.decoding.multiblock import MultiBlockDecoder, check_settings
from lit_spec.methods import losses
from lit_spec.methods.consistency import ConsistencyModule


class PackedConsistencyModule(ConsistencyModule):
    """The one-forward step over packed (noisy, clean) blocks that Jacobi Forcing and packed CLLM share (the module
    doc's terms); a subclass says what a noisy block reads (``noisy_reads_clean``: the clean blocks before it, CLLM's
    context c; else the noisy ones, Jacobi Forcing's) and offers its decoders."""

    datamodule_class = NoisyTrajectoryDataModule
    noisy_reads_clean = False

    def decoders(self, **sampling) -> dict:
        return {} if sampling else {"jacobi": JacobiDecoder(self.model, n_tokens=self.hparams.n_tokens)}   # greedy only

    def _losses(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        hp = self.hparams
        visible = noise_aware(batch["streams"], batch["position_ids"],
                              batch["block_ids"] if self.noisy_reads_clean else None)
        none_before = visible.new_zeros(visible.size(0), 0)        # no cache: the whole mask is the block's
        mask = attention_mask(none_before, visible, next(self.model.parameters()).dtype)
        inputs = {"input_ids": batch["input_ids"], "attention_mask": mask, "position_ids": batch["position_ids"]}
        labels = self._ar_labels(batch["labels"], batch["input_ids"], batch["streams"] == CONTEXT)
        row, noisy, clean, block = batch["pairs"].unbind(-1)
        read = labels != IGNORE_INDEX
        read[row, noisy] = True
        read[row, clean] = True
        logits, columns = self._logits(self.model, read, **inputs)
        noisy, clean = torch.searchsorted(columns, noisy), torch.searchsorted(columns, clean)
        d = losses.pointwise(logits[row, noisy], logits[row, clean], hp.distance, hp.jsd_beta)
        consistency = self._reduce(d, row, block, batch["blocks"], logits)
        return consistency, self._ar(logits, labels, columns, **inputs)

    def _reduce(self, d: torch.Tensor, row: torch.Tensor, block: torch.Tensor, blocks: torch.Tensor,
                like: torch.Tensor) -> torch.Tensor:
        """L_consistency from the pairs' distances ``d`` (module doc): per record Σ D / (K·T), averaged over the
        batch's records; or the mean over the batch's blocks of each one's Σ D."""
        if self.hparams.consistency_reduction == "sum" or d.numel() == 0:
            return losses.mean_of_sums(d, block, like)
        rows = len(blocks)
        pairs = losses.group_sums(torch.ones_like(d), row, rows).clamp(min=1)
        return (losses.group_sums(d, row, rows) / pairs / blocks).mean()


class JacobiForcingModule(PackedConsistencyModule):
    """Args (besides ``ConsistencyModule``'s: n_tokens, the block size trained and decoded; distance; ar_weight, ω):
        blocks, spawn_ratio, pool_size: the ``multiblock`` decoder's K, r and rejection-recycling pool
            (``conf/decoding/multiblock.yaml``).
    """

    data_configs = ("data=noisy_trajectories (the Jacobi trajectories of data=trajectories, packed with noisy "
                    "blocks; noisy_trajectories_tiny: the offline default's)")

    def __init__(self, model_spec, n_tokens: int = 16, distance: str = "forward_kl", jsd_beta: float = 0.5,
                 ar_weight: float = 10.0, blocks: int = 2, spawn_ratio: float = 0.85, pool_size: int = 4, **kwargs):
        decoder = {"blocks": blocks, "spawn_ratio": spawn_ratio, "pool_size": pool_size}
        check_settings(n_tokens, prefix="method.", **decoder)   # bad decoder settings fail before training
        super().__init__(model_spec, n_tokens=n_tokens, distance=distance, jsd_beta=jsd_beta, ar_weight=ar_weight,
                         **decoder, **kwargs)

    def decoders(self, **sampling) -> dict:
        hp = self.hparams
        if sampling:        # Jacobi decoding is greedy only
            return {}
        return {"jacobi": JacobiDecoder(self.model, n_tokens=hp.n_tokens),
                "multiblock": MultiBlockDecoder(self.model, n_tokens=hp.n_tokens, blocks=hp.blocks,
                                                spawn_ratio=hp.spawn_ratio, pool_size=hp.pool_size)}
