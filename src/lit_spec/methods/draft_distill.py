"""``method=draft_distill``: train a small draft model to match a frozen target, for speculative decoding (and
Ouroboros, which drafts with such a model).

The ``model`` group is the TARGET (the teacher q_T: frozen, eval mode, no gradient, never checkpointed or exported);
``method.student`` is the DRAFT being trained (any model spec: the tiny draft stage, a hub id, a local directory).
They must share the vocabulary (the draft's tokens are fed to the target as they are): checked from their configs
when the module is built, before any weights load, a ``ConfigError`` otherwise.

DistillSpec (Zhou et al. 2023, "Improving speculative decoding via knowledge distillation"; cited by Ouroboros §5.1,
whose training-free drafts leave distillation open (§3.5), and by CLLM for the "distilled LLaMA-160m" speculative
baseline of its Tables 1-2) trains the draft to match the target's next-token distribution — a drafted token is
accepted with probability 1 − TVD(target, draft) in speculative sampling (Leviathan et al. 2023), and greedily when
both argmaxes agree — and compares divergences and data sources. The two data sources here (``objective``):

- ``kl`` — token-level distillation on the dataset's text: the teacher's logits on prompt + answer, and
  ``D(teacher ‖ student)`` on the answer positions (``methods.losses.distance``: forward_kl (default), reverse_kl,
  jsd with ``jsd_beta``), averaged over answer tokens;
- ``generated`` — sequence-level distillation (Kim & Rush 2016, DistillSpec's teacher-generated data): the teacher
  greedily answers the batch's prompts on the fly (``lit_spec.decoding.generate(..., method="ar")``, batched, up to
  ``max_new_tokens``) and the student gets the cross-entropy of those answers, optionally plus the KL term on the
  same text.

    L = kl_weight · KL + ce_weight · CE        (both token means over the answer positions of the chosen text)

``kl_weight`` / ``ce_weight`` default (null) to 1 / 0 for ``kl`` and 0 / 1 for ``generated``. Logged:
``train/ce``, ``train/loss`` and, when the teacher runs (kl_weight > 0), ``train/kl`` and ``train/agreement``;
validation runs the same text source and logs ``val/kl``, ``val/ce``, ``val/loss`` and ``val/agreement``: the share
of answer positions where the student's argmax equals the teacher's — what greedy speculative decoding accepts per
drafted token when the text is the teacher's own (``generated``); all weighted by token counts.

``decoders()`` offers speculative decoding of the TEACHER with the student as its draft, so the speedup callback
measures it against the teacher's own AR decoding (the callback's AR baseline is ``self.model``: the teacher).
``export`` writes the STUDENT with ``save_pretrained`` (safetensors) and the teacher's tokenizer (the ids it was
trained on): ``python -m lit_spec.bench`` takes it as its ``draft``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_spec.data import IGNORE_INDEX, collate_answers
from lit_spec.decoding import generate
from lit_spec.decoding.draft import check_draft
from lit_spec.decoding.speculative import SpeculativeDecoder
from lit_spec.decoding.state import eos_ids, until_eos
from lit_spec.errors import ConfigError, check_count
from lit_spec.methods import losses
from lit_spec.methods.frozen_base import FrozenBaseModule
from lit_spec.models import HFModelSpec, spec_from_dict
from lit_spec.strategies import weights_sharded

OBJECTIVES = ("kl", "generated")
# (kl_weight, ce_weight) when left null
DEFAULT_WEIGHTS = {"kl": (1.0, 0.0), "generated": (0.0, 1.0)}


def _student_spec(student) -> HFModelSpec:
    if isinstance(student, HFModelSpec):
        return student
    if isinstance(student, dict) and "class" in student:       # HFModelSpec.to_dict(): restored from a checkpoint
        return spec_from_dict(student)
    raise ConfigError(f"method.student={student!r}: give the draft model to train as a model config, e.g. "
                      "model@method.student=tiny_draft, or a spec ({_target_: lit_spec.models.HFModelSpec, "
                      "name_or_path: <hub id or dir>})")


def _weight(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"method.{name}={value!r}: must be a number >= 0")
    return float(value)


def answer_positions(labels: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the positions t whose logits predict an answer token (label t+1 is not ignored)."""
    return F.pad(labels[:, 1:] != IGNORE_INDEX, (0, 1), value=False)


class DraftDistillModule(FrozenBaseModule):
    """Args (besides ``MethodModule``'s; ``model_spec`` is the frozen target):
        student: the draft model's spec (``HFModelSpec`` or its ``to_dict()``); trained, checkpointed, exported.
        objective: ``kl`` (dataset text, token-level) or ``generated`` (the teacher's greedy answers, sequence-level).
        distance / jsd_beta: D of the KL term (``forward_kl`` | ``reverse_kl`` | ``jsd``; GKD's β for jsd).
        kl_weight / ce_weight: weights of the two terms; null: 1/0 (kl) or 0/1 (generated).
        max_new_tokens: longest teacher answer generated per prompt (``generated``).
        gamma: draft tokens per step of the speculative decoder that ``decoders()`` offers.
    """

    exported = "student"     # ``export`` writes the student (keys ``student.*`` when consolidated) + the tokenizer

    def __init__(self, model_spec, student=None, objective: str = "kl", distance: str = "forward_kl",
                 jsd_beta: float = 0.5, kl_weight: float | None = None, ce_weight: float | None = None,
                 max_new_tokens: int = 128, gamma: int = 4, **kwargs):
        if objective not in OBJECTIVES:
            raise ConfigError(f"method.objective={objective!r}: choose one of {list(OBJECTIVES)}")
        losses.check_distance(distance, jsd_beta)
        default_kl, default_ce = DEFAULT_WEIGHTS[objective]
        kl_weight = _weight("kl_weight", default_kl if kl_weight is None else kl_weight)
        ce_weight = _weight("ce_weight", default_ce if ce_weight is None else ce_weight)
        if kl_weight == 0 and ce_weight == 0:
            raise ConfigError("method.kl_weight and method.ce_weight are both 0: nothing would be trained")
        max_new_tokens = check_count("method.max_new_tokens", max_new_tokens)
        gamma = check_count("method.gamma", gamma)
        spec = _student_spec(student)
        student = spec.to_dict()   # hparams hold primitives only (this local is what save_hyperparameters reads)
        super().__init__(model_spec, student=student, objective=objective, distance=distance, jsd_beta=jsd_beta,
                         kl_weight=kl_weight, ce_weight=ce_weight, max_new_tokens=max_new_tokens, gamma=gamma,
                         **kwargs)
        self.student_spec = spec
        self.check_vocabularies()   # here, not in configure_model: a bad student stops before the Trainer starts

    # ---- models ---------------------------------------------------------------------------------------------
    def check_vocabularies(self) -> None:
        """Check that teacher and student can be loaded (the run's stages built them) and that both configs name
        the same vocabulary size: reads their config.json files, no weights."""
        for spec in (self.model_spec, self.student_spec):
            spec.validate()     # a clear error for a missing model or a tokenizer that does not fit it
        teacher, student = self.model_spec.config_vocab_size(), self.student_spec.config_vocab_size()
        if teacher is not None and student is not None and teacher != student:
            raise ConfigError(
                f"method.student ({self.student_spec.name_or_path}) has a vocabulary of {student} tokens but the "
                f"target model ({self.model_spec.name_or_path}) has {teacher}: a draft must share the target's "
                "tokenizer (its tokens are fed to the target as they are)")

    def build_trainable(self) -> torch.nn.Module:
        student = self.student_spec.load_model().train()
        check_draft(self.model, student, "draft_distill")    # the LM heads' real sizes
        return student

    def decoders(self, **sampling) -> dict:
        return {"speculative": SpeculativeDecoder(self.model, draft_model=self.student, gamma=self.hparams.gamma,
                                                  **sampling)}

    # ---- the teacher's answers (objective=generated) --------------------------------------------------------
    def _eos(self):
        config = getattr(self.model, "generation_config", None)
        config = config if config is not None else self.model.config
        return config.eos_token_id if config.eos_token_id is not None else self.model.config.eos_token_id

    @torch.no_grad()
    def teacher_answers(self, batch: dict) -> dict:
        """The batch's prompts, answered greedily by the teacher (up to ``max_new_tokens``, through EOS), as a
        right-padded batch in the datamodule's format (labels: the teacher's answer tokens)."""
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        prompt_len = (mask.sum(-1) - (labels != IGNORE_INDEX).sum(-1)).tolist()   # prompt first, then the answer
        rows, width = ids.size(0), max(prompt_len)
        prompts = ids.new_zeros(rows, width)                                     # left-padded for the decoder
        prompt_mask = mask.new_zeros(rows, width)
        for r, n in enumerate(prompt_len):
            prompts[r, width - n:] = ids[r, :n]
            prompt_mask[r, width - n:] = 1
        eos = self._eos()
        # under sharded weights (every forward collective) decode the full length on every rank (EOS cut below), else
        # stop each row at EOS
        sharded = self._trainer is not None and weights_sharded(self._trainer.strategy)
        out = generate(self.model, prompts, method="ar", max_new_tokens=self.hparams.max_new_tokens,
                       eos_token_id=None if sharded else eos, attention_mask=prompt_mask)
        stop = eos_ids(eos)
        pairs = [(ids[r, :n].tolist(), until_eos(out.sequences[r, width:].tolist(), stop))
                 for r, n in enumerate(prompt_len)]
        return {k: v.to(ids.device) for k, v in collate_answers(pairs, pad_token_id=0).items()}

    # ---- losses ---------------------------------------------------------------------------------------------
    def terms(self, batch: dict, with_teacher: bool) -> dict[str, torch.Tensor]:
        """Token means over the answer positions of ``batch``: ``ce`` always; ``kl`` and ``agreement`` (a float
        share, no graph) with the teacher's forward; ``tokens``: how many positions were compared."""
        hp = self.hparams
        ids, mask = batch["input_ids"], batch["attention_mask"]
        where = answer_positions(batch["labels"])
        n = int(where.sum())
        logits = self.student(input_ids=ids, attention_mask=mask).logits
        out = {"tokens": n}
        if n == 0:   # nothing to learn from in this batch: zero terms that keep the student's graph (DDP)
            zero = logits.sum() * 0.0
            out.update(ce=zero, **({"kl": zero} if with_teacher else {}))
            return out
        picked = logits[where].float()
        out["ce"] = F.cross_entropy(picked, batch["labels"][:, 1:][where[:, :-1]])
        if with_teacher:
            with torch.no_grad():
                teacher = self.model(input_ids=ids, attention_mask=mask).logits
            out["kl"] = losses.distance(logits, teacher, where, hp.distance, hp.jsd_beta, reduction="mean")
            out["agreement"] = float((picked.argmax(-1) == teacher[where].argmax(-1)).float().mean())
        return out

    def _step(self, batch: dict, stage: str) -> torch.Tensor:
        hp, val = self.hparams, stage == "val"
        if hp.objective == "generated":
            batch = self.teacher_answers(batch)
        t = self.terms(batch, with_teacher=val or hp.kl_weight > 0)
        loss = hp.ce_weight * t["ce"] + (hp.kl_weight * t["kl"] if "kl" in t else 0.0)
        size = max(t["tokens"], 1) if val else batch["input_ids"].size(0)
        for name in ("kl", "ce"):
            if name in t:
                self.log(f"{stage}/{name}", t[name], batch_size=size, sync_dist=True)
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=size, sync_dist=True)
        if "agreement" in t:     # with the teacher's forward (validation; training when kl_weight > 0)
            self.log(f"{stage}/agreement", t["agreement"], prog_bar=val, batch_size=size, sync_dist=True)
        return loss
