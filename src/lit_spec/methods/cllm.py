"""``method=cllm``: consistency training of a causal LM for Jacobi decoding (CLLM, Kou et al. 2024, §3.2.2, Alg. 2).

On a collected Jacobi trajectory (``data=trajectories``) the model learns to map any state y of a block's trajectory
to what it predicts from the fixed point y* (global consistency, eq. 4) or from the next state y^(j+1) (local, eq. 5):

    L_GC = E [ sum_i D( q_θ−(· | y*_<i, x) ‖ q_θ(· | y_<i, x) ) ]            (eq. 4; θ− = stopgrad(θ))

plus the AR loss that keeps it close to the target (eq. 6), L = L_consistency + ω·L_AR (eq. 7). The teacher q_θ− is
the same model, detached. As the authors' code (hao-ai-lab/Consistency_LLM ``cllm_trainer_global.py``) has it by
default: L_GC is the mean over the compared tokens, and L_AR a label-smoothed cross-entropy over the block's own
sequence, c + y* (``ar_sequence=block``); that sequence is the global teacher's, so one forward with gradients gives
both the AR term and, detached, the teacher. The paper's eq. 4 and 6 are ``consistency_reduction=sum``,
``ar_sequence=answer``, ``ar_prompt=false``, ``label_smoothing=0``. The result is a plain HF model: ``export`` is the
base class's, and ``decoders()`` offers the Jacobi decoder it was trained for.
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
from lit_spec.methods.jacobi_forcing import PackedConsistencyModule

CONSISTENCY = ("global", "local")
AR_SEQUENCES = ("block", "answer")


class CLLMModule(ConsistencyModule):
    """Args (besides ``ConsistencyModule``'s: n_tokens, the block size of ``decoders()`` and of the trajectories;
    distance, D of eq. 4-5, forward KL the paper's; ar_weight, ω of eq. 7, 10: Table 6's L_GC + 10·L_AR row, whose
    3.0x / 56.4 is Table 1's GSM8K CLLM):
        consistency: ``global`` (eq. 4, the paper's choice) or ``local`` (eq. 5).
        ar_target: what the AR loss fits (``generated``: the target's answer l, eq. 6; ``dataset``: the reference);
            read by the datamodule (``data.ar_target``), recorded here.
        ar_sequence: the AR term's sequence: ``block`` (the context and the block's fixed point, c + y*: the authors'
            code) or ``answer`` (the prompt and the whole answer, eq. 6).
        consistency_reduction: ``mean`` over the batch's compared tokens (the authors' code) or ``sum`` over each
            item's block, averaged over items (eq. 4).
        label_smoothing: ε, 0.1 as the authors' code (transformers' ``LabelSmoother``); 0: eq. 6.
    """

    datamodule_class = TrajectoryDataModule
    data_configs = "data=trajectories (collected Jacobi trajectories: data.path, or data.collect to collect them)"

    def __init__(self, model_spec, n_tokens: int = 16, consistency: str = "global", distance: str = "forward_kl",
                 jsd_beta: float = 0.5, ar_weight: float = 10.0, ar_target: str = "generated",
                 ar_sequence: str = "block", label_smoothing: float = 0.1, **kwargs):
        if consistency not in CONSISTENCY:
            raise ConfigError(f"method.consistency={consistency!r}: choose one of {list(CONSISTENCY)}")
        if ar_target not in AR_TARGETS:
            raise ConfigError(f"method.ar_target={ar_target!r}: choose one of {list(AR_TARGETS)}")
        if ar_sequence not in AR_SEQUENCES:
            raise ConfigError(f"method.ar_sequence={ar_sequence!r}: choose one of {list(AR_SEQUENCES)}")
        if ar_sequence == "block" and ar_target != "generated":
            raise ConfigError(f"method.ar_target={ar_target!r} fits the dataset's answer, which ar_sequence=block "
                              "(the block's fixed point) does not read: set method.ar_sequence=answer")
        super().__init__(model_spec, n_tokens=n_tokens, consistency=consistency, distance=distance,
                         jsd_beta=jsd_beta, ar_weight=ar_weight, ar_target=ar_target, ar_sequence=ar_sequence,
                         label_smoothing=label_smoothing, **kwargs)

    def decoders(self, **sampling) -> dict:
        return {} if sampling else {"jacobi": JacobiDecoder(self.model, n_tokens=self.hparams.n_tokens)}   # greedy only

    def _ar_sequence(self, batch: dict) -> tuple[dict, torch.Tensor]:
        """The AR term's inputs and labels (``logits[t]`` predicts ``labels[t]``): c + y* or prompt + answer."""
        if self.hparams.ar_sequence == "block":
            ids, attention, prompt = batch["teacher_ids"], batch["attention_mask"], batch["prompt_mask"]
        else:
            ids, attention = batch["ar_input_ids"], batch["ar_attention_mask"]
            prompt = attention.bool() & (batch["ar_labels"] == IGNORE_INDEX)
        answer = torch.where(attention.bool() & ~prompt, ids, IGNORE_INDEX)
        labels = self._ar_labels(F.pad(answer[:, 1:], (0, 1), value=IGNORE_INDEX), ids, prompt & attention.bool())
        return {"input_ids": ids, "attention_mask": attention}, labels

    def _losses(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        hp = self.hparams
        inputs, labels = self._ar_sequence(batch)
        # logits at t predict token t+1; the mask marks the t's of the block's predictions (eq. 4 / 5)
        compared, attention = batch["consistency_mask"], batch["attention_mask"]
        shared = hp.consistency == "global" and hp.ar_sequence == "block"   # c + y*: the AR term's and θ−'s input
        read = (labels != IGNORE_INDEX) | compared if shared else labels != IGNORE_INDEX
        ar_logits, ar_columns = self._logits(self.model, read, **inputs)
        student, columns = self._logits(self.model, compared, input_ids=batch["input_ids"], attention_mask=attention)
        if shared:
            teacher = ar_logits.detach()[:, torch.searchsorted(ar_columns, columns)]   # θ− = stopgrad(θ)
        else:
            teacher_ids = batch["teacher_ids"] if hp.consistency == "global" else batch["local_teacher_ids"]
            with torch.no_grad():  # θ− = stopgrad(θ): the same model, no graph
                teacher, _ = self._logits(self.model, compared, input_ids=teacher_ids, attention_mask=attention)
        consistency = losses.distance(student, teacher, compared[:, columns], hp.distance, hp.jsd_beta,
                                      hp.consistency_reduction)
        return consistency, self._ar(ar_logits, labels, ar_columns, **inputs)    # eq. 6 as a mean over its tokens


class PackedCLLMModule(PackedConsistencyModule):
    """``method=cllm_packed``: CLLM in one forward per record, as the authors' later CLLM trainer runs it
    (hao-ai-lab/JacobiForcing ``train/soft_flexattn_cllm_trainer.py``). Every block's student state y (drawn as
    Algorithm 2 draws it: ``data.noise_schedule=uniform``) is packed after the prompt beside its fixed point y*, and
    reads the prompt, the fixed points before it and itself: the student input c + y of eq. 4, whose teacher c + y*
    is the clean copy in the same forward. One forward per record instead of one per block, and the AR term over the
    clean stream, prompt + l, once. The terms are Jacobi Forcing's (``jacobi_forcing`` module doc); the export is a
    plain HF model that decodes with ``jacobi``."""

    noisy_reads_clean = True
    data_configs = "data=noisy_trajectories data.noise_schedule=uniform (every block of a record packed in one item)"
