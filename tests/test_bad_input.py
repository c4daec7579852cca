"""What a run refuses before work, and what it never loses (issue #28): a user's files in ``export_dir``, a run
directory that holds another run, numbers that are not numbers, checkpoints of another model size, damaged weights,
a local model without a tokenizer, a bench asked for more prompts than its split has, decoders nobody chose."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import open_dict

from conftest import MICRO_MODEL
from lit_spec import stages
from lit_spec.benchmark import chosen_decoders, run_benchmark
from lit_spec.config import build, compose_config
from lit_spec.errors import ConfigError
from lit_spec.export import MARK
from lit_spec.measure import build_decoders
from lit_spec.models import HFModelSpec
from lit_spec.training import run_training

from test_bench import bench_config


def _truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def _tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# ---- export_dir -------------------------------------------------------------------------------------------------------
def test_export_dir_with_other_files_is_refused_before_training_and_left_as_it_was(micro_config, tmp_path):
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("x")
    (mine / "sub" / "data.bin").write_bytes(b"\0" * 10)
    before = _tree(mine)
    cfg = micro_config(f"export_dir={mine}")
    with pytest.raises(ConfigError, match=rf"export_dir={mine} holds files that no export of ours wrote "
                                          r"\(notes.txt, sub\).*choose a new or empty directory"):
        run_training(cfg)
    assert _tree(mine) == before
    assert not (Path(cfg.paths.output_dir) / "checkpoints").exists(), "refused before training"

    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConfigError, match=r"export_dir=.*a_file is a file: give a directory"):
        run_training(micro_config(f"export_dir={tmp_path / 'a_file'}", output_dir=tmp_path / "run2"))


def test_an_export_replaces_an_earlier_export_of_ours(micro_config, tmp_path):
    export = tmp_path / "export"
    run_training(micro_config("trainer.max_steps=2", f"export_dir={export}", output_dir=tmp_path / "first"))
    mark = json.loads((export / MARK).read_text())
    assert mark["method"] == "ARModule" and mark["global_step"] == 2
    run_training(micro_config("trainer.max_steps=3", f"export_dir={export}", output_dir=tmp_path / "second"))
    assert json.loads((export / MARK).read_text())["global_step"] == 3
    assert (export / "model.safetensors").is_file()


# ---- run directories ----------------------------------------------------------------------------------------------------
def test_a_run_directory_holding_a_run_is_refused_unless_resuming_from_it(micro_config, tmp_path):
    """A second run into a directory that holds a run is refused (it would resume the first or mix with it); resuming
    from a checkpoint in that directory continues the run there, and its last.ckpt is the one replaced."""
    run = tmp_path / "run"
    run_training(micro_config("trainer.max_steps=3", output_dir=run))
    before = _tree(run)
    with pytest.raises(ConfigError, match=rf"paths.output_dir={run} already holds a run \(checkpoints, config.yaml, "
                                          rf"csv, metrics.json\).*ckpt_path={run}/checkpoints/last.ckpt"):
        run_training(micro_config("trainer.max_steps=6", output_dir=run))
    with pytest.raises(ConfigError, match="already holds a run"):      # another method, same directory
        run_training(micro_config("trainer.max_steps=6", "method=medusa", output_dir=run))
    assert _tree(run) == before, "a refused run changes nothing"

    last = run / "checkpoints" / "last.ckpt"
    assert run_training(micro_config("trainer.max_steps=5", f"ckpt_path={last}", output_dir=run))["global_step"] == 5
    assert sorted(p.name for p in (run / "checkpoints").glob("last*")) == ["last.ckpt"]
    assert torch.load(last, weights_only=True, map_location="cpu")["global_step"] == 5


def test_a_run_resumes_only_from_the_checkpoint_it_is_given(micro_config, tmp_path):
    """Lightning resumes from any last.ckpt beside an ``OnExceptionCheckpoint``; ours is not one, so a run started in a
    directory whose only trace of a run is a checkpoint file starts at step 0 (it is refused when it holds a run)."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    from lit_spec.callbacks import InterruptCheckpoint

    assert not issubclass(InterruptCheckpoint, OnExceptionCheckpoint)
    first = tmp_path / "first"
    run_training(micro_config("trainer.max_steps=3", output_dir=first))
    other = tmp_path / "other"
    (other / "elsewhere").mkdir(parents=True)
    shutil.copy(first / "checkpoints" / "last.ckpt", other / "elsewhere" / "last.ckpt")
    cfg = micro_config("trainer.max_steps=4", "trainer.log_every_n_steps=1",
                       "callbacks.model_checkpoint.dirpath=${paths.output_dir}/elsewhere", output_dir=other)
    assert run_training(cfg)["global_step"] == 4
    with open(other / "csv" / "metrics.csv") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert steps == [0, 1, 2, 3], "it trained from step 0"


def test_a_checkpoint_of_another_model_size_is_refused_and_a_failed_restore_leaves_no_checkpoint(micro_config,
                                                                                                 tmp_path):
    run_training(micro_config("trainer.max_steps=2", output_dir=tmp_path / "small"))
    last = tmp_path / "small" / "checkpoints" / "last.ckpt"
    bigger = micro_config("trainer.max_steps=4", "model.hidden_size=64", f"ckpt_path={last}",
                          output_dir=tmp_path / "bigger")
    with pytest.raises(ConfigError, match=r"a checkpoint of a model of other sizes than .*\(hidden_size 32 vs 64\)"):
        run_training(bigger)
    assert not (tmp_path / "bigger" / "checkpoints").exists()

    # a checkpoint from before sizes were recorded fails in Lightning's restore: no step-0 interrupted.ckpt is left
    old = torch.load(last, weights_only=True, map_location="cpu")
    del old["model_shape"]
    torch.save(old, tmp_path / "old.ckpt")
    with pytest.raises(RuntimeError, match="size mismatch"):
        run_training(micro_config("trainer.max_steps=4", "model.hidden_size=64", f"ckpt_path={tmp_path / 'old.ckpt'}",
                                  output_dir=tmp_path / "old"))
    assert not list((tmp_path / "old").glob("checkpoints/*.ckpt"))


# ---- numbers ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override,message", [
    ("data.batch_size=-1", r"data.batch_size=-1: must be an integer >= 1"),
    ("data.max_train_samples=0", r"data.max_train_samples=0: must be an integer >= 1 \(or null\)"),
    ("data.max_prompt_tokens=abc", r"data.max_prompt_tokens='abc'"),
    ("data.num_workers=-2", r"data.num_workers=-2: must be an integer >= 0"),
    ("trainer.max_steps=abc", r"trainer.max_steps='abc': must be an integer >= -1"),
    ("trainer.max_steps=2.5", r"trainer.max_steps=2.5"),
    ("trainer.accumulate_grad_batches=0", r"trainer.accumulate_grad_batches=0"),
    ("trainer.log_every_n_steps=0", r"trainer.log_every_n_steps=0"),
    ("trainer.val_check_interval=-3", r"trainer.val_check_interval=-3: a number of batches"),
    ("trainer.limit_val_batches=1.5", r"trainer.limit_val_batches=1.5"),
    ("trainer.devices=0", r"trainer.devices=0"),
    ("trainer.gradient_clip_val=-1", r"trainer.gradient_clip_val=-1"),
    ("trainer.precision=17", r"trainer.precision=17: choose one of"),
    ("seed=abc", r"seed='abc': must be an integer >= 0"),
    ("model.attn_implementation=fast", r"model.attn_implementation='fast'"),
    ("export_dtype=int8", r"export_dtype='int8': choose one of"),
])
def test_trainer_and_data_numbers_are_checked_before_any_stage(micro_config, tmp_path, override, message):
    cfg = micro_config(override)
    with open_dict(cfg):
        cfg.paths.cache_dir = str(tmp_path / "empty_cache")   # any stage built would show up here
    with pytest.raises(ConfigError, match=message):
        run_training(cfg)
    assert not (tmp_path / "empty_cache").exists()


def test_trajectory_data_numbers_are_checked(tmp_path):
    cfg = compose_config(["data.batch_size=0"])
    with pytest.raises(ConfigError, match="data.batch_size=0"):
        build(cfg.data)


@pytest.mark.parametrize("override,message", [("bench.temperature=-1", "bench.temperature=-1"),
                                              ("bench.temperature=hot", "bench.temperature='hot'"),
                                              ("bench.device=tpu", "bench.device='tpu': choose auto, cpu or cuda")])
def test_bench_settings_are_checked_before_any_stage(tmp_path, override, message):
    cfg = compose_config([override, f"paths.cache_dir={tmp_path / 'empty_cache'}"], config_name="bench")
    with pytest.raises(ConfigError, match=message):
        run_benchmark(cfg, tmp_path / "out")
    assert not (tmp_path / "empty_cache").exists()


# ---- weights and tokenizers -------------------------------------------------------------------------------------------
def test_truncated_weights_are_a_one_line_error(micro_dirs, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(micro_dirs[0], copy)
    _truncate(copy / "model.safetensors")
    with pytest.raises(ConfigError, match=rf"model.name_or_path={copy}: model.safetensors is damaged .*save the "
                                          "model there again"):
        HFModelSpec(name_or_path=str(copy)).validate()


def test_a_damaged_cached_stage_is_set_aside_and_built_again(tmp_path, caplog):
    cfg = compose_config([*MICRO_MODEL, f"paths.cache_dir={tmp_path / 'cache'}"])
    stage = stages.ensure_stages(cfg.model)[0]
    weights = stage.output / "model.safetensors"
    intact = weights.read_bytes()
    _truncate(weights)
    with caplog.at_level("WARNING", logger="lit_spec.stages"):
        stages.ensure_stages(compose_config([*MICRO_MODEL, f"paths.cache_dir={tmp_path / 'cache'}"]).model)
    assert "is damaged (model.safetensors is damaged" in caplog.text and "building it again" in caplog.text
    assert weights.read_bytes() == intact, "rebuilt, bit for bit (the tiny model is seeded)"
    assert (stage.output.with_name(f"{stage.output.name}.damaged") / "model.safetensors").stat().st_size < len(intact)
    HFModelSpec(name_or_path=str(stage.output)).validate()


def test_a_model_path_that_is_a_file_is_named(micro_dirs):
    weights = str(Path(micro_dirs[0]) / "model.safetensors")
    with pytest.raises(ConfigError, match=r"model.name_or_path=.*model.safetensors is a file: point it at a "
                                          "save_pretrained directory"):
        HFModelSpec(name_or_path=weights).validate()


def test_a_local_model_without_a_tokenizer_is_told_what_is_missing(micro_dirs, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(micro_dirs[0], copy)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (copy / name).unlink(missing_ok=True)
    with pytest.raises(ConfigError) as error:
        HFModelSpec(name_or_path=str(copy)).validate()
    assert "tokenizer.save_pretrained" in str(error.value) and "hub" not in str(error.value)


# ---- the bench ------------------------------------------------------------------------------------------------------------
def test_a_bench_asked_for_more_prompts_than_the_split_has_says_so(micro_dirs, tmp_path, caplog):
    cfg = bench_config(tmp_path, micro_dirs[0], None, "bench.num_prompts=100000", "bench.hf_peers=[]",
                       "bench.max_new_tokens=2", "bench.warmup_prompts=0", "bench.split=validation",
                       "data.max_eval_samples=3")
    with caplog.at_level("WARNING", logger="lit_spec.benchmark"):
        results = run_benchmark(cfg, tmp_path)
    used = results["num_prompts"]          # of the 3, those whose prompt fits data.max_prompt_tokens
    assert 1 <= used <= 3 and results["num_prompts_asked"] == 100000
    assert json.loads((tmp_path / "bench.json").read_text())["num_prompts_asked"] == 100000
    assert f"bench.num_prompts=100000: the split has only {used}" in (tmp_path / "bench.md").read_text()
    assert f"bench.num_prompts=100000, but the validation split has {used} records" in caplog.text


@pytest.mark.parametrize("experiment,chosen", [("smollm2_humaneval", "prompt_lookup"), ("ouroboros_gsm8k", "ouroboros"),
                                               ("ouroboros_quickstart", "speculative")])
def test_an_explicit_decoder_list_is_what_runs(experiment, chosen):
    """Experiments tune decoders they choose (decoding.lookahead.window=...); choosing others on the command line
    runs only those."""
    cfg = compose_config([f"+experiment={experiment}", f"decoding=[{chosen}]"], config_name="bench")
    assert list(chosen_decoders(cfg.decoding)) == [chosen]
    default = compose_config([f"+experiment={experiment}"], config_name="bench")
    assert chosen in chosen_decoders(default.decoding)


def test_a_draft_set_as_a_string_gets_the_syntax_that_works(micro_dirs, tmp_path):
    cfg = bench_config(tmp_path, micro_dirs[0], None)
    with open_dict(cfg):
        cfg.draft = "tiny_draft"
    with pytest.raises(ConfigError, match=r"draft='tiny_draft': .*model@draft=NAME \(e.g. model@draft=tiny_draft\)"):
        run_benchmark(cfg, tmp_path)
    with pytest.raises(ConfigError, match=r"needs a draft model: choose one with model@draft=NAME"):
        build_decoders(None, {"speculative": {"needs_draft": True}})


def test_collection_trainer_numbers_are_checked_before_any_stage(tmp_path):
    from lit_spec.collection import run_collection

    cfg = compose_config(["trainer.devices=0", f"collect.out_dir={tmp_path / 'out'}",
                          f"paths.cache_dir={tmp_path / 'empty_cache'}"], config_name="collect")
    with pytest.raises(ConfigError, match="trainer.devices=0"):
        run_collection(cfg)
    assert not (tmp_path / "empty_cache").exists() and not (tmp_path / "out").exists()
