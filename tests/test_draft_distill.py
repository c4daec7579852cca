"""``method=draft_distill`` (lit_spec.methods.draft_distill): a student draft distilled into a frozen teacher.

The teacher and the student are micro tiny models (same BPE tokenizer, different sizes): the loss vanishes for a
copy of the teacher, only the student gets gradients, the ``generated`` objective trains on the teacher's own greedy
answers, a vocabulary mismatch stops before any weights load, and a micro run exports the student (plain
transformers) and checkpoints it without the teacher.
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from conftest import MICRO_MODEL, built_method
from transformers import AutoModelForCausalLM

from lit_spec.data import IGNORE_INDEX
from lit_spec.decoding import generate
from lit_spec.errors import ConfigError
from lit_spec.export import export_pretrained
from lit_spec.methods import DraftDistillModule
from lit_spec.methods.draft_distill import answer_positions
from lit_spec.training import run_training

# a smaller micro student with the teacher's tokenizer (model=tiny trains the same BPE for the same vocab_size)
STUDENT = ["model@method.student=tiny", "method.student.vocab_size=512", "method.student.hidden_size=16",
           "method.student.intermediate_size=32", "method.student.num_hidden_layers=1",
           "method.student.num_attention_heads=2", "method.student.num_key_value_heads=2"]
# the teacher itself as the student (same spec: same weights)
SAME = ["model@method.student=tiny"] + [o.replace("model.", "method.student.", 1) for o in MICRO_MODEL[1:]]


def distill_config(micro_config, *overrides, student=STUDENT, output_dir=None):
    return micro_config("method=draft_distill", *student, *overrides, output_dir=output_dir)


def _state(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_the_loss_vanishes_for_a_copy_of_the_teacher(micro_config):
    same, datamodule = built_method(distill_config(micro_config, student=SAME))
    other, _ = built_method(distill_config(micro_config))
    batch = next(iter(datamodule.val_dataloader()))
    for module in (same, other):
        module.eval()
    for distance in ("forward_kl", "reverse_kl", "jsd"):
        for module in (same, other):
            module.hparams.distance = distance
        with torch.no_grad():
            copy, distinct = same.terms(batch, with_teacher=True), other.terms(batch, with_teacher=True)
        assert copy["tokens"] == int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()) > 0
        assert copy["kl"].item() < 1e-6 and copy["agreement"] == 1.0, distance
        assert distinct["kl"].item() > 1e-4 and distinct["agreement"] < 1.0, distance
    # the CE term is the student's own next-token loss on the answers (what transformers computes with labels)
    with torch.no_grad():
        reference = other.student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                  labels=batch["labels"]).loss
    torch.testing.assert_close(distinct["ce"], reference)


def test_the_kl_is_a_token_mean_of_the_teachers_distance(micro_config):
    """Forward KL(teacher ‖ student) averaged over every answer position of the batch, computed by hand."""
    module, datamodule = built_method(distill_config(micro_config))
    module.eval()
    batch = next(iter(datamodule.val_dataloader()))
    with torch.no_grad():
        terms = module.terms(batch, with_teacher=True)
        where = answer_positions(batch["labels"])
        kw = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        p = module.model(**kw).logits[where].log_softmax(-1)
        q = module.student(**kw).logits[where].log_softmax(-1)
    torch.testing.assert_close(terms["kl"], (p.exp() * (p - q)).sum(-1).mean())
    assert terms["agreement"] == (p.argmax(-1) == q.argmax(-1)).float().mean().item()


def test_only_the_student_trains(micro_config):
    """Gradients reach the student only: the teacher (embeddings and LM head included) has none, stays in eval mode
    and does not change; a few steps on one batch bring the student closer to the teacher."""
    module, datamodule = built_method(distill_config(micro_config))
    batch = next(iter(datamodule.train_dataloader()))
    module.train()
    assert not module.model.training and module.student.training
    teacher = _state(module.model)
    student = _state(module.student)
    trainable = [p for p in module.parameters() if p.requires_grad]
    student_params = {id(p) for p in module.student.parameters()}
    assert trainable and all(id(p) in student_params for p in trainable)
    assert len(trainable) == len(list(module.student.parameters()))
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = module.training_step(batch, 0)
        loss.backward()
        assert all(p.grad is None for p in module.model.parameters())
        assert all(p.grad is not None for p in module.student.parameters())
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.equal(v, teacher[k]) for k, v in module.model.state_dict().items())
    assert any(not torch.equal(v, student[k]) for k, v in module.student.state_dict().items())
    assert losses[-1] < 0.8 * losses[0], losses


def test_generated_objective_trains_on_the_teachers_greedy_answers(micro_config):
    """The labels are the teacher's greedy continuation of each prompt, as ``lit_spec.decoding.generate`` decodes it
    one prompt at a time, cut after EOS; the loss is the student's cross-entropy on exactly them."""
    new = 12
    module, datamodule = built_method(distill_config(micro_config, "method.objective=generated",
                                                     f"method.max_new_tokens={new}"))
    module.train()
    torch.manual_seed(0)
    with torch.no_grad():        # larger random weights than the init's: varied greedy answers, not one token repeated
        for p in module.model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    batch = next(iter(datamodule.train_dataloader()))
    prompt_len = (batch["attention_mask"].sum(-1) - (batch["labels"] != IGNORE_INDEX).sum(-1)).tolist()
    prompts = [batch["input_ids"][r, :n] for r, n in enumerate(prompt_len)]
    assert len(set(prompt_len)) > 1                                # the decoder's left padding matters

    def reference(eos):
        return [generate(module.model, p[None], method="ar", max_new_tokens=new, eos_token_id=eos)
                .sequences[0, len(p):].tolist() for p in prompts]

    free = reference(None)
    assert all(len(a) == new for a in free)
    # as EOS, a token the random teacher writes in row 0 (after its first token) but not in every row: rows stop at
    # different lengths, some not at all
    eos = next(t for t in free[0][1:] if any(t not in a for a in free))
    module.model.generation_config.eos_token_id = eos
    expected = [a[: a.index(eos) + 1] if eos in a else a for a in free]
    assert 1 < len(expected[0]) < new and any(len(a) == new for a in expected)
    assert reference(eos) == expected                             # one prompt at a time: stops at EOS

    answered = module.teacher_answers(batch)
    for r, (p, a) in enumerate(zip(prompts, expected)):
        n = len(p) + len(a)
        assert answered["input_ids"][r, :n].tolist() == p.tolist() + a
        assert answered["attention_mask"][r].sum() == n
        assert answered["labels"][r, len(p):n].tolist() == a
        assert (answered["labels"][r, :len(p)] == IGNORE_INDEX).all()
        assert (answered["labels"][r, n:] == IGNORE_INDEX).all()
    # ZeRO-3 / FSDP decode the full length on every rank and cut at EOS afterwards: the same batch
    module._weights_sharded = lambda: True
    sharded = module.teacher_answers(batch)
    assert all(torch.equal(sharded[k], answered[k]) for k in answered)

    loss = module.training_step(batch, 0)          # default weights for objective=generated: CE only
    with torch.no_grad():
        logits = module.student(input_ids=answered["input_ids"], attention_mask=answered["attention_mask"]).logits
    where = answer_positions(answered["labels"])
    expected_ce = F.cross_entropy(logits[where], answered["labels"][:, 1:][where[:, :-1]])
    torch.testing.assert_close(loss.detach(), expected_ce)
    loss.backward()
    assert all(p.grad is None for p in module.model.parameters())


def test_bad_settings_are_refused_when_the_module_is_built(micro_config):
    from lit_spec.config import build
    from lit_spec.stages import ensure_stages

    mismatch = distill_config(micro_config, "method.student.vocab_size=256")   # BPE: 256 bytes + 3 specials = 259
    ensure_stages(mismatch)
    spec = build(mismatch.model)
    with pytest.raises(ConfigError, match=r"vocabulary of 259 tokens but the target model .* has 512"):
        build(mismatch.method, model_spec=spec)

    for override, name in [("method.objective=sequence", "objective"), ("method.distance=l2", "distance"),
                           ("method.kl_weight=0", "both 0"), ("method.ce_weight=-1", "ce_weight"),
                           ("method.max_new_tokens=0", "max_new_tokens"), ("method.gamma=0", "gamma")]:
        cfg = distill_config(micro_config, override)
        with pytest.raises(ConfigError, match=name):
            build(cfg.method, model_spec=spec)
    with pytest.raises(ConfigError, match="method.student"):
        DraftDistillModule(spec, student=None)


def test_a_vocabulary_mismatch_stops_training_before_the_first_step(micro_config, tmp_path):
    cfg = distill_config(micro_config, "method.student.vocab_size=256", output_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match="share the target's tokenizer"):
        run_training(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "export").exists()


def test_export_is_the_student_and_checkpoints_hold_no_teacher(micro_config, tmp_path):
    module, datamodule = built_method(distill_config(micro_config, "method.warmup_steps=0"))
    untrained = _state(module.student)
    teacher = _state(module.model)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=1)
    trainer.fit(module, datamodule=datamodule)
    trained = _state(module.student)
    assert any(not torch.equal(v, untrained[k]) for k, v in trained.items())

    export_pretrained(trainer, module, tmp_path / "export")
    assert (tmp_path / "export" / "model.safetensors").is_file()
    assert (tmp_path / "export" / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert loaded.config.hidden_size == 16                       # the student, not the teacher (32)
    state = loaded.state_dict()
    assert state.keys() == trained.keys()
    assert all(torch.equal(state[k], v) for k, v in trained.items())

    trainer.save_checkpoint(tmp_path / "distill.ckpt")
    saved = torch.load(tmp_path / "distill.ckpt", weights_only=True, map_location="cpu")
    assert saved["state_dict"] and all(k.startswith("student.") for k in saved["state_dict"])
    assert isinstance(saved["hyper_parameters"]["student"], dict)
    reloaded = DraftDistillModule.load_from_checkpoint(tmp_path / "distill.ckpt", weights_only=True)
    assert all(torch.equal(v, trained[k]) for k, v in reloaded.student.state_dict().items())
    assert all(torch.equal(v, teacher[k]) for k, v in reloaded.model.state_dict().items())
    assert not reloaded.model.training and all(not p.requires_grad for p in reloaded.model.parameters())
    # a student key missing from the checkpoint is an error, not a silently untrained weight
    broken = dict(saved, state_dict={k: v for k, v in saved["state_dict"].items() if "layers.0.mlp" not in k})
    torch.save(broken, tmp_path / "broken.ckpt")
    with pytest.raises(RuntimeError, match="Missing key"):
        DraftDistillModule.load_from_checkpoint(tmp_path / "broken.ckpt", weights_only=True)


@pytest.mark.slow      # end to end: train, export, resume
def test_micro_run_measures_speculative_decoding_of_the_teacher_and_resumes(micro_config, tmp_path):
    """Through ``run_training`` (the Hydra config path): the speedup callback decodes the TEACHER with AR and with
    speculative decoding drafted by the student (lossless: the same output), the validation logs agreement, the
    export is the student and the student-only checkpoint resumes."""
    common = ["callbacks=speedup", "callbacks.speedup.num_prompts=2", "callbacks.speedup.max_new_tokens=16",
              "callbacks.speedup.drift_data=null",
              "trainer.log_every_n_steps=1", "callbacks.model_checkpoint.every_n_train_steps=4"]
    cfg = distill_config(micro_config, *common, output_dir=tmp_path / "a")
    metrics = run_training(cfg)
    assert metrics["global_step"] == 8
    assert metrics["exact_match/speculative"] == 1.0 and metrics["mean_accepted/speculative"] >= 1.0
    # the student picks the teacher's greedy token on some answer positions, not all (16 hidden units against 32)
    assert 0.0 < metrics["val/agreement"] < 1.0 and metrics["val/kl"] > 0
    with open(Path(cfg.paths.output_dir) / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len([r for r in rows if r.get("train/kl") and r.get("train/agreement")]) == 8
    assert len([r for r in rows if r.get("val/agreement")]) == 2                  # one per validation run
    assert any(r.get("speedup/speculative") for r in rows)
    assert AutoModelForCausalLM.from_pretrained(cfg.export_dir).config.hidden_size == 16

    last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=True, map_location="cpu")["state_dict"]
    assert state and all(k.startswith("student.") for k in state)
    resumed = distill_config(micro_config, *common, "trainer.max_steps=10", f"ckpt_path={last}",
                             output_dir=tmp_path / "b")
    assert run_training(resumed)["global_step"] == 10
