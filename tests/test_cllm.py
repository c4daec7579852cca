"""CLLM (method=cllm, data=trajectories): the distances against hand formulas, the batches built from a hand-written
trajectory directory, and training end to end on the micro model."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from omegaconf import open_dict
from transformers import AutoModelForCausalLM

from closeness import assert_same_gradients
from conftest import MICRO_MODEL, make_config
from lit_spec.config import build
from lit_spec.data import IGNORE_INDEX, TrajectoryDataModule
from lit_spec.data.trajectories import read_meta, write_meta, write_part
from lit_spec.stages import ensure_stages
from lit_spec.data.trajectory_data import EpochSampler, ar_item, consistency_item, student_pool
from lit_spec.decoding import generate
from lit_spec.errors import ConfigError, DataError
from lit_spec.methods import CLLMModule
from lit_spec.methods.losses import distance
from lit_spec.training import run_training


# ---- distances ----------------------------------------------------------------------------------------------------
def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


def _manual(student, teacher, mask, kind, beta=0.5, reduction="sum") -> float:
    """The module doc's formulas with plain floats: per-row sums over the masked positions averaged over the rows (a
    row with none: 0), or the mean over every masked position."""
    sums, count = [], 0
    for b in range(student.size(0)):
        total = 0.0
        for t in range(student.size(1)):
            if mask[b, t]:
                count += 1
                q, p = student[b, t].softmax(-1).tolist(), teacher[b, t].softmax(-1).tolist()
                if kind == "forward_kl":
                    total += _kl(p, q)
                elif kind == "reverse_kl":
                    total += _kl(q, p)
                else:
                    m = [beta * a + (1 - beta) * c for a, c in zip(p, q)]
                    total += beta * _kl(p, m) + (1 - beta) * _kl(q, m)
        sums.append(total)
    return sum(sums) / (len(sums) if reduction == "sum" else count)


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(3, 4, 5, generator=g) * 2, torch.randn(3, 4, 5, generator=g) * 2
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)  # row 2: nothing compared
    return student, teacher, mask


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("kind, beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.5), ("jsd", 0.2)])
def test_distances_match_hand_formulas(logits, kind, beta, reduction):
    student, teacher, mask = logits
    got = distance(student, teacher, mask, kind, beta, reduction)
    assert got.item() == pytest.approx(_manual(student, teacher, mask, kind, beta, reduction), rel=1e-5)
    # rows of 2, 4 and 0 positions: the sum's mean over 3 rows and the mean over 6 positions differ
    assert _manual(student, teacher, mask, kind, beta, "sum") != pytest.approx(
        _manual(student, teacher, mask, kind, beta, "mean"), rel=1e-3)


def test_direction_symmetry_and_masking(logits):
    student, teacher, mask = logits
    forward, reverse = distance(student, teacher, mask, "forward_kl"), distance(student, teacher, mask, "reverse_kl")
    assert forward.item() != pytest.approx(reverse.item(), rel=1e-3)
    # swapping the roles swaps the KL directions; the β=0.5 JSD is symmetric, β=0.2 is not
    assert distance(teacher, student, mask, "reverse_kl").item() == pytest.approx(forward.item(), rel=1e-5)
    assert distance(teacher, student, mask, "jsd").item() == pytest.approx(
        distance(student, teacher, mask, "jsd").item(), rel=1e-5)
    assert distance(teacher, student, mask, "jsd", 0.2).item() != pytest.approx(
        distance(student, teacher, mask, "jsd", 0.2).item(), rel=1e-3)
    # positions outside the mask (and rows without any) do not count
    changed = student.clone()
    changed[0, 0] += 5
    changed[0, 3] -= 5
    changed[2] = 100.0
    assert distance(changed, teacher, mask).item() == pytest.approx(forward.item(), rel=1e-6)
    assert distance(teacher, teacher, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert distance(student, teacher, torch.zeros_like(mask)).item() == 0.0


def test_teacher_is_stop_gradient(logits):
    student, teacher, mask = (x.clone() for x in logits)
    student.requires_grad_(True)
    teacher.requires_grad_(True)
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        student.grad = None
        distance(student, teacher, mask, kind).backward()
        assert teacher.grad is None, kind
        assert student.grad is not None and student.grad[mask].abs().sum() > 0
        assert student.grad[~mask].abs().sum() == 0


def test_bad_distance_is_a_config_error(logits):
    with pytest.raises(ConfigError, match="distance='l2'"):
        distance(*logits, kind="l2")
    with pytest.raises(ConfigError, match="jsd_beta"):
        distance(*logits, kind="jsd", beta=1.0)


# ---- a hand-written trajectory directory --------------------------------------------------------------------------
def _record(i: int, split: str = "train") -> dict:
    o = 10 * i  # token ids < 512 (the micro model's vocabulary)
    first = {"states": [[100 + o, 101 + o, 102 + o], [200 + o, 101 + o, 102 + o], [200 + o, 201 + o, 102 + o],
                        [200 + o, 201 + o, 202 + o]],
             "augmented": [[200 + o, 101 + o, 202 + o]]}
    second = {"states": [[300 + o, 301 + o]], "augmented": []}  # already at its fixed point; a short last block
    return {"id": f"{split}/{i:06d}", "split": split, "prompt_ids": [5 + i, 6, 7],
            "answer_ids": [200 + o, 201 + o, 202 + o, 300 + o, 301 + o], "reference_ids": [400 + o, 401 + o],
            "blocks": [first, second], "keep": True, "drop_reason": None}


def write_trajectories(directory: Path, train: int = 3, validation: int = 0) -> Path:
    write_part(directory, "train", 0, [_record(i) for i in range(train)])
    if validation:
        write_part(directory, "validation", 0, [_record(i, "validation") for i in range(validation)])
    write_meta(directory, {"collect": {"n_tokens": 3}}, complete=True)
    return directory


def test_items_for_a_known_state():
    record = _record(0)
    assert student_pool(record["blocks"][0]) == [
        ([100, 101, 102], [200, 101, 102]), ([200, 101, 102], [200, 201, 102]), ([200, 201, 102], [200, 201, 202]),
        ([200, 101, 202], [200, 201, 202])]                                   # augmented: local teacher is y*
    assert len(student_pool(record["blocks"][0], use_augmented=False)) == 3
    assert student_pool(record["blocks"][1]) == [([300, 301], [300, 301])]  # student = teacher

    item = consistency_item(record, 0, 1)
    assert item["student"] == [5, 6, 7, 200, 101, 102]
    assert item["teacher"] == [5, 6, 7, 200, 201, 202]
    assert item["local_teacher"] == [5, 6, 7, 200, 201, 102]
    # logits at 2, 3, 4 predict the block's tokens at 3, 4, 5; from its first wrong one (4) on: 3, 4
    assert item["mask"] == (3, 5) and item["prompt"] == 3
    assert consistency_item(record, 0, 0)["mask"] == (2, 5)       # [100, 101, 102]: wrong from its first token

    item = consistency_item(record, 1, 0)           # context: the prompt + the first block's fixed point
    assert item["student"] == item["teacher"] == item["local_teacher"] == [5, 6, 7, 200, 201, 202, 300, 301]
    assert item["mask"] == (7, 7) and item["prompt"] == 3           # at its fixed point: nothing to compare
    item = consistency_item(record, 1, 0, max_context_tokens=2)
    assert item["student"] == [201, 202, 300, 301] and item["prompt"] == 0


def test_batches_from_a_trajectory_directory(tmp_path):
    dm = TrajectoryDataModule(path=str(write_trajectories(tmp_path / "traj")), batch_size=4, seed=3)
    dm.setup()
    # no validation split: the last 5% of train records (at least one) are held out
    assert [r["id"] for r in dm.records["train"]] == ["train/000000", "train/000001"]
    assert [r["id"] for r in dm.records["validation"]] == ["train/000002"]

    batches = list(dm.train_dataloader())
    assert [b["input_ids"].size(0) for b in batches] == [4]      # 2 records x 2 blocks
    seen = set()
    for b in batches:
        for i in range(b["input_ids"].size(0)):
            real = b["attention_mask"][i].bool()
            student, teacher = b["input_ids"][i][real].tolist(), b["teacher_ids"][i][real].tolist()
            local = b["local_teacher_ids"][i][real].tolist()
            rec = next(r for r in dm.records["train"] if student[: 3] == r["prompt_ids"])
            assert len(student) == len(teacher) == len(local)
            whole = rec["prompt_ids"] + rec["answer_ids"]
            blk = next(k for k, x in enumerate(rec["blocks"]) if teacher == whole[: len(teacher) - len(
                x["states"][-1])] + x["states"][-1])
            fixed = rec["blocks"][blk]["states"][-1]
            c = len(teacher) - len(fixed)
            assert (student[c:], local[c:]) in student_pool(rec["blocks"][blk])
            # compared: the predictions of the block's tokens from the student's first wrong one on
            first_wrong = next((t for t in range(len(fixed)) if student[c + t] != fixed[t]), len(fixed))
            assert b["consistency_mask"][i].nonzero()[:, 0].tolist() == list(range(c - 1 + first_wrong,
                                                                                   c - 1 + len(fixed)))
            assert b["prompt_mask"][i].nonzero()[:, 0].tolist() == [0, 1, 2]
            seen.add((rec["id"], blk))
            # the AR sequence: prompt + generated answer, prompt masked
            ar = b["ar_input_ids"][i][b["ar_attention_mask"][i].bool()].tolist()
            assert ar == rec["prompt_ids"] + rec["answer_ids"]
            labels = b["ar_labels"][i][: len(ar)].tolist()
            assert labels == [IGNORE_INDEX] * 3 + rec["answer_ids"]
    assert len(seen) == 4

    # reproducible: the same epoch draws the same states, and validation is fixed
    again = next(iter(dm.train_dataloader()))
    assert all(torch.equal(again[k], batches[0][k]) for k in again)
    val = [next(iter(dm.val_dataloader())) for _ in range(2)]
    assert torch.equal(val[0]["input_ids"], val[1]["input_ids"])
    draws = set()
    sampler = EpochSampler(4, seed=3)
    for epoch in range(8):
        sampler.set_epoch(epoch)
        draws.add(tuple(tuple(dm.collate([dm.train_dataloader().dataset[k]])["input_ids"][0].tolist())
                        for k in sorted(sampler)))
    assert len(draws) > 1, "every epoch draws its states anew"

    # the dataset's answers for the AR loss, and for decoding callbacks
    ds = TrajectoryDataModule(path=dm.path, ar_target="dataset")
    ds.setup()
    b = next(iter(ds.train_dataloader()))
    assert (b["ar_labels"] != IGNORE_INDEX).sum(-1).tolist() == [2, 2, 2, 2]
    assert dm.eval_records("validation", 5) == [{"prompt_ids": [7, 6, 7], "answer_ids": [420, 421]}]
    assert dm.eval_records("test", 5) == []


def test_length_buckets_keep_every_item_and_pad_less():
    """Bucketed epochs hold every item once, are a function of (seed, epoch), keep each step's items together under
    data parallelism (rank r takes every w-th), and pad less than unbucketed ones."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 100, (66,), generator=g).tolist()

    def padded(order: list[tuple[int, int]], step: int) -> int:
        steps = [order[k: k + step] for k in range(0, len(order), step)]
        return sum(len(s) * max(lengths[i] for i, _ in s) - sum(lengths[i] for i, _ in s) for s in steps)

    plain, bucketed = EpochSampler(66, seed=1), EpochSampler(66, seed=1, lengths=lengths, step=4, window=5)
    for epoch in (0, 1):
        order = bucketed.order(epoch)
        assert sorted(i for i, _ in order) == list(range(66)) and order == bucketed.order(epoch)
        # 3 runs of 20 items, then 6: a step of 4 and a partial one of the 2 longest, last
        tail = [i for i, _ in plain.order(epoch)[-6:]]
        assert sorted(i for i, _ in order[-2:]) == sorted(sorted(tail, key=lambda i: lengths[i])[-2:])
        assert padded(order, 4) < padded(plain.order(epoch), 4) / 3
    assert bucketed.order(0) != bucketed.order(1)
    # 2 ranks, 2 items each a step: rank r's batch k is items 4k + r and 4k + r + 2 of the one-process order
    ranks = [EpochSampler(66, seed=1, rank=r, world=2, lengths=lengths, step=4, window=5) for r in (0, 1)]
    whole = bucketed.order(0)
    for r, sampler in enumerate(ranks):
        assert list(sampler)[:8] == whole[r:16:2]


def _wider(batch: dict, extra: int, leak: bool = False) -> dict:
    """The batch with ``extra`` more padding columns in every [B, T] tensor (the pad id 0, no attention, nothing
    compared, labels ignored). ``leak``: row 0's first padded column is attended, so the AR term reads it (a
    padding bug)."""
    wide = {k: torch.cat([v, v.new_full((v.size(0), extra), IGNORE_INDEX if "labels" in k else 0)], 1)
            if v.dim() == 2 else v for k, v in batch.items()}
    if leak:
        for mask in ("attention_mask", "ar_attention_mask"):
            wide[mask][0, -extra] = 1
    return wide


def _terms_and_gradients(batch: dict, leak: bool = False):
    """CLLM's terms and every parameter's gradient on ``batch`` and on it padded 5 columns wider."""
    from random_models import random_model

    module = CLLMModule(SimpleNamespace(to_dict=dict), n_tokens=3)
    module.model = random_model(vocab=512).train()
    found = []
    for b in (batch, _wider(batch, 5, leak)):
        module.model.zero_grad()
        terms = module._losses(b)
        (terms[0] + 10 * terms[1]).backward()
        found.append(([t.item() for t in terms], {k: p.grad.clone() for k, p in module.model.named_parameters()}))
    return found


def test_padding_changes_neither_the_losses_nor_the_gradients():
    """What bucketing changes is how wide a batch pads: the same items padded wider give the same terms and
    gradients, up to fp32 rounding (a wider pad reorders the sums); a padded position that a term reads does not."""
    record = _record(0)
    items = [consistency_item(record, 0, 1), consistency_item(record, 1, 0)]
    batch = TrajectoryDataModule(path="unused").collate([{**it, "ar": ar_item(record)} for it in items])
    (terms, grads), (wide_terms, wide_grads) = _terms_and_gradients(batch)
    assert terms == pytest.approx(wide_terms, rel=1e-5)
    assert_same_gradients(wide_grads, grads)
    # the comparison fails on a leak: one padded token read by the AR term
    _, (_, leaked) = _terms_and_gradients(batch, leak=True)
    with pytest.raises(AssertionError, match="model"):
        assert_same_gradients(leaked, grads)


def test_validation_split_and_errors(tmp_path):
    dm = TrajectoryDataModule(path=str(write_trajectories(tmp_path / "a", train=2, validation=1)))
    dm.setup()
    assert len(dm.records["train"]) == 2 and [r["id"] for r in dm.records["validation"]] == ["validation/000000"]
    first = TrajectoryDataModule(path=dm.path, max_train_records=1)
    first.setup()
    assert [r["id"] for r in first.records["train"]] == ["train/000000"] and first.records["validation"] == dm.records[
        "validation"]
    with pytest.raises(ConfigError, match="max_train_records"):
        TrajectoryDataModule(path=dm.path, max_train_records=0)

    empty = tmp_path / "empty"
    write_meta(empty, {}, complete=True)
    with pytest.raises(DataError, match=str(empty)):
        TrajectoryDataModule(path=str(empty)).setup()
    with pytest.raises(ConfigError, match="ar_target"):
        TrajectoryDataModule(path=str(empty), ar_target="teacher")
    with pytest.raises(ConfigError, match="data.path"):
        TrajectoryDataModule(path=None, collect=None).setup()


# ---- the method ---------------------------------------------------------------------------------------------------
PAPER = {"consistency_reduction": "sum", "ar_sequence": "answer", "ar_prompt": False, "label_smoothing": 0.0}


def _hand_losses(model, items: list[dict], record: dict, compared: list[range], paper: bool):
    """CLLM's two terms written out per item and position from unbatched forwards (the teacher under no_grad): the
    authors' code (cllm_trainer_global.py) or the paper's eq. 4 and 6. ``compared``: each item's positions. D =
    forward KL (the code's soft cross-entropy less the teacher's entropy: the same gradient)."""
    kls, ce, eps = [], [], 0.0 if paper else 0.1
    for it, positions in zip(items, compared):
        student = model(torch.tensor([it["student"]])).logits[0]
        with torch.no_grad():
            teacher = model(torch.tensor([it["teacher"]])).logits[0]
        kls.append([(teacher[t].softmax(-1) * (teacher[t].log_softmax(-1) - student[t].log_softmax(-1))).sum()
                    for t in positions])
        # AR: the code's c + y* with every pair, or eq. 6's prompt + l with the answer's pairs only
        seq = record["prompt_ids"] + record["answer_ids"] if paper else it["teacher"]
        logits = model(torch.tensor([seq])).logits[0]
        for t in range(len(record["prompt_ids"]) if paper else 1, len(seq)):
            log_q = logits[t - 1].log_softmax(-1)
            ce.append((1 - eps) * -log_q[seq[t]] + eps * -log_q.mean())
    flat = [k for row in kls for k in row]
    consistency = sum(sum(row) for row in kls) / len(kls) if paper else sum(flat) / len(flat)
    return consistency, sum(ce) / len(ce)


@pytest.mark.parametrize("items", [3, 2], ids=["three_items", "first_block_only"])
@pytest.mark.parametrize("paper", [False, True], ids=["authors_code", "paper"])
def test_the_losses_by_hand_as_the_authors_code_and_the_paper_weigh_them(paper, items):
    """Three items (a block wrong from its first token, one wrong from its second, one at its fixed point) collated as
    training collates them, or the first two alone (narrower than the answer's AR sequence): both terms equal the
    formulas written out by hand, and so do the gradients (the authors' setting takes the teacher from the AR term's
    own forward; the hand version runs it apart)."""
    from random_models import random_model

    record = _record(0)
    items = [consistency_item(record, 0, 0), consistency_item(record, 0, 1), consistency_item(record, 1, 0)][:items]
    batch = TrajectoryDataModule(path="unused").collate([{**it, "ar": ar_item(record)} for it in items])
    module = CLLMModule(SimpleNamespace(to_dict=dict), n_tokens=3, **(PAPER if paper else {}))
    module.model = random_model(vocab=512).train()             # the record's ids run to 301
    consistency, ar = module._losses(batch)
    (consistency + 10 * ar).backward()
    got = {k: p.grad.clone() for k, p in module.model.named_parameters()}

    module.model.zero_grad()
    # the prompt [5, 6, 7] and blocks [100, 101, 102] (wrong from its 1st token), [200, 101, 102] (from its 2nd) of
    # y* = [200, 201, 202], then [300, 301] at its fixed point: eq. 4 sums each block's n positions (those before
    # the first wrong token compare equal contexts); the code compares from the first wrong token on
    compared = [range(2, 5), range(2, 5), range(5, 7)] if paper else [range(2, 5), range(3, 5), range(0)]
    hand = _hand_losses(module.model, items, record, compared[:len(items)], paper)
    assert (consistency.item(), ar.item()) == pytest.approx([h.item() for h in hand], rel=1e-5)
    (hand[0] + 10 * hand[1]).backward()
    assert_same_gradients(got, {k: p.grad for k, p in module.model.named_parameters()})


@pytest.mark.parametrize("kwargs, match", [({"distance": "l1"}, "distance"), ({"consistency": "both"}, "consistency"),
                                           ({"ar_weight": -1.0}, "ar_weight"), ({"jsd_beta": 0.0}, "jsd_beta"),
                                           ({"n_tokens": 0}, "n_tokens"), ({"ar_target": "x"}, "ar_target"),
                                           ({"ar_teacher": "x"}, "ar_teacher"),
                                           ({"consistency_reduction": "max"}, r"consistency_reduction='max'.*paper"),
                                           ({"ar_sequence": "x"}, "ar_sequence"), ({"ar_prompt": "yes"}, "ar_prompt"),
                                           ({"label_smoothing": 1.0}, "label_smoothing"),
                                           ({"ar_target": "dataset"}, "set method.ar_sequence=answer")])
def test_bad_hparams_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        CLLMModule(None, **kwargs)


def test_losses_pick_the_teacher_and_follow_eq_7():
    from random_models import random_model

    ids = torch.tensor([[3, 4, 5, 10, 11, 12]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "teacher_ids": torch.tensor([[3, 4, 5, 20, 21, 22]]), "local_teacher_ids": ids.clone(),
             "consistency_mask": torch.tensor([[False, False, True, True, True, False]]),
             "prompt_mask": torch.tensor([[True] * 3 + [False] * 3]),
             "ar_input_ids": torch.tensor([[3, 4, 5, 20, 21, 22]]), "ar_attention_mask": torch.ones_like(ids),
             "ar_labels": torch.tensor([[IGNORE_INDEX] * 3 + [20, 21, 22]])}
    found = {}
    for consistency in ("global", "local"):
        module = CLLMModule(SimpleNamespace(to_dict=dict), consistency=consistency, ar_weight=0.5)
        module.model = random_model().train()
        module.log = lambda *a, **k: None
        found[consistency] = module._losses(batch)
        loss = module.training_step(batch, 0)
        assert loss.item() == pytest.approx(found[consistency][0].item() + 0.5 * found[consistency][1].item())
        loss.backward()
        assert all(p.grad is not None for p in module.model.parameters() if p.requires_grad)
    assert found["global"][0].item() > 1e-3
    assert found["local"][0].item() == pytest.approx(0.0, abs=1e-6)  # its teacher input is the student's
    assert found["global"][1].item() == pytest.approx(found["local"][1].item())


def test_the_ar_term_fits_the_labels_or_the_original_distribution():
    """``ar_teacher=labels`` is eq. 6 (transformers' own shifted loss); ``original`` is the forward KL from a frozen
    copy of the model as it was: 0 while the model is still that model, positive once it moved, and pulling it back."""
    import copy

    from random_models import random_model

    ids = torch.tensor([[3, 4, 5, 20, 21, 22]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "teacher_ids": ids.clone(),
             "local_teacher_ids": ids.clone(), "ar_input_ids": ids.clone(), "ar_attention_mask": torch.ones_like(ids),
             "consistency_mask": torch.tensor([[False, False, True, True, True, False]]),
             "ar_labels": torch.tensor([[IGNORE_INDEX] * 3 + [20, 21, 22]])}
    labels = CLLMModule(SimpleNamespace(to_dict=dict), ar_teacher="labels", **PAPER)
    labels.model = random_model()
    expected = labels.model(input_ids=ids, labels=batch["ar_labels"]).loss
    assert labels._losses(batch)[1].item() == pytest.approx(expected.item(), rel=1e-6)

    module = CLLMModule(SimpleNamespace(to_dict=dict), ar_teacher="original", **PAPER)
    assert module.frozen == ("original",) and labels.frozen == ()
    module.model, module.original = random_model(), random_model().requires_grad_(False)
    assert module._losses(batch)[1].item() == pytest.approx(0.0, abs=1e-6)
    moved = copy.deepcopy(module.model.state_dict())
    with torch.no_grad():
        module.model.lm_head.weight.add_(0.5 * torch.randn_like(module.model.lm_head.weight))
    ar = module._losses(batch)[1]
    assert ar.item() > 1e-3
    ar.backward()                  # one step down the KL's gradient brings the model back towards the original
    with torch.no_grad():
        module.model.lm_head.weight.sub_(0.5 * module.model.lm_head.weight.grad)
    assert module._losses(batch)[1].item() < ar.item()
    assert all(module.original.state_dict()[k].equal(v) for k, v in moved.items() if "lm_head" not in k)


def test_packed_cllm_is_the_per_block_step_in_one_forward():
    """One packed record (``method=cllm_packed``) against plain forwards of CLLM's per-block items with the same
    student states: each noisy block's logits are the student's c + y, each clean block's the teacher's c + y*, so the
    terms (Σ KL over the compared pairs / K / T; the AR cross-entropy over prompt + answer) and their gradients
    follow from the per-block forwards."""
    from random_models import random_model

    from lit_spec.data import NoisyTrajectoryDataModule
    from lit_spec.data.noisy_trajectories import packed_item
    from lit_spec.methods import PackedCLLMModule

    prompt, blocks, students = [40, 41], [[[5, 1], [5, 6]], [[2, 3], [7, 3], [7, 8]]], [[5, 1], [2, 3]]
    batch = NoisyTrajectoryDataModule(path="unused").collate([packed_item(prompt, blocks, students)])
    module = PackedCLLMModule(SimpleNamespace(to_dict=dict), n_tokens=2)
    module.model = random_model().train()
    consistency, ar = module._losses(batch)
    (consistency + 10 * ar).backward()
    got = {k: p.grad.clone() for k, p in module.model.named_parameters()}
    module.model.zero_grad()

    model, kls, context = module.model, [], list(prompt)
    for states, student in zip(blocks, students):
        fixed = states[-1]
        q = model(torch.tensor([context + student])).logits[0]
        with torch.no_grad():
            p = model(torch.tensor([context + fixed])).logits[0]
        first_wrong = next(t for t in range(2) if student[t] != fixed[t])
        for t in range(first_wrong, 2):        # the logits at the noisy tokens, from the first wrong one on
            at = len(context) + t
            kls.append((p[at].softmax(-1) * (p[at].log_softmax(-1) - q[at].log_softmax(-1))).sum())
        context += fixed
    answer = model(torch.tensor([context])).logits[0]
    ce = F.cross_entropy(answer[:-1], torch.tensor(context[1:]))
    hand = sum(kls) / len(kls) / len(blocks)
    assert (consistency.item(), ar.item()) == pytest.approx([hand.item(), ce.item()], rel=1e-5)
    (hand + 10 * ce).backward()
    assert_same_gradients(got, {k: p.grad for k, p in model.named_parameters()})
    assert list(module.decoders()) == ["jacobi"]


@pytest.mark.slow      # end to end: train, checkpoint, resume
def test_a_run_that_distils_from_the_original_checkpoints_without_it_and_resumes(tmp_path):
    traj = write_trajectories(tmp_path / "traj", train=4)
    run = [*MICRO_MODEL, "method=cllm", "data=trajectories", f"data.path={traj}", "data.batch_size=2",
           "method.n_tokens=3", "method.ar_teacher=original", "method.lr=3e-3", "trainer.val_check_interval=2",
           "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1",
           "callbacks=default"]
    first = make_config(tmp_path / "first", [*run, "trainer.max_steps=2"])
    run_training(first)
    checkpoint = Path(first.paths.output_dir) / "checkpoints" / "last.ckpt"
    saved = torch.load(checkpoint, weights_only=False, map_location="cpu")
    assert saved["state_dict"] and all(k.startswith("model.") for k in saved["state_dict"]), "no original.* key"
    assert saved["base_identity"]
    ar = _logged(Path(first.paths.output_dir), "train/ar")
    assert ar[0] == pytest.approx(0.0, abs=1e-5) and ar[1] > ar[0]   # the model starts as the original, then moves
    resumed = make_config(tmp_path / "resumed", [*run, "trainer.max_steps=4", f"ckpt_path={checkpoint}"])
    assert run_training(resumed)["global_step"] == 4

def _logged(run_dir: Path, key: str) -> list[float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key)]


@pytest.mark.parametrize("consistency", ["global", "local"])
def test_cllm_trains_end_to_end(tmp_path, consistency):
    traj = write_trajectories(tmp_path / "traj", train=4)
    cfg = make_config(tmp_path / "run", [
        *MICRO_MODEL, "method=cllm", "data=trajectories", f"data.path={traj}", "data.batch_size=2",
        "method.n_tokens=3", f"method.consistency={consistency}", "method.lr=3e-3", "trainer.max_steps=4",
        "trainer.val_check_interval=2", "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false",
        "trainer.log_every_n_steps=1", "callbacks=default", "callbacks.throughput.window_size=2"])
    metrics = run_training(cfg)
    assert metrics["global_step"] == 4
    run = Path(cfg.paths.output_dir)
    for key in ("train/consistency", "train/ar", "train/loss", "val/consistency", "val/ar", "val/loss"):
        values = _logged(run, key)
        assert values and all(math.isfinite(v) and v >= 0 for v in values), (key, values)
    assert _logged(run, "train/ar")[0] > 1.0  # ~ln(512) before training
    loss, cons, ar = (_logged(run, f"val/{k}")[0] for k in ("loss", "consistency", "ar"))
    assert loss == pytest.approx(cons + 10.0 * ar, rel=1e-4)  # eq. 7 with the default ω = 10

    model = AutoModelForCausalLM.from_pretrained(cfg.export_dir)      # plain transformers, decoded losslessly
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(generate(model, ids, "jacobi", max_new_tokens=8, n_tokens=3).sequences,
                       generate(model, ids, "ar", max_new_tokens=8).sequences)

    module = build(cfg.method, model_spec=build(cfg.model))
    module.configure_model()
    decoders = module.decoders()
    assert list(decoders) == ["jacobi"] and decoders["jacobi"].n_tokens == 3


def test_the_block_size_must_be_the_collected_one(tmp_path):
    traj = write_trajectories(tmp_path / "traj")
    run = [*MICRO_MODEL, "method=cllm", "data=trajectories", f"data.path={traj}"]
    with pytest.raises(ConfigError, match=r"method.n_tokens=4, but the trajectories at .* collected with n=3: set "
                                          r"method.n_tokens=3"):
        run_training(make_config(tmp_path / "run", [*run, "method.n_tokens=4"]))
    with pytest.raises(ConfigError, match=r"^method.n_tokens=0: must be an integer >= 1"):  # not collect.n_tokens
        run_training(make_config(tmp_path / "run", [*MICRO_MODEL, "method.n_tokens=0"]))
    assert not (tmp_path / "run").exists()


# ---- the default pipeline: collect -> train -> measure -----------------------------------------------------------
@pytest.mark.slow      # end to end: collect, train, measure
def test_collect_train_and_measure_in_one_run(tmp_path):
    """``data.path=null``: the run collects the trajectories (cached), consistency-trains on them, and the speedup
    callback decodes held-out prompts with AR and Jacobi before training and after each validation."""
    from test_collect import MICRO_COLLECT

    cfg = make_config(tmp_path / "run", [
        *MICRO_MODEL, "method.n_tokens=4", "data.batch_size=4", f"data.cache_dir={tmp_path / 'cache'}",
        "method.lr=3e-3", "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.num_sanity_val_steps=0",
        "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1", "callbacks.throughput.window_size=2",
        "callbacks.speedup.num_prompts=2", "callbacks.speedup.max_new_tokens=8", "callbacks.speedup.drift_data=null"])
    assert cfg.method._target_.endswith("CLLMModule") and cfg.data._target_.endswith("TrajectoryDataModule")
    assert "speedup" in cfg.callbacks  # the default is this pipeline
    with open_dict(cfg):
        cfg.data.collect = [*MICRO_COLLECT, "collect.filter=null"]  # the micro model trained; random: repetitive
    metrics = run_training(cfg)
    assert metrics["global_step"] == 4

    collected = list((tmp_path / "cache").glob("trajectories-*"))
    assert len(collected) == 1 and read_meta(collected[0])["complete"]
    run = Path(cfg.paths.output_dir)
    assert _logged(run, "train/consistency") and _logged(run, "val/ar")
    tau, exact = _logged(run, "mean_accepted/jacobi"), _logged(run, "exact_match/jacobi")
    assert len(tau) == 3  # at train start and after both validations
    assert all(1.0 <= t <= 4.0 for t in tau) and exact == [1.0, 1.0, 1.0]  # lossless at every measurement
    assert len(_logged(run, "speedup/jacobi")) == 3 and _logged(run, "quality/agreement")


def test_multi_process_collection_is_a_job_of_its_own(tmp_path, monkeypatch):
    """A training command collects in its own process only: otherwise it names the collect command to run first,
    before any stage (the tiny model here) is built."""
    def stages_of(*collect: str):
        cfg = make_config(tmp_path / "run", [*MICRO_MODEL, f"paths.cache_dir={tmp_path / 'cache'}"])
        with open_dict(cfg):
            cfg.data.collect = list(collect)
        return cfg

    with pytest.raises(ConfigError, match=r"python -m lit_spec.collect model=tiny trainer.devices=2 strategy=ddp_spawn "
                                          rf"collect.out_dir={tmp_path}/cache/trajectories-"):
        ensure_stages(stages_of("model=tiny", "trainer.devices=2", "strategy=ddp_spawn"))
    monkeypatch.setenv("WORLD_SIZE", "2")  # a training job launched as 2 processes (torchrun, SLURM)
    with pytest.raises(ConfigError, match="training processes: 2"):
        ensure_stages(stages_of("model=tiny"))
    assert not (tmp_path / "cache").exists()
    with pytest.raises(ConfigError, match="data.path is null"):   # no stage resolved: the datamodule says so
        TrajectoryDataModule(collect=["model=tiny"], cache_dir=str(tmp_path)).setup()


def test_method_and_data_must_fit_before_any_work(tmp_path):
    # checked from the config alone: neither the hub dataset nor the model stage is touched
    with pytest.raises(ConfigError, match=r"CLLMModule .* PromptDataModule: use data=trajectories"):
        run_training(make_config(tmp_path / "a", ["data=gsm8k", "model=hf", "model.name_or_path=nowhere/x"]))
    with pytest.raises(ConfigError, match=r"ARModule .* TrajectoryDataModule: use a prompt dataset"):
        run_training(make_config(tmp_path / "b", ["method=ar", "model=hf", "model.name_or_path=nowhere/x"]))
