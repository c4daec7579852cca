"""The trajectory store on hand-made inputs: write/read round trip, a truncated or corrupt part is a DataError naming
file and line, augmentation (CLLM §3.2.1) and the repetition filter."""

from __future__ import annotations

import json

import pytest
import torch

from lit_spec.data.repetition import RepetitionFilter
from lit_spec.data.trajectories import (augment_states, done_batches, part_path, read_meta,
                                        read_records, write_meta, write_part)
from lit_spec.errors import DataError


def record(i: int, split: str = "train", keep: bool = True) -> dict:
    return {"id": f"{split}/{i:06d}", "split": split, "prompt_ids": [1, 2, 3], "answer_ids": [5, 6, 7, 8, 9],
            "reference_ids": [5, 6, 2], "blocks": [{"states": [[0, 0, 0], [5, 0, 0], [5, 6, 7]], "augmented": [[5, 6, 0]]},
                                                   {"states": [[8, 8], [8, 9]], "augmented": []}],
            "keep": keep, "drop_reason": None if keep else "token 8 repeated"}


@pytest.fixture
def store(tmp_path):
    write_meta(tmp_path, {"collect": {"n_tokens": 3}}, complete=False)
    write_part(tmp_path, "train", 0, [record(0), record(1, keep=False)])
    write_part(tmp_path, "train", 1, [record(2)])
    write_part(tmp_path, "validation", 0, [record(0, "validation")])
    return tmp_path


def test_round_trip_and_completeness(store):
    assert done_batches(store, "train") == {0, 1} and done_batches(store, "test") == set()
    with pytest.raises(DataError, match="not complete.*resumes"):
        read_records(store)
    assert len(read_records(store, include_dropped=True, require_complete=False)) == 4
    write_meta(store, {"collect": {"n_tokens": 3}}, complete=True, stats={"records": 4})
    assert read_meta(store)["stats"] == {"records": 4}
    assert [r["id"] for r in read_records(store)] == ["train/000000", "train/000002", "validation/000000"]
    assert [r["id"] for r in read_records(store, "train", include_dropped=True)] == ["train/000000", "train/000001",
                                                                                     "train/000002"]
    assert not list(store.rglob(".tmp-*")), "atomic writes leave no temporary file"


def test_truncated_part_names_file_and_line(store):
    write_meta(store, {}, complete=True)
    path = part_path(store, "train", 0)
    text = path.read_text()
    path.write_text(text[: len(text.splitlines()[0]) + 1 + 20])  # the second line cut short, as by a crash
    with pytest.raises(DataError, match=rf"{path}:2: truncated record.*delete this file"):
        read_records(store)


@pytest.mark.parametrize("line, why", [
    ("{not json", "bad trajectory record"),
    (json.dumps({**record(1), "answer_ids": [5, 6, 7, 8]}), "answer_ids differ from the blocks' fixed points"),
    (json.dumps({k: v for k, v in record(1).items() if k != "blocks"}), "missing field 'blocks'"),
    (json.dumps({**record(1), "blocks": [{"states": [[1, 2], [1, 2, 3]]}]}), "state 0 has 2 tokens"),
    (json.dumps({**record(1), "blocks": [{"states": [[5, 6, 7, 8, 9]], "augmented": None}]}), "augmented"),
    (json.dumps({**record(1), "prompt_ids": [1, -2]}), "prompt_ids must be a list of token ids"),
])
def test_corrupt_record_names_file_and_line(store, line, why):
    write_meta(store, {}, complete=True)
    path = part_path(store, "train", 1)
    path.write_text(json.dumps(record(2)) + "\n" + line + "\n")
    with pytest.raises(DataError, match=rf"{path}:2: .*{why}"):
        read_records(store, include_dropped=True)


def test_other_format_or_no_meta_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="not a trajectory directory"):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"format": "other", "version": 1}))
    with pytest.raises(DataError, match="format 'other'"):
        read_meta(tmp_path)


# ---- augmentation (§3.2.1) ---------------------------------------------------------------------------------------
STATES = [[9, 9, 9, 9], [1, 9, 9, 9], [1, 2, 8, 9], [1, 2, 3, 4]]


def variants(copies: int, prob: float, seed: int = 0) -> list[list[int]]:
    return augment_states(STATES, copies, prob, torch.Generator().manual_seed(seed))


def test_augmentation_corrects_false_tokens_only():
    fixed = STATES[-1]
    out = variants(4, 0.5)
    assert out and len(out) == len({tuple(v) for v in out}), "no duplicates"
    for v in out:
        assert tuple(v) not in {tuple(s) for s in STATES}, "new states only"
        source = [s for s in STATES[:-1] if all(a == b or a == f for a, b, f in zip(v, s, fixed))]
        assert source, f"{v}: every token is its state's or the fixed point's"
    assert variants(4, 0.5) == out, "the generator decides: reproducible"


def test_augmentation_edge_cases():
    assert variants(0, 0.5) == [], "copies=0: off"
    assert variants(3, 0.0) == [], "nothing corrected: the states themselves, skipped"
    assert variants(3, 1.0) == [], "everything corrected: the fixed point, skipped"
    assert augment_states([[1, 2]], 2, 0.5, torch.Generator()) == [], "a fixed point alone has nothing to correct"
    # one false token: its only variants are the state or the fixed point, both skipped
    assert augment_states([[1, 5], [1, 2]], 5, 0.5, torch.Generator().manual_seed(0)) == []


# ---- post-processing (§3.2.1) ------------------------------------------------------------------------------------
@pytest.mark.parametrize("ids, text, expected", [
    ([1, 2, 3, 4, 5, 6, 7, 8], "def f():\n    return 1\n", None),
    ([1] + [7] * 8 + [2], "x", "token 7 repeated 8 times in a row"),
    ([1, 2, 3, 4, 5, 6] * 4, "y", "6-gram [1, 2, 3, 4, 5, 6] occurs 4 times"),
    ([1, 2], "    x = compute()\nx = compute()\n  x = compute()  \n", "line 'x = compute()' occurs 3 times"),
    ([1, 2], "pass\npass\npass\npass\n", None),  # lines shorter than min_line_chars are not counted
])
def test_repetition_filter(ids, text, expected):
    assert RepetitionFilter().reason(ids, text) == expected


def test_repetition_filter_rules_switch_off():
    off = RepetitionFilter(max_token_run=None, max_ngram_count=None, max_line_count=None)
    assert off.reason([7] * 50, "same line here\n" * 10) is None
    assert RepetitionFilter(max_token_run=3).reason([4, 4, 4], "") == "token 4 repeated 3 times in a row"
