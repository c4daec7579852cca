"""The card's distributed path, run for real: every trainable method under the card's DeepSpeed ZeRO-3, and DDP,
ZeRO-2 and FSDP2 by the methods whose trained parts each treats differently (``MATRIX``, ``BF16_MATRIX``), on 2 CPU
processes (gloo), through ``python -m lit_spec.train`` as a user runs it, in fp32 (trains, exports losslessly,
resumes) and in the GPU's bf16-mixed (trains and exports with the dtypes the precision policy states); and data
parallelism changing nothing but speed.

Each run is a CLI subprocess (Lightning re-launches the same command for rank 1), ~25 s on 2 cores: the module is
marked ``distributed`` and runs as its own step of ``.ci/run`` (``pytest -m distributed``, 2 workers).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import MICRO_MODEL, MICRO_RUN, built_method, make_config
from lit_spec.decoding import generate
from lit_spec.serving.vllm_export import check_vllm_export
from test_cllm import write_trajectories
from test_draft_distill import STUDENT
from test_dflash import DFLASH
from test_eagle3 import EAGLE3

pytestmark = pytest.mark.distributed

TIMEOUT_S = 600     # the first ZeRO-Offload run compiles DeepSpeedCPUAdam (~2-3 min on 2 busy cores)
TESTS = Path(__file__).parent
# every run: 2 processes, checkpoints every 2 steps kept, the speedup callback at train start and at each validation
TWO_RANKS = ["trainer.devices=2", "trainer.log_every_n_steps=1", "trainer.max_steps=6", "trainer.val_check_interval=3",
             "callbacks=speedup", "callbacks.speedup.num_prompts=2", "callbacks.speedup.max_new_tokens=8",
             "callbacks.model_checkpoint.every_n_train_steps=2", "callbacks.model_checkpoint.save_top_k=-1",
             "callbacks.model_checkpoint.monitor=null", "callbacks.speedup.drift_data=null"]
BASE_CHECK = ["+callbacks.base_unchanged._target_=sharded_checks.FrozenBaseUnchanged"]
HEADS = {"chimera": ["method=chimera"], "medusa": ["method=medusa"],
         "hidden_transfer": ["method=hidden_transfer", "method.layers=[1,2]", "method.tree=[2,1]"], "eagle3": EAGLE3,
         "dflash": DFLASH}
# method -> (overrides, the decoder the speedup callback measures besides AR)
AR_JACOBI = ["callbacks.speedup.extra_decoders={jacobi: {n_tokens: 4}}"]
METHODS = {"ar": (AR_JACOBI, "jacobi"),
           "ar_lora": ([*AR_JACOBI, "method.lora={r: 4, lora_alpha: 8}"], "jacobi"),   # adapters partitioned too
           # as the 7B-70B configs run it: a frozen ZeRO-3 base recomputed under checkpointing (DeepSpeed#8148)
           "ar_lora_checkpointing": ([*AR_JACOBI, "method.lora={r: 4, lora_alpha: 8}",
                                      "model.gradient_checkpointing=true"], "jacobi"),
           "cllm": ([], "jacobi"),
           "cllm_packed": ([], "jacobi"),
           "jacobi_forcing": ([], "multiblock"),
           **{name: ([*args, *BASE_CHECK], name) for name, args in HEADS.items()},
           "draft_distill": (["method=draft_distill", *STUDENT, *BASE_CHECK], "speculative")}
ZERO = ["deepspeed_zero2", "deepspeed_zero3"]
LORA = ("ar_lora", "ar_lora_checkpointing")
# Every method under the card's ZeRO-3 in fp32 (trains, exports, and resumes, but where a method's checkpoint holds
# what another's does: AR and Jacobi Forcing a trained model, as CLLM; Hidden Transfer's linear maps and DFlash's
# draft, trained heads as Medusa's). ZeRO-2 and FSDP2 in fp32: CLLM (a trained model beside its frozen original), Medusa (trained heads on a
# frozen base, standing for the other heads) and AR under FSDP2.
# bf16-mixed, the GPU's precision, under every strategy, with the dtypes the precision policy states, by the methods
# whose trained parts the strategy treats differently:
# - DDP and ZeRO-2, where every rank holds every trained part whole: CLLM and Medusa (the rehearsals add Chimera,
#   Hidden Transfer and the distilled draft under bf16 DDP, EAGLE-3 under bf16 ZeRO-2);
# - ZeRO-3, the card's: CLLM and Medusa (each resumed), packed CLLM (Jacobi Forcing's step), EAGLE-3 (its draft
#   vocabulary maps), the distilled draft (a second model), LoRA adapters (resumed; and under checkpointing, as the
#   7B-70B configs run it: a frozen ZeRO-3 base recomputed, DeepSpeed#8148);
# - FSDP2, which wraps each trained module in its own way: AR, CLLM, Chimera, Medusa, EAGLE-3, DFlash (whose
#   context and logits run outside forward), the distilled draft, LoRA adapters.
NO_FP32_RESUME = ("ar", "jacobi_forcing", "hidden_transfer", "dflash")
MATRIX = [(m, "deepspeed_zero3") for m in METHODS if m not in (*LORA, "cllm_packed")] + [
    (m, "deepspeed_zero2") for m in ("cllm", "medusa")] + [(m, "fsdp") for m in ("ar", "cllm", "medusa")]
BF16_STRATEGIES = {"ddp": ("cllm", "medusa"), "deepspeed_zero2": ("cllm", "medusa"),
                   "deepspeed_zero3": ("cllm", "cllm_packed", "medusa", "eagle3", "draft_distill", *LORA),
                   "fsdp": ("ar", "cllm", "chimera", "medusa", "eagle3", "dflash", "draft_distill", "ar_lora")}
BF16_MATRIX = [(m, s) for s, methods in BF16_STRATEGIES.items() for m in methods]
# resumed in bf16 under ZeRO-3 (bf16 weights, fp32 masters): a trained model, trained heads, LoRA adapters
BF16_RESUMES = ("cllm", "medusa", "ar_lora")
TRAJECTORY_METHODS = {"cllm": ["data=trajectories"],
                      "cllm_packed": ["data=noisy_trajectories", "data.noise_schedule=uniform"],
                      "jacobi_forcing": ["data=noisy_trajectories", "data.noise_window=2", "data.noise_schedule=random"]}


def cli_env() -> dict:
    """A training process's environment: the tests' helpers importable, no hub, W&B offline, unbuffered output."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
                HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", PYTHONUNBUFFERED="1")


def train_cli(run_dir: Path, *overrides: str) -> dict:
    """``python -m lit_spec.train`` in its own process group (a hung rank is killed with it); returns metrics.json."""
    env = cli_env()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lit_spec.train", *overrides, f"hydra.run.dir={run_dir}"],
                                cwd=run_dir.parent, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"{run_dir.name} did not finish in {TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
    assert proc.returncode == 0, log.read_text()[-5000:]
    return json.loads((run_dir / "metrics.json").read_text())


def logged(run_dir: Path, key: str) -> list[tuple[int, float]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return [(int(r["step"]), float(r[key])) for r in csv.DictReader(f) if r.get(key)]


# each strategy with the teardown a GPU's does: the module moved away, out of reach of collectives and reads
OFF_DEVICE = {"ddp": "DDP", "deepspeed_zero2": "DeepSpeed", "deepspeed_zero3": "DeepSpeed", "fsdp": "FSDP"}


def strategy_run(strategy: str) -> list[str]:
    """The strategy, its teardown as on a GPU (``sharded_checks.TeardownOffDevice``), ZeRO-3 with every parameter
    partitioned (DeepSpeed keeps ones under 1e5 elements whole by default: all of a micro model's), and what each
    rank holds written by MemoryMonitor."""
    persistence = ["trainer.strategy.param_persistence_threshold=0"] if strategy == "deepspeed_zero3" else []
    off_device = ([f"trainer.strategy._target_=sharded_checks.{OFF_DEVICE[strategy]}TeardownOffDevice"]
                  if strategy in OFF_DEVICE else [])
    return [f"strategy={strategy}", *persistence, *off_device,
            "++callbacks.memory._target_=lit_spec.callbacks.MemoryMonitor"]


# the precision policy (lit_spec.precision) per strategy and precision: the dtypes of frozen and trained weights and
# of the optimizer's masters, as MemoryMonitor reads them on every rank ([]: the weights are their own masters)
# (fp32 ZeRO-3 keeps an fp32 master copy here too: DeepSpeed steps the weights in place only when the partition's
# device equals its own, and on CPU rank r's is cpu:r against the tensors' cpu; on a GPU both are cuda:r)
POLICY = {("32-true", s): ("float32", "float32", [] if s == "fsdp" else ["float32"]) for s in (*ZERO, "fsdp")} | {
    ("bf16-mixed", s): ("bfloat16", "bfloat16", ["float32"]) for s in ZERO} | {
    ("bf16-mixed", s): ("float32", "float32", []) for s in ("ddp", "fsdp")}
BYTES = {"float32": 4, "bfloat16": 2}


def check_held(run_dir: Path, strategy: str, precision: str = "32-true", measured: bool = True,
               lora: bool = False, original: bool = False) -> None:
    """Each rank holds its weights in the policy's dtypes, and half of what its strategy partitions (DDP: nothing,
    every rank holds all of it): ZeRO-2 the optimizer (Adam's m and v and the fp32 master copy ZeRO keeps), ZeRO-3
    the parameters too, FSDP the parameters and optimizer of what trains. Where the weights are sharded and the run
    is ``measured`` (the speedup callback), it also held the callback's decoding copy: what the decoders run and is
    sharded, no more. A frozen base stays whole under FSDP (the copy shares it); the frozen weights of a ``lora`` run
    are the sharded model's own; the frozen ``original`` an AR term distils from is never decoded."""
    frozen_dtype, trained_dtype, masters = POLICY[precision, strategy]
    for rank in (0, 1):
        held = json.loads((run_dir / f"memory.rank{rank}.json").read_text())
        frozen_count = held["param_count"] - held["trainable_count"]
        assert held["dtypes"] == {"frozen": [frozen_dtype] if frozen_count else [], "trained": [trained_dtype],
                                  "masters": masters}, (rank, held["dtypes"])
        frozen = frozen_count * BYTES[frozen_dtype] / 2**20
        trained = held["trainable_count"] * BYTES[trained_dtype] / 2**20
        # Adam's m and v (fp32), plus the fp32 masters where the strategy keeps them apart from the weights
        states = held["trainable_count"] * 4 * (2 + len(masters)) / 2**20
        expected = {"ddp": (frozen + trained, states),
                    "deepspeed_zero2": (frozen + trained, states / 2),
                    "deepspeed_zero3": ((frozen + trained) / 2, states / 2),
                    "fsdp": (frozen / (2 if lora else 1) + trained / 2, states / 2)}[strategy]
        assert (held["params_mb"], held["optimizer_mb"]) == pytest.approx(expected, rel=0.1), (rank, held, expected)
        frozen_copied = not original and (strategy == "deepspeed_zero3" or lora)
        copy = trained + frozen * frozen_copied if measured and strategy in ("deepspeed_zero3", "fsdp") else 0.0
        assert held["decode_copy_mb"] == pytest.approx(copy, rel=0.01), (rank, held, copy)


def saved_weights(checkpoint: Path) -> set[str]:
    """The module weights a sharded checkpoint holds: DeepSpeed's model states, or FSDP's distributed checkpoint."""
    if (checkpoint / "latest").is_file():
        states = sorted((checkpoint / "checkpoint").glob("*model_states.pt"))
        return set(torch.load(states[0], weights_only=False, map_location="cpu")["module"])
    from torch.distributed.checkpoint import FileSystemReader
    names = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {k.removeprefix("state_dict.") for k in names if k.startswith("state_dict.")}


def method_run(method: str, tmp_path: Path) -> list[str]:
    if method not in TRAJECTORY_METHODS:
        return [*MICRO_RUN, *METHODS[method][0]]
    traj = write_trajectories(tmp_path / "traj", train=8, validation=2)
    return [*MICRO_MODEL, f"method={method}", *TRAJECTORY_METHODS[method], f"data.path={traj}", "data.batch_size=2",
            "method.n_tokens=3", "method.lr=3e-3", "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false"]


def check_export(method: str, export: Path, base_dir: str, initial: dict[str, torch.Tensor]) -> None:
    """What the run exported is in the model's own dtype (fp32, whatever the strategy and precision), is what plain
    transformers (or our heads loader) reads, trained, and decodes losslessly."""
    dtypes = {v.dtype for f in export.glob("*.safetensors") for v in load_file(f).values() if v.is_floating_point()}
    assert dtypes == {torch.float32}, dtypes
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    greedy = generate(base, ids, "ar", max_new_tokens=12).sequences
    if method in ("ar", *LORA, *TRAJECTORY_METHODS):   # a LoRA export: the adapters merged, plain names
        trained = load_file(export / "model.safetensors")
        assert trained.keys() == initial.keys()
        assert any(not torch.equal(trained[k], initial[k]) for k in trained), "exported the untrained weights"
        model = AutoModelForCausalLM.from_pretrained(export)
        assert torch.equal(generate(model, ids, "jacobi", max_new_tokens=12, n_tokens=4).sequences,
                           generate(model, ids, "ar", max_new_tokens=12).sequences)
    elif method == "draft_distill":
        student = AutoModelForCausalLM.from_pretrained(export)
        assert student.config.num_hidden_layers == 1
        out = generate(base, ids, "speculative", max_new_tokens=12, draft_model=student, gamma=3)
        assert torch.equal(out.sequences, greedy)
    else:
        heads = load_file(export / "heads.safetensors")
        assert heads and all(v.numel() > 0 for v in heads.values()), "every tensor whole, none a ZeRO-3 partition"
        if method == "eagle3":
            assert heads["d2t"].any(), "the draft vocabulary of the training answers, not the first ids"
        if method in ("medusa", "dflash"):   # vLLM's layout too, whole (a ZeRO-3 partition: a misshapen weight)
            check_vllm_export(export / "vllm")
        draft = {"transfer": str(export), "tree": [2, 1]} if method == "hidden_transfer" else {"heads": str(export)}
        out = generate(base, ids, method, max_new_tokens=12, **draft)
        assert torch.equal(out.sequences, greedy)


@pytest.mark.parametrize("method, strategy", MATRIX)
def test_method_trains_exports_and_resumes_on_two_processes(method, strategy, tmp_path, micro_dirs):
    run = [*method_run(method, tmp_path), *TWO_RANKS, *strategy_run(strategy)]
    first = tmp_path / "first"
    metrics = train_cli(first, *run)
    assert metrics["global_step"] == 6

    # the speedup callback ran on both ranks (ZeRO-3: every forward collective) at the start and after 2 validations
    decoder = METHODS[method][1]
    assert [v for _, v in logged(first, f"exact_match/{decoder}")] == [1.0, 1.0, 1.0]
    assert len(logged(first, f"mean_accepted/{decoder}")) == 3 and logged(first, "tokens_per_s/ar")

    check_export(method, first / "export", micro_dirs[0], load_file(Path(micro_dirs[0]) / "model.safetensors"))
    check_held(first, strategy, "32-true")
    if "base_unchanged" in " ".join(run):
        for rank in (0, 1):
            result = json.loads((first / f"base_unchanged.rank{rank}.json").read_text())
            assert result["equal"] and result["tensors"] > 0, (rank, result)

    if not (strategy == "deepspeed_zero3" and method in NO_FP32_RESUME):
        check_resume(first, tmp_path / "resumed", run, method)


def check_resume(first: Path, resumed: Path, run: list[str], method: str, rel: float = 1e-5) -> None:
    """Resumed from the sharded checkpoint of step 2 (mid-epoch), the run trains steps 2..5 on the same batches, to
    the same losses; a checkpoint holds what trains, not a frozen base or original (rebuilt on resume)."""
    checkpoint = first / "checkpoints" / "step000002.ckpt"
    assert checkpoint.is_dir(), "sharded checkpoints are directories"
    trained = {"draft_distill": "student", **{name: "heads" for name in HEADS}}.get(method, "model")
    assert {k.split(".")[0] for k in saved_weights(checkpoint)} == {trained}, "no frozen base or original in it"
    steps = json.loads((first / "metrics.json").read_text())["global_step"]
    assert train_cli(resumed, *run, f"ckpt_path={checkpoint}")["global_step"] == steps
    expected = [(s, v) for s, v in logged(first, "train/loss") if s >= 2]
    got = logged(resumed, "train/loss")
    assert [s for s, _ in got] == list(range(2, steps))
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=rel), (expected, got)


@pytest.mark.parametrize("method, strategy", BF16_MATRIX)
def test_method_trains_and_exports_in_bf16_mixed(method, strategy, tmp_path, micro_dirs):
    """The GPU's precision on 2 CPU processes: every method trains, measures and exports under every strategy with
    the dtypes the precision policy states, and under the card's ZeRO-3 resumes (``BF16_RESUMES``). Greedy decoding
    is lossless in fp32 only (bf16's rounding differs between a one-token and a many-token forward), so the decoders
    are measured, not held to exactness, here; the export is in the model's own dtype (fp32) and decodes
    losslessly."""
    run = [*method_run(method, tmp_path), *TWO_RANKS, *strategy_run(strategy), "trainer.precision=bf16-mixed",
           "trainer.max_steps=4", "trainer.val_check_interval=2"]
    if method == "cllm":        # the offline default's AR term: a frozen copy of the original beside the model
        run.append("method.ar_teacher=original")
    metrics = train_cli(tmp_path / "run", *run)
    assert metrics["global_step"] == 4
    assert len(logged(tmp_path / "run", f"mean_accepted/{METHODS[method][1]}")) == 3
    check_held(tmp_path / "run", strategy, "bf16-mixed", lora=method in LORA, original=method == "cllm")
    check_export(method, tmp_path / "run" / "export", micro_dirs[0],
                 load_file(Path(micro_dirs[0]) / "model.safetensors"))
    if strategy == "deepspeed_zero3" and method in BF16_RESUMES:
        check_resume(tmp_path / "run", tmp_path / "resumed", run, method, rel=1e-3)


def test_the_decoding_copy_is_agreed_and_measures_what_the_sharded_model_measures(tmp_path):
    """ZeRO-3, ``decode_copy=auto``. With room on both ranks both decode a plain copy; with none on rank 1, both (one
    decision for all) decode the sharded model collectively, at most two of its four layers whole at a time (DeepSpeed
    releases each after use where, as at 7B+, it is no smaller than its reuse distance and prefetch bucket: set to 0
    for the micro model). Both measure the same τ, exactness and answer NLL at every measurement, and at step 0,
    before any update, what one process measures."""
    common = [*method_run("cllm", tmp_path), *TWO_RANKS, "model.num_hidden_layers=4", "trainer.max_steps=4",
              "trainer.val_check_interval=2"]
    keys = ["mean_accepted/jacobi", "exact_match/jacobi", "drift/nll/heldout"]
    runs = {}
    for name, extra in {"copy": [], "sharded": ["+callbacks.little_room._target_=sharded_checks.LittleRoomOnRank1",
                                                "+callbacks.layers._target_=sharded_checks.WholeLayersWhileDecoding",
                                                "+trainer.strategy.zero_optimization={stage3_max_reuse_distance: 0,"
                                                "stage3_prefetch_bucket_size: 0}"]}.items():
        train_cli(tmp_path / name, *common, *strategy_run("deepspeed_zero3"), *extra)
        runs[name] = {key: logged(tmp_path / name, key) for key in keys}
        assert len(runs[name]["mean_accepted/jacobi"]) == 3
        copies = [json.loads((tmp_path / name / f"memory.rank{r}.json").read_text())["decode_copy_mb"] for r in (0, 1)]
        assert all(copies) if name == "copy" else not any(copies), (name, copies)
    for rank in (0, 1):
        layers = json.loads((tmp_path / "sharded" / f"whole_layers.rank{rank}.json").read_text())
        assert layers["layers"] == 4 and 0 < layers["most"] <= 2, layers
    assert runs["copy"] == runs["sharded"]
    train_cli(tmp_path / "one", *common, "trainer.devices=1")
    one = {key: logged(tmp_path / "one", key)[0][1] for key in keys}
    assert {key: values[0][1] for key, values in runs["copy"].items()} == pytest.approx(one, rel=1e-5)


def test_each_rank_measures_its_share_and_all_log_the_same_figures(tmp_path):
    """DDP, 2 held-out prompts: each rank decodes, scores and measures the NLL of one, and both compute the same
    figures from the gathered whole, though rank 1's model answers otherwise after step 0 (a change only it sees:
    ranks that logged different keys would hang). The weights barely move (lr 1e-9): rank 0's answer stays."""
    run_dir = tmp_path / "run"
    train_cli(run_dir, *method_run("cllm", tmp_path), *TWO_RANKS, "method.lr=1e-9", *strategy_run("ddp"),
              "+callbacks.diverges._target_=sharded_checks.DivergesOnRank1")
    measured = [json.loads((run_dir / f"measured.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [m["nll_forwards"] for m in measured] == [3, 3], "3 measurements, one of the two records each"
    first, second = ({k: v for k, v in m["metrics"].items() if k != "time/measure_s"} for m in measured)
    assert first == second
    assert first["quality/agreement"] == 0.5 and "quality/first_divergence" in first
    assert [v for _, v in logged(run_dir, "quality/agreement")] == [1.0, 0.5, 0.5]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_through_torchrun(tmp_path, micro_dirs):
    """``trainer.num_nodes=2``, rehearsed on one machine: two "nodes" of one process each, each started by its own
    ``torchrun`` (as a user starts one per node; Lightning reads torchrun's environment), ZeRO-3, over localhost.
    They train as one run of 2 ranks: one directory, one metrics.json, one export, written by global rank 0."""
    run_dir, port = tmp_path / "run", free_port()
    overrides = [*MICRO_RUN, "trainer.num_nodes=2", "trainer.devices=1", "trainer.max_steps=4",
                 "trainer.val_check_interval=2", *strategy_run("deepspeed_zero3"), f"hydra.run.dir={run_dir}"]
    nodes = []
    for node in (0, 1):
        log = open(tmp_path / f"node{node}.log", "w")
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "lit_spec.train",
             *overrides], cwd=tmp_path, env=cli_env(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True))
    try:
        codes = [node.wait(timeout=TIMEOUT_S) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    logs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert codes == [0, 0], "\n".join(text[-3000:] for text in logs)
    assert json.loads((run_dir / "metrics.json").read_text())["global_step"] == 4
    for rank in (0, 1):       # each node's process is one rank of the world of 2, holding half of ZeRO-3's weights
        held = json.loads((run_dir / f"memory.rank{rank}.json").read_text())
        assert held["world_size"] == 2 and held["rank"] == rank
    check_held(run_dir, "deepspeed_zero3", measured=False)
    check_export("ar", run_dir / "export", micro_dirs[0], load_file(Path(micro_dirs[0]) / "model.safetensors"))


def test_data_parallelism_changes_nothing_but_speed(tmp_path):
    """2 ranks with batch b give one process's per-step losses and weights with batch 2b, under every strategy,
    across an epoch boundary. Every answer is cut to 8 tokens, so each rank's token-mean loss weighs its tokens as
    one process would, and the 64 records fill every batch (no rank pads its last one with a repeated record)."""
    common = [*MICRO_RUN, "data.max_prompt_tokens=512", "data.max_answer_tokens=8", "trainer.max_steps=5",
              "trainer.val_check_interval=5", "trainer.log_every_n_steps=1", "method.warmup_steps=0"]
    _, datamodule = built_method(make_config(tmp_path / "data", common))
    answers = datamodule.splits["train"]["answer_ids"]
    assert len(answers) == 64 and {len(a) for a in answers} == {8}, "the premise of the comparison"
    one = tmp_path / "one"
    train_cli(one, *common, "data.batch_size=16")
    reference = logged(one, "train/loss")
    assert [s for s, _ in reference] == [0, 1, 2, 3, 4]
    assert reference[-1][1] < reference[0][1] - 0.1, "the steps really train"
    weights = load_file(one / "export" / "model.safetensors")
    for strategy in ("ddp", *ZERO, "deepspeed_zero3_offload", "fsdp"):   # offload: DeepSpeedCPUAdam, built once
        run = tmp_path / strategy
        train_cli(run, *common, "data.batch_size=8", "trainer.devices=2", f"strategy={strategy}")
        losses = logged(run, "train/loss")
        assert [s for s, _ in losses] == [0, 1, 2, 3, 4], strategy
        assert [v for _, v in losses] == pytest.approx([v for _, v in reference], rel=1e-5), (strategy, losses)
        exported = load_file(run / "export" / "model.safetensors")
        for k in weights:
            torch.testing.assert_close(exported[k], weights[k], rtol=1e-4, atol=1e-5, msg=f"{strategy}: {k}")
