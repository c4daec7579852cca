"""Quality drift (lit_spec/drift.py): the answer NLL against a hand computation, the greedy-answer comparison on
hand-made lists, answer sets read from data configs, and the checks of a drift_data setting."""

from __future__ import annotations

import math

import pytest
import torch
from random_models import random_model

from lit_spec.drift import answer_nll, check_drift_data, compare_answers, drift_records
from lit_spec.errors import ConfigError
from test_task_data import tok  # noqa: F401  (a small BPE tokenizer)

RECORDS = [{"prompt_ids": [1, 5, 9, 4], "answer_ids": [7, 3, 2]},
           {"prompt_ids": [1, 8], "answer_ids": [11, 12, 13, 14, 2]}]


def hand_nll(model, records) -> float:
    """Every answer token's -log p under the logits of the position before it, summed, over the answer tokens."""
    total, count = 0.0, 0
    for r in records:
        ids = torch.tensor([r["prompt_ids"] + r["answer_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        start = len(r["prompt_ids"])
        for i, token in enumerate(r["answer_ids"]):
            total -= logp[start + i - 1, token].item()
            count += 1
    return total / count


def test_answer_nll_is_the_mean_per_answer_token():
    model = random_model("llama")
    want = hand_nll(model, RECORDS)
    assert answer_nll(model, RECORDS, torch.device("cpu")) == pytest.approx(want, rel=1e-5)
    # pooled over tokens, not a mean of the records' means (their answers differ in length)
    per_record = sum(hand_nll(model, [r]) for r in RECORDS) / len(RECORDS)
    assert abs(want - per_record) > 1e-3
    # an empty answer adds nothing; no answer at all: NaN
    empty = [{"prompt_ids": [1, 6], "answer_ids": []}]
    assert answer_nll(model, RECORDS + empty, torch.device("cpu")) == pytest.approx(want, rel=1e-5)
    assert math.isnan(answer_nll(model, empty, torch.device("cpu")))


def test_answer_nll_runs_in_eval_mode_and_restores_every_submodule_mode():
    model = random_model("llama")
    want = hand_nll(model, RECORDS)                          # eval mode: no dropout
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5              # in train mode the NLL would change from call to call
    model.train()
    model.model.layers[0].eval()        # a frozen part stays in eval mode inside a training model
    modes = {name: m.training for name, m in model.named_modules()}
    assert answer_nll(model, RECORDS, torch.device("cpu")) == pytest.approx(want, rel=1e-5)
    assert {name: m.training for name, m in model.named_modules()} == modes


def test_compare_answers_on_hand_made_lists():
    originals = [[5, 6, 7, 2], [5, 6, 7, 2], [1, 2, 3], [9]]
    outputs = [[5, 6, 7, 2], [5, 6, 8, 2], [4, 2, 3], [9]]   # two unchanged; changed at position 2 and at 0
    got = compare_answers(outputs, originals)
    assert got["agreement"] == 0.5
    assert got["first_divergence"] == 1.0                      # (2 + 0) / 2 tokens
    assert got["token_agreement"] == pytest.approx((1 + 2 / 4 + 0 + 1) / 4)
    # an answer that stops early diverges where the shorter one ends
    assert compare_answers([[5, 6]], [[5, 6, 7, 2]])["first_divergence"] == 2.0
    unchanged = compare_answers(originals, originals)
    assert unchanged["agreement"] == 1.0 and unchanged["first_divergence"] is None
    assert compare_answers([], []) == {}


def test_drift_records_read_a_data_config_whole(tok):  # noqa: F811
    records = drift_records("humaneval", tok)   # its evaluation split (test): the problems that fit 1,024 tokens
    some = drift_records("humaneval", tok, n=3)
    assert 100 < len(records) <= 164 and some == records[:3]
    assert all(r["prompt_ids"] and r["answer_ids"][-1] == tok.eos_token_id for r in some)   # the canonical solution
    assert "return" in tok.decode(records[0]["answer_ids"])
    with pytest.raises(ConfigError, match="data=humaneval: split=validation: that split of the data is empty"):
        drift_records("humaneval", tok, split="validation")


def test_bad_drift_data_is_one_line_config_error():
    assert check_drift_data(None, "x") == {} and check_drift_data({}, "x") == {}
    assert check_drift_data({"code": "humaneval"}, "x") == {"code": "humaneval"}
    for value, message in [({"h": "humaneal"}, r"x\.h='humaneal': no data config of that name; choose one of .*"
                                               "'humaneval'"),
                           ({"h": "_prompt"}, "no data config of that name"),
                           (["humaneval"], r"x=\['humaneval'\]: a mapping \{set name: data config name\}"),
                           ({"heldout": "humaneval"}, r"x\.heldout: that set is always measured"),
                           ({"t": "trajectories"}, r"x\.t=trajectories: a collection of model outputs")]:
        with pytest.raises(ConfigError, match=message) as e:
            check_drift_data(value, "x")
        assert "\n" not in str(e.value)
