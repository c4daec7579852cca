"""``python -m lit_spec.collect`` (CLLM Algorithm 1): well-formed records whose fixed points are the greedy answers, a
killed collection resumes to the same output, 2 processes give the same output as 1, clear errors; and the paper's
reference algorithm (no KV cache) gives the engine's trajectories state for state."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import open_dict
from random_models import ARCHS, greedy_with_mid_output_eos, random_model, random_prompts, reference_greedy

from conftest import MICRO_MODEL, hold_lock
from lit_spec import stages
from lit_spec.collection import TrajectoryCollector, reference_trajectories, run_collection
from lit_spec.config import build, compose_config
from lit_spec.data.trajectories import read_meta, read_records
from lit_spec.decoding.fast import StaticRow
from lit_spec.decoding.guesses import GuessMaker
from lit_spec.decoding.jacobi import JacobiDecoder
from lit_spec.errors import ConfigError, DataError, Interrupted

# 10 train prompts (3 batches) + the validation prompts that fit (2 batches), 16 new tokens in blocks of 4
MICRO_COLLECT = MICRO_MODEL + ["data.max_prompt_tokens=64", "data.max_train_samples=24", "data.max_eval_samples=8",
                               "collect.max_prompts=10", "collect.max_new_tokens=16", "collect.n_tokens=4",
                               "collect.batch_size=4", "trainer.enable_progress_bar=false"]


def collect_config(out: Path, *overrides: str):
    cfg = compose_config([*MICRO_COLLECT, *overrides], config_name="collect")
    with open_dict(cfg):
        cfg.collect.out_dir = cfg.paths.output_dir = str(out)
    return cfg


def part_names(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "parts").glob("*.jsonl"))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    """One uninterrupted single-process collection, shared by the module's tests."""
    out = tmp_path_factory.mktemp("collect") / "baseline"
    assert run_collection(collect_config(out)) == out
    return out


def test_records_are_well_formed_and_fixed_points_are_greedy(baseline):
    cfg = collect_config(baseline)
    stages.find_stages(cfg)               # the model's path (run_collection resolved it the same way)
    records = read_records(baseline, include_dropped=True)
    assert part_names(baseline) == ["train-000000.jsonl", "train-000001.jsonl", "train-000002.jsonl",
                                    "validation-000000.jsonl", "validation-000001.jsonl"]
    spec = build(cfg.model)
    model, tokenizer = spec.load_model().eval(), spec.load_tokenizer()
    datamodule = build(cfg.data, tokenizer=tokenizer)
    datamodule.setup()
    counts = {split: min(10, len(datamodule.splits[split])) for split in ("train", "validation")}
    assert counts["train"] == 10 and counts["validation"] > 4, counts  # both splits span more than one batch
    for split, count in counts.items():
        ds = datamodule.splits[split]
        got = [r for r in records if r["split"] == split]
        assert sorted(r["id"] for r in got) == [f"{split}/{i:06d}" for i in range(count)]
        lengths = [len(r["prompt_ids"]) for r in got]
        assert lengths == sorted(lengths), "batches are formed from prompts sorted by length"
        for r in got:
            i = int(r["id"].split("/")[1])
            assert r["prompt_ids"] == ds[i]["prompt_ids"] and r["reference_ids"] == ds[i]["answer_ids"]
            greedy = model.generate(torch.tensor([r["prompt_ids"]]), max_new_tokens=16, do_sample=False,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            new = greedy[0, len(r["prompt_ids"]):].tolist()
            if tokenizer.eos_token_id in new:
                new = new[: new.index(tokenizer.eos_token_id) + 1]
            assert r["answer_ids"] == new, r["id"]
            assert all(len(b["states"][-1]) == 4 for b in r["blocks"][:-1]), "blocks of n tokens, the last cut"
    assert any(b["augmented"] for r in records for b in r["blocks"]), "augment.copies=1 adds states"
    for r in records:  # the micro model's answers repeat one token: the filter marks them, they stay on disk
        assert r["keep"] is (r["drop_reason"] is None)
    assert any(not r["keep"] and "repeated" in r["drop_reason"] for r in records)

    meta = read_meta(baseline)
    stats = meta["stats"]
    assert meta["complete"] and meta["config"]["collect"]["n_tokens"] == 4 and "out_dir" not in meta["config"]["collect"]
    assert stats["records"] == len(records) == stats["kept"] + stats["dropped"]
    assert {split: stats["splits"][split]["records"] for split in counts} == counts
    assert stats["answer_tokens"] == sum(len(r["answer_ids"]) for r in records)
    assert stats["states"] == sum(len(b["states"]) for r in records for b in r["blocks"])
    assert stats["batches_this_run"] == stats["batches"] == len(part_names(baseline)) and stats["tokens_per_s"] > 0


def test_a_complete_collection_is_not_redone(baseline, monkeypatch):
    def written():      # every file but the lock, which each run takes (and stamps with its pid)
        return {p: p.stat().st_mtime_ns for p in baseline.rglob("*") if p.name != ".lock"}

    before = written()
    monkeypatch.setattr(TrajectoryCollector, "predict_step", lambda *a: pytest.fail("decoded again"))
    run_collection(collect_config(baseline))
    assert written() == before


def test_killed_collection_resumes_to_the_same_records(baseline, tmp_path, monkeypatch):
    out = tmp_path / "resumed"
    step = TrajectoryCollector.predict_step
    written = []

    def killed_after_two_parts(self, batch):
        if len(written) == 2:
            raise RuntimeError("killed")
        written.append(step(self, batch))
        return written[-1]

    monkeypatch.setattr(TrajectoryCollector, "predict_step", killed_after_two_parts)
    with pytest.raises(RuntimeError, match="killed"):
        run_collection(collect_config(out))
    assert len(part_names(out)) == 2 and not read_meta(out)["complete"]
    with pytest.raises(DataError, match="not complete"):
        read_records(out)

    monkeypatch.setattr(TrajectoryCollector, "predict_step", step)
    run_collection(collect_config(out))
    assert read_records(out, include_dropped=True) == read_records(baseline, include_dropped=True)
    assert part_names(out) == part_names(baseline)
    assert read_meta(out)["stats"]["batches_this_run"] == len(part_names(baseline)) - 2


def test_a_damaged_or_deleted_part_is_refused_and_the_suggested_rerun_redoes_it(baseline, tmp_path):
    """meta.json lists every part's checksum: a part truncated or deleted after the collection completed is refused
    by every reader, and following the message (rerun the collection) redoes exactly that batch."""
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(baseline, out)
    part = out / "parts" / "train-000001.jsonl"
    part.write_text(part.read_text()[:-20])          # truncated, as a full disk or a killed copy leaves it
    with pytest.raises(DataError, match=r"1 part\(s\) missing or changed .*\(train-000001.jsonl\).*rerun the "
                                        r"same collection"):
        read_records(out)
    assert not read_meta(out)["complete"] and (out / "parts" / "train-000001.jsonl.damaged").is_file()
    run_collection(collect_config(out))
    assert read_meta(out)["stats"]["batches_this_run"] == 1
    assert read_records(out, include_dropped=True) == read_records(baseline, include_dropped=True)

    (out / "parts" / "validation-000000.jsonl").unlink()      # deleted later: the collection itself notices
    run_collection(collect_config(out))
    assert read_meta(out)["stats"]["batches_this_run"] == 1
    assert read_records(out, include_dropped=True) == read_records(baseline, include_dropped=True)


def test_one_collector_per_directory(tmp_path):
    """While one process collects into a directory, a second collector there (same settings or not) stops at once
    with one line naming the other process, and writes nothing."""
    out = tmp_path / "out"
    holder = hold_lock(out / ".lock", 60)
    try:
        for overrides in ([], ["collect.n_tokens=5"]):
            with pytest.raises(ConfigError, match=rf"collect.out_dir={out} is being written by another process "
                                                  rf"\(pid {holder.pid}\); wait for it"):
                run_collection(collect_config(out, *overrides))
        assert sorted(p.name for p in out.iterdir()) == [".lock"]
    finally:
        holder.kill()
        holder.wait()


def test_a_stage_being_built_elsewhere_is_waited_for(tmp_path):
    """Two runs that need the same missing stage: the second waits for the first's lock instead of building it
    alongside (then finds it built, or builds it if the first did not)."""
    import time

    cfg = compose_config([*MICRO_MODEL, f"paths.cache_dir={tmp_path / 'cache'}"])
    stage = stages.find_stages(cfg.model)[0]
    holder = hold_lock(stage.output.parent / f".{stage.name}.lock", 1.5)
    start = time.perf_counter()
    stages.build_stages([stage])
    assert time.perf_counter() - start > 1 and stage.built()
    holder.wait()


def test_sigterm_stops_at_a_batch_boundary_and_the_rerun_resumes(baseline, tmp_path, monkeypatch):
    """A real SIGTERM (kill, timeout, a scheduler) after the second batch: the collection stops before the third,
    exits non-zero (128 + 15) with how to resume, and the rerun finishes with the uninterrupted run's records."""
    out = tmp_path / "terminated"
    step = TrajectoryCollector.predict_step
    written = []

    def terminated_after_two_parts(self, batch):
        written.append(step(self, batch))
        if len(written) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return written[-1]

    monkeypatch.setattr(TrajectoryCollector, "predict_step", terminated_after_two_parts)
    with pytest.raises(Interrupted, match=r"collection stopped with 2 of 5 batches on disk in .*; rerun the same "
                                          r"command to resume \(SIGTERM\)") as stopped:
        run_collection(collect_config(out))
    assert stopped.value.exit_code == 143 and len(written) == 2
    assert len(part_names(out)) == 2 and not read_meta(out)["complete"]

    monkeypatch.setattr(TrajectoryCollector, "predict_step", step)
    run_collection(collect_config(out))
    assert read_records(out, include_dropped=True) == read_records(baseline, include_dropped=True)


def test_the_fast_path_collects_the_eager_engine_s_records(baseline, tmp_path, monkeypatch):
    """``collect.engine=static``: each batch on one static cache (the last, shorter batch of a split on one of its
    own), rows that end early riding along; the records equal the eager engine's, trajectories and augmented states
    included."""
    batches = []
    run = StaticRow.run
    monkeypatch.setattr(StaticRow, "run", lambda row, block, *a, **k: batches.append(block.size(0)) or run(row, block,
                                                                                                          *a, **k))
    out = tmp_path / "static"
    run_collection(collect_config(out, "collect.engine=static"))
    assert read_records(out, include_dropped=True) == read_records(baseline, include_dropped=True)
    assert set(batches) == {4, 2}        # every forward on the fast path, a batch's rows all in it


@pytest.mark.slow
def test_two_processes_give_the_records_of_one(baseline, tmp_path):
    from test_distributed import _kill_workers_after

    out = tmp_path / "ddp"
    with _kill_workers_after(240):
        run_collection(collect_config(out, "strategy=ddp_spawn", "trainer.devices=2"))
    assert read_records(out, include_dropped=True) == read_records(baseline, include_dropped=True)
    assert read_meta(out)["stats"]["records"] == read_meta(baseline)["stats"]["records"]

    # a part lost afterwards (the predict loop dealt batch 1 to rank 1): two processes redo exactly that batch
    (out / "parts" / "train-000001.jsonl").unlink()
    with _kill_workers_after(240):
        run_collection(collect_config(out, "strategy=ddp_spawn", "trainer.devices=2"))
    assert read_meta(out)["stats"]["batches_this_run"] == 1
    assert read_records(out, include_dropped=True) == read_records(baseline, include_dropped=True)


def test_trajectories_stage_collects_once(baseline, tmp_path, monkeypatch):
    def train_config(*collect: str):
        cfg = compose_config([*MICRO_MODEL, f"paths.cache_dir={tmp_path / 'cache'}"])
        with open_dict(cfg):
            cfg.data.collect = [*MICRO_COLLECT, *collect]
        return cfg

    cfg = train_config()
    out = Path(stages.ensure_stages(cfg)[-1].output)
    assert out.parent == tmp_path / "cache" and out.name.startswith("trajectories-") and cfg.data.path == str(out)
    assert read_records(out, include_dropped=True) == read_records(baseline, include_dropped=True)

    def collect_again(cfg):
        raise RuntimeError(f"collected again into {cfg.collect.out_dir}")

    monkeypatch.setattr(stages, "run_collection_stage", collect_again)
    assert stages.ensure_stages(train_config())[-1].output == out
    with pytest.raises(RuntimeError, match="collected again") as e:  # another setting: another directory
        stages.ensure_stages(train_config("collect.n_tokens=5"))
    assert str(out) not in str(e.value)


# ---- errors -------------------------------------------------------------------------------------------------------
def test_changed_config_in_an_existing_out_dir_is_refused(baseline):
    with pytest.raises(ConfigError, match=r"collect\.out_dir=.*collect\.n_tokens: 4 there, 5 now.*delete"):
        run_collection(collect_config(baseline, "collect.n_tokens=5"))


@pytest.mark.parametrize("override, words", [
    ("collect.n_tokens=0", "collect.n_tokens=0"),
    ("collect.max_new_tokens=0", "collect.max_new_tokens=0"),
    ("collect.batch_size=0", "collect.batch_size=0"),
    ("collect.splits=[train,dev]", "collect.splits"),
    ("collect.augment.prob=1.5", "collect.augment.prob=1.5"),
    ("collect.init=zeros", "collect.init='zeros'"),
    ("collect.engine=sglang", "collect.engine='sglang'"),
    ("collect.engine=vllm", "collect.engine=vllm collects answers only"),        # Jacobi trajectories: ours only
])
def test_bad_settings_fail_before_any_work(tmp_path, override, words):
    with pytest.raises(ConfigError, match=words):
        run_collection(collect_config(tmp_path / "out", override))
    assert not (tmp_path / "out").exists()


def unwritable(tmp_path: Path) -> Path:
    """A directory no one can create, root included (its parent is a file); also a read-only one when not root."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    return blocker / "dir"


def test_an_unwritable_out_dir_fails_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match=r"collect\.out_dir=.*cannot write there"):
        run_collection(collect_config(unwritable(tmp_path)))
    if os.geteuid() != 0:
        (tmp_path / "ro").mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="cannot write there"):
            run_collection(collect_config(tmp_path / "ro" / "out"))


@pytest.mark.slow
def test_cli_bad_n_tokens_is_a_one_line_error(tmp_path, stage_cache):
    env = dict(os.environ, LIT_SPEC_CACHE=str(stage_cache), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    result = subprocess.run([sys.executable, "-m", "lit_spec.collect", "collect.n_tokens=0",
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: collect.n_tokens=0: must be an integer >= 1"], result.stderr[-3000:]
    assert not (tmp_path / "run" / "trajectories").exists()


# ---- the paper's algorithm, as an independent check of the engine -------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("init", ["pad", "prefix"])
def test_reference_algorithm_gives_the_engine_trajectories(arch, init):
    model = random_model(arch)
    ids, mask = random_prompts(1, [7])
    prompt = ids[0].tolist()
    for n, new, eos in ((4, 18, None), (5, 23, None), (1, 6, None), (6, 30, "mid")):
        if eos == "mid":  # an EOS inside a block: both cut it there
            _, eos, _ = greedy_with_mid_output_eos(model, ids, mask, new, not_before=8, where=lambda i: i % n != n - 1)
        decoder = JacobiDecoder(model, n, init, seed=3, return_trajectory=True)
        out = decoder.generate(ids, new, eos)
        guess = GuessMaker(model, init, None, decoder.pad_token_id, 3)
        guess.reset()  # the engine resets its guesses at every generate: same calls, same order, same guesses
        blocks = reference_trajectories(model, prompt, n, new, eos, guess)
        assert blocks == out.extras["trajectories"][0], (n, new, eos)
        greedy = reference_greedy(model, ids, mask, new, eos)[0, len(prompt):].tolist()
        answer = [t for states in blocks for t in states[-1]]
        assert answer == greedy[: len(answer)] and (len(answer) == new or answer[-1] == eos)
        assert all(s != t for states in blocks for s, t in zip(states, states[1:])), "consecutive states differ"
