"""``data=self_distilled``: the target's own greedy answers, collected with the batched AR decoder
(``collect.decoder=ar``) as the cached, resumable ``answers`` stage, as prompt/answer batches for frozen-base
methods."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import open_dict
from test_collect import MICRO_COLLECT, collect_config, part_names

from conftest import MICRO_MODEL
from test_eagle3 import EAGLE3
from lit_spec import stages
from lit_spec.collection import TrajectoryCollector, run_collection
from lit_spec.config import build, compose_config
from lit_spec.data import SelfDistilledDataModule, TrajectoryDataModule
from lit_spec.data.datamodule import IGNORE_INDEX
from lit_spec.data.trajectories import read_meta, read_records
from lit_spec.errors import ConfigError, DataError
from lit_spec.checks import check_method_data

KEEP_ALL = "collect.filter=null"    # the micro model's answers loop: keep them all
ANSWERS = ["collect.decoder=ar", KEEP_ALL]


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("answers") / "ar"
    run_collection(collect_config(out, *ANSWERS))
    return out


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("answers") / "jacobi"
    run_collection(collect_config(out, KEEP_ALL))
    return out


def test_ar_answers_are_the_jacobi_collection_answers_without_trajectories(answers, trajectories):
    got, jacobi = read_records(answers, include_dropped=True), read_records(trajectories, include_dropped=True)
    assert [r["id"] for r in got] == [r["id"] for r in jacobi] and len(got) > 10
    for a, j in zip(got, jacobi):
        assert a["answer_ids"] == j["answer_ids"] and a["prompt_ids"] == j["prompt_ids"], a["id"]
        assert a["blocks"] == [] and j["blocks"]
    meta = read_meta(answers)
    assert meta["config"]["collect"]["decoder"] == "ar" and meta["stats"]["states"] == 0
    assert meta["stats"]["answer_tokens"] == read_meta(trajectories)["stats"]["answer_tokens"]


def test_a_killed_answer_collection_resumes_to_the_same_records(answers, tmp_path, monkeypatch):
    out, step, written = tmp_path / "resumed", TrajectoryCollector.predict_step, []

    def killed_after_one_part(self, batch):
        if written:
            raise RuntimeError("killed")
        written.append(step(self, batch))
        return written[-1]

    monkeypatch.setattr(TrajectoryCollector, "predict_step", killed_after_one_part)
    with pytest.raises(RuntimeError, match="killed"):
        run_collection(collect_config(out, *ANSWERS))
    assert len(part_names(out)) == 1
    monkeypatch.setattr(TrajectoryCollector, "predict_step", step)
    run_collection(collect_config(out, *ANSWERS))
    assert read_records(out, include_dropped=True) == read_records(answers, include_dropped=True)


def train_config(cache: Path, *collect: str):
    cfg = compose_config([*MICRO_MODEL, "method=medusa", "data=self_distilled", f"paths.cache_dir={cache}"])
    with open_dict(cfg):
        cfg.data.collect = [*MICRO_COLLECT, *ANSWERS, *collect]
    return cfg


def test_the_answers_stage_collects_once_under_its_own_key(answers, tmp_path, monkeypatch):
    cfg = train_config(tmp_path)
    check_method_data(cfg)                             # a frozen-base method trains on the target's answers
    out = Path(stages.ensure_stages(cfg)[-1].output)
    assert out.name.startswith("answers-") and cfg.data.path == str(out)
    assert read_records(out, include_dropped=True) == read_records(answers, include_dropped=True)
    monkeypatch.setattr(stages, "run_collection_stage", lambda cfg: pytest.fail("collected again"))
    assert stages.ensure_stages(train_config(tmp_path))[-1].output == out
    other = stages.find_stages(train_config(tmp_path, "collect.max_new_tokens=12"))[-1]
    assert other.output != out and not other.built()   # another setting: another key
    by_vllm = train_config(tmp_path)
    by_vllm.data.engine = "vllm"          # vLLM's answers are these records (tests/test_serving.py): the same stage
    stage = stages.find_stages(by_vllm)[-1]
    assert stage.output == out and stage.config.collect.engine == "vllm"


def test_batches_hold_the_target_answers_and_callbacks_score_the_dataset_answers(answers):
    cfg = collect_config(answers, *ANSWERS)
    stages.find_stages(cfg)
    tokenizer = build(cfg.model).load_tokenizer()
    data = SelfDistilledDataModule(tokenizer, path=str(answers), batch_size=2)
    data.setup("fit")
    kept = read_records(answers, "train")
    assert len(data.splits["train"]) == len(kept) and len(data.splits["validation"]) == len(
        read_records(answers, "validation"))
    batch = next(iter(data.train_dataloader()))
    for row, labels in zip(batch["input_ids"].tolist(), batch["labels"]):
        record = next(r for r in kept if row[: len(r["prompt_ids"]) + len(r["answer_ids"])]
                      == r["prompt_ids"] + r["answer_ids"])
        answer = labels[labels != IGNORE_INDEX].tolist()
        assert answer == record["answer_ids"]
    evals = data.eval_records("validation", 3)
    val = read_records(answers, "validation")[:3]
    assert [e["answer_ids"] for e in evals] == [r["reference_ids"] for r in val]
    assert [e["prompt_ids"] for e in evals] == [r["prompt_ids"] for r in val]


def test_answers_are_cut_and_the_quickstarts_take_them(answers):
    data = SelfDistilledDataModule(path=str(answers), max_answer_tokens=3)
    data.setup("fit")
    assert [len(a) for a in data.splits["train"]["answer_ids"]] == [
        min(3, len(r["answer_ids"])) for r in read_records(answers, "train")]
    for experiment in ("chimera_quickstart", "hidden_transfer_quickstart", "draft_distill_quickstart"):
        cfg = compose_config([f"+experiment={experiment}", "data=self_distilled"])
        check_method_data(cfg)
        assert isinstance(build(cfg.data), SelfDistilledDataModule), experiment


CACHED = {"medusa": ["method=medusa"], "chimera": ["method=chimera"],
          "eagle3": [*EAGLE3, "method.draft_vocab_size=512", "method.layers=[0,1,1]",
                     "data.base_states.layers=[0,1,1,2]"]}


@pytest.mark.parametrize("method", sorted(CACHED))
def test_cached_base_states_equal_recomputed_ones(answers, tmp_path, method):
    """data.base_states: the stage caches the frozen base's last states (EAGLE-3: its feature layers and the last)
    and greedy tokens of every answer once (its own key); a cached state equals the base's recomputed one (each
    answer alone, in the cache's bf16), and the trained part's loss with them is the loss with the base's forward."""
    import torch

    from conftest import built_method, make_config

    cfg = make_config(tmp_path / "run", [*MICRO_MODEL, *CACHED[method], "data=self_distilled",
                                         f"data.path={answers}", "data.base_states.enabled=true",
                                         f"paths.cache_dir={tmp_path / 'cache'}"])
    module, data = built_method(cfg)
    assert Path(cfg.data.base_states.path).name.startswith("base_states-")
    other = make_config(tmp_path / "run", [*MICRO_MODEL, "data=self_distilled", f"data.path={answers}",
                                           "data.base_states.enabled=true", "data.max_answer_tokens=3",
                                           f"paths.cache_dir={tmp_path / 'cache'}"])
    assert stages.find_stages(other)[-1].output != Path(cfg.data.base_states.path)
    batch = next(iter(data.train_dataloader()))
    with torch.no_grad():
        for i, n in enumerate(batch["attention_mask"].sum(1).tolist()):
            out = module.model(input_ids=batch["input_ids"][i:i + 1, :n], output_hidden_states=True)
            layers = cfg.data.base_states.layers or [-1]
            states = torch.cat([out.hidden_states[t][0] for t in layers], dim=-1)
            assert torch.equal(batch["base_hidden"][i, :n], states.to(torch.bfloat16))
            assert torch.equal(batch["base_next"][i, :n], out.logits[0].argmax(-1))
        cached = module.training_step(batch, 0).item()
        computed = module.training_step({k: v for k, v in batch.items() if not k.startswith("base_")}, 0).item()
    assert cached == pytest.approx(computed, rel=2e-2) and cached != computed     # bf16 states: close, not equal
    assert stages.find_stages(cfg)[-1].built()


def test_cllm_refuses_an_answers_only_collection(answers):
    with pytest.raises(DataError, match="answers-only collection .*collect.decoder=null"):
        TrajectoryDataModule(path=str(answers)).setup("fit")


def test_bad_input_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="collect.decoder='beam'"):
        run_collection(collect_config(tmp_path / "out", "collect.decoder=beam"))
    with pytest.raises(ConfigError, match="data.max_train_records=0"):
        SelfDistilledDataModule(max_train_records=0)
    with pytest.raises(ConfigError, match="data.max_answer_tokens=-1"):
        SelfDistilledDataModule(max_answer_tokens=-1)
    with pytest.raises(ConfigError, match="data.path is null"):
        SelfDistilledDataModule().setup("fit")
