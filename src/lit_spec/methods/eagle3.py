"""EAGLE-3, methods part (the models/ and decoding/ files of this name build the draft and decode with it):
``method=eagle3``, the EAGLE-3 draft trained on a frozen target by the training-time test (Li et al. 2025, §3.3).

Every batch runs the frozen target once, without gradient, for its hidden states (the draft's features) and its
logits (the teacher). The draft then unrolls ``steps`` steps over whole sequences, each reading its own previous state
(``Eagle3Draft.forward``); step i of row n predicts token n+2+i, the teacher being the target's distribution at
position n+1+i restricted to the draft vocabulary:

    L = sum_i w^i · L_i,   L_i = sum_n [counted] · H(p_target(· | x_<=n+1+i), q_draft,i(· | row n)) / real tokens

(the authors' ``ploss_weight = 0.8 ** i``, a soft cross-entropy averaged over the sequence's tokens), where a position
counts when the token after it is an answer token and the target's argmax there is in the draft vocabulary. Logged
per step i: the loss and ``acc`` (draft top-1 = target argmax, over the answer positions: a token outside the draft
vocabulary counts as a miss), and ``expected_tau`` = 1 + sum_d prod_{i<d} acc_i, the τ a chain of ``steps`` tokens
would reach if each step's acceptance were independent.

The draft vocabulary (``draft_vocab_size`` tokens, ``d2t``/``t2d``) is fixed before the first step from the training
answers' token counts (``AnswerBatches.answer_token_counts``), as the authors' ``scandata`` does; the export is the
draft (``save_heads``), which ``decoding=eagle3`` loads. With ``data.base_states`` the target's states come from the
cache (its ``layers``: the draft's feature layers and the last) instead of a forward per batch.
"""

from __future__ import annotations

import logging

import torch

from lit_spec.data import IGNORE_INDEX
from lit_spec.decoding.eagle3 import DYNAMIC, Eagle3Decoder
from lit_spec.errors import ConfigError, check_count
from lit_spec.methods.frozen_base import FrozenBaseModule, check_cached_states
from lit_spec.methods.losses import soft_cross_entropy
from lit_spec.models.eagle3 import Eagle3Draft, shifted

log = logging.getLogger(__name__)


class Eagle3Module(FrozenBaseModule):
    """Args (besides ``MethodModule``'s): layers (the target's feature layers, ``hidden_states`` indices; null: the
    authors' inputs of layers 2, n/2, n-3), draft_vocab_size (N), steps (the training-time test's unroll),
    step_weight (w), decoder (the ``eagle3`` decoder's settings the speedup callback measures: tree, depth, top_k,
    total_tokens)."""

    def __init__(self, model_spec, layers=None, draft_vocab_size: int = 32000, steps: int = 7,
                 step_weight: float = 0.8, decoder: dict | None = None, **kwargs):
        check_count("method.draft_vocab_size", draft_vocab_size)
        check_count("method.steps", steps)
        if not 0 < step_weight <= 1:
            raise ConfigError(f"method.step_weight={step_weight}: must be in (0, 1] (the authors': 0.8)")
        decoder = dict(decoder or {"tree": DYNAMIC})
        super().__init__(model_spec, layers=None if layers is None else list(layers),
                         draft_vocab_size=draft_vocab_size, steps=steps, step_weight=step_weight, decoder=decoder,
                         **kwargs)

    def build_trainable(self) -> Eagle3Draft:
        draft = Eagle3Draft.for_target(self.model.config, self.hparams.draft_vocab_size, self.hparams.layers)
        return draft.init_from_base(self.model, self._answer_counts(draft))

    def _answer_counts(self, draft: Eagle3Draft) -> torch.Tensor | None:
        """The training answers' token counts, when a trainer holds the data (a copy built to decode has none: its
        vocabulary comes with the trained weights); cached base states are checked to be this draft's layers."""
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is None:
            return None
        check_cached_states(getattr(datamodule, "base_states", None), draft.layers,
                            self.model.config.num_hidden_layers, "eagle3")
        counts = datamodule.answer_token_counts(draft.vocab_size)
        kept = counts.sort(descending=True).values[: draft.draft_vocab_size].sum()
        log.info("eagle3: draft vocabulary of %d tokens, %d distinct in the training answers, covering %.1f%% of "
                 "their %d tokens", draft.draft_vocab_size, int((counts > 0).sum()),
                 100 * float(kept) / max(int(counts.sum()), 1), int(counts.sum()))
        return counts

    def decoders(self, **sampling) -> dict:
        return {"eagle3": Eagle3Decoder(self.model, self.heads, **self.hparams.decoder, **sampling)}

    def _target(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's fused features [B, T, H] of the frozen target's states (``fc`` trains; no gradient reaches the
        target) and the target's logits [B, T, V]."""
        states, logits = self.base_states(batch, self.heads.layers)
        return self.heads.features(states), logits

    def _step(self, batch: dict, stage: str) -> torch.Tensor:
        hp, draft = self.hparams, self.heads
        ids, valid = batch["input_ids"], batch["attention_mask"].bool()
        features, logits = self._target(batch)
        answer_next = shifted(batch["labels"] != IGNORE_INDEX, 1)           # at p: the token after p is an answer
        counted = answer_next & draft.t2d[logits.argmax(-1)]
        tokens = int(valid.sum())
        loss, accepted, tau = features.new_zeros(()), 1.0, 1.0
        for i, state in enumerate(draft(ids, features, valid, hp.steps)):
            rows, cols = shifted(counted, 1 + i).nonzero(as_tuple=True)     # row n: the teacher at n+1+i
            student = draft.logits(state[rows, cols])
            teacher = logits[rows, cols + 1 + i][:, draft.draft_ids]
            loss_i = soft_cross_entropy(student, teacher).sum() / tokens if rows.numel() else state.sum() * 0.0
            loss = loss + hp.step_weight ** i * loss_i
            answers = int(shifted(answer_next, 1 + i).sum())
            acc = float((student.argmax(-1) == teacher.argmax(-1)).sum()) / answers if answers else 0.0
            accepted *= acc
            tau += accepted
            self.log(f"{stage}/step{i}/loss", loss_i, batch_size=max(answers, 1), sync_dist=True)
            self.log(f"{stage}/step{i}/acc", acc, batch_size=max(answers, 1), sync_dist=True)
        self.log(f"{stage}/expected_tau", tau, batch_size=ids.size(0), sync_dist=True)
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=ids.size(0), sync_dist=True)
        return loss
