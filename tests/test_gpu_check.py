"""The GPU machine's one device call (experiments/gpu_check.sh), rehearsed on CPU as docs/distributed.md says it runs,
with only ``--rehearse`` (the CPU, two runs at a time) and the micro sizes (GPU_CHECK_OVERRIDES) added, so that a
setup bug fails here rather than on a lent GPU. What it proves: the wheels that experiments/gpu_wheels.sh fetches
(every one the GPU image lacks, at this venv's versions, built for this Python rather than the image's) install with
pip --no-index into a target directory, and the carried modules import from there; the stages tarball unpacks into
the cache the runs read, and no run builds a stage; the `python` on PATH keeps the environment it wraps (torch); the
environment is offline; every training run trains, exports (EAGLE-3 with its vllm/ layout) and every bench loads
the exports and generates with them; every run prints its line with its exit code, and the summary lists each.

The stages are micro models under the real stages' names (tiny_target-<key>, tiny_draft-<key>) and written
trajectories under the name the runs look for: the runs' commands stay the GPU's. What it cannot prove: CUDA, NCCL,
JOBS runs sharing one GPU, the image's own packages.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import MICRO_MODEL, built_spec
from lit_spec.config import compose_config
from lit_spec.stages import find_stages
from test_cllm import write_trajectories

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "gpu_check.sh"
MICRO_TARGET = [*MICRO_MODEL, "model.num_hidden_layers=4"]     # the tiny target's 4 layers: the quickstarts' layers
MICRO_DRAFT = [*MICRO_MODEL, "model.seed=1", "model.num_hidden_layers=1"]
TRAJECTORIES = ["method.n_tokens=3", "data.max_context_tokens=null"]   # the written trajectories' blocks of 3
STDLIB = ["data.max_train_samples=64", "data.max_eval_samples=16", "data.max_prompt_tokens=64",
          "data.max_answer_tokens=32"]
# kind/name glob -> the rehearsal's sizes (GPU_CHECK_OVERRIDES): few steps, prompts and tokens
OVERRIDES = {
    "train/*": ["callbacks.speedup.num_prompts=2", "callbacks.speedup.max_new_tokens=8",
                "callbacks.speedup.drift_data=null", "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false",
                "trainer.limit_val_batches=2"],
    "train/cllm_*": TRAJECTORIES,
    "train/jacobi_forcing_*": [*TRAJECTORIES, "data.noise_window=2"],
    "train/chimera_*": STDLIB,
    "train/hidden_transfer_*": STDLIB,
    "train/eagle3_*": [*STDLIB, "method.draft_vocab_size=128"],      # within the micro vocabulary of 512
    "bench/*": ["bench.num_prompts=2", "bench.max_new_tokens=8", "bench.warmup_prompts=0", "bench.drift_data=null"],
    "bench/bench_fast_path": ["decoding.prompt_lookup.num_draft_tokens=1", "decoding.speculative.gamma=1"],  # few widths
}


def script_runs() -> dict[str, list[str]]:
    """The run names in gpu_check.sh's lists, by kind (read from the script: a run added there is checked)."""
    runs = re.findall(r'^  "(train|bench) (\w+) ', SCRIPT.read_text(), re.M)
    return {kind: [name for k, name in runs if k == kind] for kind in ("train", "bench")}


def micro_stages(cache: Path) -> list[str]:
    """The stages the runs read, in ``cache`` under their real names: micro models (built in the session's stage
    cache) for the tiny target and draft, written trajectories for the collected ones. Returns their names."""
    configs = [compose_config(["+experiment=cllm_quickstart", *TRAJECTORIES]), compose_config([], "bench")]
    stages = {stage.name: stage for cfg in configs for stage in find_stages(cfg)}
    sources = {"tiny_target": built_spec(MICRO_TARGET).name_or_path, "tiny_draft": built_spec(MICRO_DRAFT).name_or_path}
    wanted = [name for name in stages if name.split("-")[0] in (*sources, "trajectories")]
    for name in wanted:
        kind = name.split("-")[0]
        if kind == "trajectories":
            write_trajectories(cache / name, train=8, validation=4)
        else:
            shutil.copytree(sources[kind], cache / name)
    return wanted


def checkout(tmp: Path) -> Path:
    """A working tree as the device machine gets it: the repository's files (linked), the carried .whl and .gpu."""
    work = tmp / "work"
    work.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in (".whl", ".gpu", "logs", ".git"):
            (work / entry.name).symlink_to(entry)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run(["bash", "experiments/gpu_wheels.sh", ".whl", version], cwd=work, check=True,
                   env={**os.environ, "VENV_PYTHON": sys.executable}, stdout=subprocess.DEVNULL, timeout=600)
    built = tmp / "built_stages"
    names = micro_stages(built)
    (work / ".gpu").mkdir()
    with tarfile.open(work / ".gpu" / "stages.tgz", "w:gz") as tar:
        for name in names:
            tar.add(built / name, arcname=name)
    return work


def rehearse(work: Path, tmp: Path) -> subprocess.CompletedProcess:
    """The device call's command with --rehearse, in a fresh stage cache and root, online variables unset."""
    overrides = tmp / "micro.overrides"
    overrides.write_text("".join(f"{glob} {' '.join(values)}\n" for glob, values in OVERRIDES.items()))
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "WANDB_MODE")}
    env |= {"PATH": f"{Path(sys.executable).parent}:{env['PATH']}", "LIT_SPEC_CACHE": str(tmp / "cache"),
            "GPU_CHECK_ROOT": str(tmp / "root"), "GPU_CHECK_OVERRIDES": str(overrides), "STEPS": "1",
            "RUN_TIMEOUT": "150", "DEADLINE": "600",
            # a shell that has one (pytest's in-process trainings export it): the parallel runs must not share it
            "MASTER_PORT": "29555",
            # DeepSpeed's CPU op, built from the carried wheel's sources: kept apart from the one the other tiers
            # build from the venv's (each would rebuild the other's)
            "TORCH_EXTENSIONS_DIR": str(tmp / "torch_extensions")}
    return subprocess.run(["bash", "experiments/gpu_check.sh", "--rehearse"], cwd=work, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)


def test_device_call_rehearsed_on_cpu(tmp_path):
    work = checkout(tmp_path)
    proc = rehearse(work, tmp_path)
    output, out = proc.stdout, work / "logs" / "gpu_check"
    assert proc.returncode == 0, output
    summary = output.split("== summary", 1)[1]
    lines = {line.split()[0]: line for line in summary.splitlines()[1:] if line.strip()}
    runs = script_runs()
    assert set(lines) == {"setup_wheels", "setup_stages", "setup_imports", *runs["train"], *runs["bench"]}, summary
    assert all(" rc=0 " in line for line in lines.values()), summary
    assert str(tmp_path / "root" / "site" / "deepspeed") in (out / "setup_imports.log").read_text()
    for name in runs["train"]:
        assert "export=yes" in lines[name] and (tmp_path / "root" / "runs" / name / "export").is_dir(), lines[name]
        assert "FAILED" not in lines[name]
    assert "export=yes+vllm" in lines["eagle3_zero2"]
    for name in runs["bench"]:     # each decoder generated; in fp32 exactly as our AR did (every one is lossless)
        decoders = lines[name].split(" | ")[1:]
        generated = r"exact 1\.00 tokens [1-9]" if "float32" in lines[name] else r"tokens [1-9]"
        assert decoders and all(re.search(generated, d) for d in decoders), lines[name]
    for log in out.glob("*.log"):   # every stage came from the tarball
        assert "building into" not in log.read_text(), log.name
    assert (out / "gpu_check.tgz").is_file()
