"""``python -m lit_spec.train`` as a user runs it: one-line errors, ``--cfg job`` per experiment, a multirun sweep.

Every subprocess pays ~10 s of imports (torch, lightning, transformers) on this machine, so the short ones are
started together by one module fixture and their results shared by the tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from safetensors.torch import load_file

from conftest import MICRO_RUN, hold_lock
from lit_spec.config import config_dir
from lit_spec.run_dir import LOCK

EXPERIMENTS = sorted(p.stem for p in (config_dir() / "experiment").glob("*.yaml") if not p.name.startswith("_"))
# every experiment composes in-process in test_config.py; through the real CLI, two of them (each costs ~10 s)
CLI_EXPERIMENTS = (["tiny_target"] if "tiny_target" in EXPERIMENTS else []) + [
    e for e in EXPERIMENTS if e != "tiny_target"][:1]

ERROR_CASES = {
    "devices": ["trainer.devices=4096", "strategy=deepspeed_zero3"],
    "gpu": ["trainer=gpu"],
    "ckpt": ["ckpt_path=/nonexistent.ckpt"],
    # run directories (prepared by the fixture): one holding an earlier run, one a running run holds, one a file
    "used": [],
    "locked": [],
    "unwritable": [],
    # a run that succeeds, for what it prints (ERROR_CASES: every case runs in the same fixture)
    "clean": ["callbacks=speedup", "callbacks.speedup.num_prompts=2", "callbacks.speedup.max_new_tokens=8",
              "callbacks.speedup.extra_decoders={jacobi: {n_tokens: 4}}", "trainer.log_every_n_steps=1"],
}
TIMEOUT_S = 300


def _env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(LIT_SPEC_CACHE=str(cache), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline",
               PYTHONUNBUFFERED="1")
    env.pop("WANDB_API_KEY", None)
    return env


def _train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "lit_spec.train", *args]


def _run_all(cmds: dict[str, list[str]], cwd: Path, env: dict[str, str]) -> dict[str, subprocess.CompletedProcess]:
    """Run the commands concurrently (stdin closed: nothing may prompt); output goes to files, so no pipe fills."""
    procs, logs = {}, {}
    try:
        for name, cmd in cmds.items():
            out, err = cwd / f"{name}.out", cwd / f"{name}.err"
            logs[name] = (out, err)
            with open(out, "w") as o, open(err, "w") as e:
                procs[name] = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=o, stderr=e)
        results = {}
        for name, p in procs.items():
            try:
                p.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                pytest.fail(f"{' '.join(cmds[name])} did not finish in {TIMEOUT_S} s")
            out, err = logs[name]
            results[name] = subprocess.CompletedProcess(p.args, p.returncode, out.read_text(), err.read_text())
        return results
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def cli(stage_cache, tmp_path_factory) -> tuple[dict[str, subprocess.CompletedProcess], Path]:
    root = tmp_path_factory.mktemp("cli")
    for name in (".hydra/config.yaml", "checkpoints/last.ckpt"):
        (root / "used" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "used" / name).write_text(f"the earlier run's {name}")
    (root / "unwritable").write_text("a file where the run directory should be")
    cmds = {name: _train_cmd(*MICRO_RUN, *args, f"hydra.run.dir={root / name}")
            for name, args in ERROR_CASES.items()}
    cmds |= {f"cfg_{e}": _train_cmd(f"+experiment={e}", f"hydra.run.dir={root / e}", "--cfg", "job")
             for e in CLI_EXPERIMENTS}
    cmds["bench_draft"] = [sys.executable, "-m", "lit_spec.bench", "draft=tiny_draft", "bench.engines=[eager]",
                           f"hydra.run.dir={root / 'bench_draft'}"]
    holder = hold_lock(root / "locked" / LOCK, TIMEOUT_S)
    try:
        return _run_all(cmds, root, _env(stage_cache)), root
    finally:
        holder.kill()
        holder.wait()


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


@pytest.mark.slow
def test_more_processes_than_cores_is_a_one_line_error(cli):
    results, root = cli
    line = _one_line_error(results["devices"])
    assert "trainer.devices=4096" in line and "CPU cores" in line, line
    assert not (root / "devices" / "config.yaml").exists(), "it failed before building anything"


@pytest.mark.slow
def test_gpu_trainer_on_cpu_is_a_one_line_error(cli):
    line = _one_line_error(cli[0]["gpu"])
    assert "trainer.accelerator=gpu" in line and "CUDA" in line and "trainer=cpu" in line, line


@pytest.mark.slow
def test_missing_checkpoint_is_a_one_line_error(cli):
    line = _one_line_error(cli[0]["ckpt"])
    assert "/nonexistent.ckpt" in line and "no such checkpoint" in line, line


@pytest.mark.slow
def test_a_run_prints_each_line_once_and_ends_with_a_summary_and_a_plot(cli):
    results, root = cli
    result = results["clean"]
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout + result.stderr
    lines = [line for line in printed.splitlines() if line.strip()]
    assert not [line for line in lines if line.startswith("INFO: ")], "Lightning's own handler printed it again"
    for noise in ("💡 Tip", "FLOPs", "flops_per_batch", "past_key_values", "LeafSpec", "Setting accelerator to CPU"):
        assert noise not in printed, noise
    messages = [line.split("] - ", 1)[1] for line in lines if "] - " in line and line.split("] - ", 1)[1].strip()]
    assert len(messages) == len(set(messages)), "a log line printed twice"
    assert "done: train — ARModule on" in printed and "jacobi: τ 1.00 → " in printed
    said = json.loads((root / "clean" / "metrics.json").read_text())["verdict"]      # the trade, in words, in both
    assert f"verdict: {said}" in printed and said.startswith(("faster", "not faster than AR"))
    assert f"files in {root / 'clean'}:" in printed and "speedup.png" in printed and "next:" in printed
    assert "python -m lit_spec.train -m method.lr=0.0015,0.006  # a sweep" in printed   # the run's 3e-3: half, twice
    assert (root / "clean" / "speedup.png").stat().st_size > 10_000
    # the model summary is printed, without its column and total of FLOPs (none are counted: "FLOPs" is noise above)
    assert "Trainable params" in printed and "Total estimated model params size (MB)" in printed


@pytest.mark.slow
def test_a_run_directory_holding_a_run_is_refused_before_hydra_writes_there(cli):
    results, root = cli
    line = _one_line_error(results["used"])
    assert f"hydra.run.dir={root / 'used'} already holds a run (.hydra, checkpoints)" in line, line
    assert "ckpt_path=" in line
    assert sorted(str(p.relative_to(root / "used")) for p in (root / "used").rglob("*") if p.is_file()) == [
        ".hydra/config.yaml", ".run.lock", "checkpoints/last.ckpt"], "no train.log, no new .hydra"
    assert (root / "used" / ".hydra" / "config.yaml").read_text() == "the earlier run's .hydra/config.yaml"


@pytest.mark.slow
def test_a_second_run_into_a_running_runs_directory_is_refused(cli):
    results, root = cli
    line = _one_line_error(results["locked"])
    assert f"hydra.run.dir={root / 'locked'} is being written by another process (pid" in line, line
    assert sorted(p.name for p in (root / "locked").iterdir()) == [LOCK]


@pytest.mark.slow
def test_an_unwritable_run_directory_is_a_one_line_error(cli):
    results, root = cli
    line = _one_line_error(results["unwritable"])
    assert f"hydra.run.dir={root / 'unwritable'}: cannot write there" in line, line


@pytest.mark.slow
def test_a_draft_given_as_a_name_gets_the_syntax_that_works(cli):
    line = _one_line_error(cli[0]["bench_draft"])
    assert "model@draft=tiny_draft" in line, line


@pytest.mark.slow
@pytest.mark.parametrize("experiment", CLI_EXPERIMENTS)
def test_cfg_job_prints_the_experiment(cli, experiment):
    result = cli[0][f"cfg_{experiment}"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert any(line.startswith("model:") for line in result.stdout.splitlines()), result.stdout[:2000]
    printed = yaml.safe_load(result.stdout)
    assert {"model", "data", "method", "trainer", "callbacks", "paths"} <= set(printed), sorted(printed)
    assert "hydra" not in printed  # --cfg job: the job's config only
    task_name = OmegaConf.load(config_dir() / "experiment" / f"{experiment}.yaml").get("task_name")
    if task_name is not None:
        assert printed["task_name"] == task_name


@pytest.mark.slow
def test_multirun_sweep_gives_each_job_its_run_dir(stage_cache, tmp_path):
    micro = [o for o in MICRO_RUN if not o.startswith("method.lr=")]  # the sweep sets it
    sweep = tmp_path / "sweep"
    cmd = _train_cmd("-m", "method.lr=1e-3,2e-3", *micro, f"hydra.sweep.dir={sweep}")
    result = _run_all({"multirun": cmd}, tmp_path, _env(stage_cache))["multirun"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr

    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    weights = []
    for job, lr in (("0", 1e-3), ("1", 2e-3)):
        run = sweep / job
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["global_step"] == 8 and metrics["val/loss"] > 0, metrics
        cfg = OmegaConf.load(run / "config.yaml")
        assert cfg.method.lr == lr
        assert Path(cfg.paths.output_dir) == run and Path(cfg.export_dir) == run / "export"
        ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        assert ckpt["global_step"] == 8 and ckpt["hyper_parameters"]["lr"] == lr
        weights.append(load_file(run / "export" / "model.safetensors"))
    assert weights[0].keys() == weights[1].keys()
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), "two lrs, same weights"


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path):
    """The run directory is the start time and the process id: two processes composing the train config at once (in
    the same second, as two jobs of a scheduler may) get two directories."""
    code = ("from hydra import compose, initialize_config_dir\nfrom lit_spec.config import config_dir\n"
            "with initialize_config_dir(config_dir=str(config_dir()), version_base='1.3'):\n"
            "    print(compose(config_name='train', return_hydra_config=True).hydra.run.dir)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
             for _ in range(2)]
    dirs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert dirs[0] != dirs[1] and all(d.startswith("logs/train/runs/") for d in dirs)
    assert sorted(d.rsplit("_", 1)[1] for d in dirs) == sorted(str(p.pid) for p in procs)


@pytest.mark.parametrize("kind, param", [("eagle3", "heads"), ("dflash", "heads"), ("hidden_transfer", "transfer")])
def test_a_trained_draft_is_named_and_its_bench_command_decodes_with_it(tmp_path, kind, param):
    """A frozen-base run's ending names its export a draft and says how to bench it with its decoder, not as a
    model (a heads directory has no weights transformers can load)."""
    from lit_spec.console import training_summary

    export = tmp_path / "export"
    export.mkdir()
    (export / "heads.json").write_text(json.dumps({"kind": kind}))
    cfg = OmegaConf.create({"task_name": "train", "export_dir": str(export), "model": {"name_or_path": "m"},
                            "method": {"_target_": "lit_spec.methods.Eagle3Module", "lr": 1e-3, "block_size": 8},
                            "paths": {"output_dir": str(tmp_path)}})
    printed = training_summary(cfg, {"global_step": 3}, [], 0, 1.0)
    assert f"export/          the trained {kind} draft" in printed and "model.name_or_path" not in printed
    assert f"python -m lit_spec.bench 'decoding=[{kind}]' decoding.{kind}.{param}={export} draft=null" in printed
    assert "vllm serve" not in printed                        # no export/vllm (Hidden Transfer never has one)
    if kind != "hidden_transfer":           # a DFlash block of 8 drafts its 7 mask slots
        (export / "vllm").mkdir()
        printed = training_summary(cfg, {"global_step": 3}, [], 0, 1.0)
        tokens = 7 if kind == "dflash" else 4
        assert (f"""vllm serve m --speculative-config '{{"method": "{kind}", "model": "{export / 'vllm'}", """
                f'"num_speculative_tokens": {tokens}}}\'') in printed
