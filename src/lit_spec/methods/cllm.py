"""``method=cllm``: consistency training of a causal LM for Jacobi decoding (CLLM, Kou et al. 2024, §3.2.2, Alg. 2).

On a collected Jacobi trajectory (``data=trajectories``) the model learns to map any state y of a block's trajectory
to what it predicts from the fixed point y* (global consistency, eq. 4) or from the next state y^(j+1) (local, eq. 5):

    L_GC = E [ sum_i D( q_θ−(· | y*_<i, x) ‖ q_θ(· | y_<i, x) ) ]            (eq. 4; θ− = stopgrad(θ))

plus the AR loss on the target's answer l that keeps it close to the target (eq. 6), L = L_consistency + ω·L_AR
(eq. 7). The teacher q_θ− is the same model in a forward under ``torch.no_grad()``. The result is a plain HF model:
``export`` is the base class's, and ``decoders()`` offers the Jacobi decoder it was trained for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_spec.data import IGNORE_INDEX, TrajectoryDataModule
from lit_spec.data.trajectory_data import AR_TARGETS
from lit_spec.decoding.jacobi import JacobiDecoder
from lit_spec.errors import ConfigError
from lit_spec.methods import losses
from lit_spec.methods.consistency import ConsistencyModule

CONSISTENCY = ("global", "local")


class CLLMModule(ConsistencyModule):
    """Args (besides ``ConsistencyModule``'s: n_tokens, the block size of ``decoders()`` and of the trajectories;
    distance, D of eq. 4-5, forward KL the paper's; ar_weight, ω of eq. 7, 10: Table 6's L_GC + 10·L_AR row, whose
    3.0x / 56.4 is Table 1's GSM8K CLLM):
        consistency: ``global`` (eq. 4, the paper's choice) or ``local`` (eq. 5).
        ar_target: what the AR loss fits (``generated``: the target's answer l, eq. 6; ``dataset``: the reference);
            read by the datamodule (``data.ar_target``), recorded here.
    """

    datamodule_class = TrajectoryDataModule
    data_configs = "data=trajectories (collected Jacobi trajectories: data.path, or data.collect to collect them)"

    def __init__(self, model_spec, n_tokens: int = 16, consistency: str = "global", distance: str = "forward_kl",
                 jsd_beta: float = 0.5, ar_weight: float = 10.0, ar_target: str = "generated", **kwargs):
        if consistency not in CONSISTENCY:
            raise ConfigError(f"method.consistency={consistency!r}: choose one of {list(CONSISTENCY)}")
        if ar_target not in AR_TARGETS:
            raise ConfigError(f"method.ar_target={ar_target!r}: choose one of {list(AR_TARGETS)}")
        super().__init__(model_spec, n_tokens=n_tokens, consistency=consistency, distance=distance,
                         jsd_beta=jsd_beta, ar_weight=ar_weight, ar_target=ar_target, **kwargs)

    def decoders(self) -> dict:
        return {"jacobi": JacobiDecoder(self.model, n_tokens=self.hparams.n_tokens)}

    def _losses(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        hp = self.hparams
        teacher_ids = batch["teacher_ids"] if hp.consistency == "global" else batch["local_teacher_ids"]
        with torch.no_grad():  # θ− = stopgrad(θ): the same model, no graph
            teacher = self.model(input_ids=teacher_ids, attention_mask=batch["attention_mask"]).logits
        student = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        # logits at position t predict token t+1; the mask marks the t's of the block's n predictions (eq. 4 / 5)
        consistency = losses.distance(student, teacher, batch["consistency_mask"], hp.distance, hp.jsd_beta)
        inputs = {"input_ids": batch["ar_input_ids"], "attention_mask": batch["ar_attention_mask"]}
        # eq. 6 as a mean over the answer tokens; logits at t predict token t+1
        labels = F.pad(batch["ar_labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
        ar = self._ar(self.model(**inputs).logits, labels, **inputs)
        return consistency, ar
