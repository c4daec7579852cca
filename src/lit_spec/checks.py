"""What a training run checks before any work, the one room for it: the trainer's numbers, the hardware, the
method against its data, the data settings, ``ckpt_path``, the run and export directories (``check_run``); and, once
the model's stage and the datamodule exist, the checkpoint's model sizes and the method's block size. Each failure is
one ``ConfigError`` line naming the setting and the fix."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import get_args

import torch
from hydra.utils import get_class
from lightning.fabric.connector import _PRECISION_INPUT
from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_spec.config import build
from lit_spec.errors import ConfigError, check_count
from lit_spec.export import check_export_dir
from lit_spec.io import launch_rank
from lit_spec.methods.frozen_base import FrozenBaseModule
from lit_spec.models.lora import lora_config
from lit_spec.models.spec import DTYPES, model_shape
from lit_spec.run_dir import check_run_dir
from lit_spec.strategies import is_deepspeed, is_fsdp


def check_run(cfg: DictConfig) -> dict | None:
    """Every check the config alone allows, in the order a user would fix them; returns the ``ckpt_path``
    checkpoint's state (None without one)."""
    check_count("seed", cfg.get("seed"), minimum=0, optional=True)
    check_trainer(cfg.trainer)
    matmul = cfg.get("float32_matmul_precision", "highest")
    if matmul not in MATMUL_PRECISIONS:
        raise ConfigError(f"float32_matmul_precision={matmul!r}: choose one of {list(MATMUL_PRECISIONS)}")
    check_hardware(cfg)
    check_method_data(cfg)
    build(cfg.data)   # its settings are checked as it is built; without a tokenizer it reads nothing
    ckpt_path = cfg.get("ckpt_path")
    checkpoint = check_checkpoint(Path(ckpt_path), cfg) if ckpt_path else None
    if launch_rank() == 0:   # the other processes of a launch share the directory rank 0 has begun writing
        check_run_dir(cfg.paths.output_dir, ckpt_path, "paths.output_dir")
    if cfg.get("export_dir"):
        check_export_dir(cfg.export_dir)
    if cfg.get("export_dtype", "auto") not in DTYPES:
        raise ConfigError(f"export_dtype={cfg.export_dtype!r}: choose one of {sorted(DTYPES)} (auto: the model's own)")
    return checkpoint


def _strategy_class(cfg: DictConfig) -> type | None:
    strategy = cfg.trainer.get("strategy")
    return get_class(strategy._target_) if isinstance(strategy, DictConfig) and "_target_" in strategy else None


def check_hardware(cfg: DictConfig) -> None:
    """What cannot run on this machine fails here, in one line, instead of deep inside Lightning."""
    accelerator, devices = cfg.trainer.get("accelerator"), cfg.trainer.get("devices")
    if accelerator in {"gpu", "cuda"} and not torch.cuda.is_available():
        raise ConfigError(f"trainer.accelerator={accelerator} but no CUDA GPU is visible: use trainer=cpu")
    if isinstance(devices, int) and not isinstance(devices, bool):
        gpus = accelerator in {"gpu", "cuda"} or (accelerator == "auto" and torch.cuda.is_available())
        have, what = ((torch.cuda.device_count(), "CUDA GPUs") if gpus
                      else (len(os.sched_getaffinity(0)), "CPU cores, one per process"))
        if devices > have:
            raise ConfigError(f"trainer.devices={devices} but this machine has {have} {what}: use "
                              f"trainer.devices<={have}")


def _checkpoint_kind(path: Path) -> str | None:
    """``file`` (a Lightning .ckpt), ``deepspeed`` (DeepSpeed's directory) or ``distributed`` (FSDP's
    torch.distributed.checkpoint directory); None: none of them."""
    if path.is_file():
        return "file"
    if (path / "latest").is_file() or (path / "checkpoint").is_dir():
        return "deepspeed"
    return "distributed" if (path / "meta.pt").is_file() else None


def _checkpoint_state(path: Path, kind: str) -> dict:
    """The checkpoint's Lightning state without its weights (method, step, DeepSpeed's world size), read lazily."""
    if kind == "deepspeed":
        tag = (path / "latest").read_text().strip() if (path / "latest").is_file() else "checkpoint"
        path = min((path / tag).glob("*model_states.pt"), default=path / tag / "missing")
    elif kind == "distributed":
        path = path / "meta.pt"
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


RESUMES_FROM = {"file": "a .ckpt file", "deepspeed": "a DeepSpeed checkpoint directory (strategy=deepspeed_*)",
                "distributed": "an FSDP checkpoint directory (strategy=fsdp)"}


def check_checkpoint(path: Path, cfg: DictConfig) -> dict:
    """``ckpt_path`` resumes this run: a checkpoint of the kind its strategy writes (a .ckpt file, a DeepSpeed or an
    FSDP directory), of the same method, not already at ``trainer.max_steps``, and for DeepSpeed's partitioned
    optimizer states written by as many processes."""
    if not path.exists():
        raise ConfigError(f"ckpt_path={path}: no such checkpoint; pass a checkpoint from an earlier run's checkpoints/")
    strategy = _strategy_class(cfg)
    wanted = "deepspeed" if is_deepspeed(strategy) else "distributed" if is_fsdp(strategy) else "file"
    kind = _checkpoint_kind(path)
    if kind is None:
        raise ConfigError(f"ckpt_path={path}: a directory that holds no checkpoint; pass {RESUMES_FROM[wanted]} from "
                          "an earlier run's checkpoints/")
    if kind != wanted:
        raise ConfigError(f"ckpt_path={path} is {RESUMES_FROM[kind]}, but this run's strategy resumes from "
                          f"{RESUMES_FROM[wanted]}: resume with the strategy that wrote it")
    try:
        checkpoint = _checkpoint_state(path, kind)
    except Exception as e:        # a zip that is not torch's, a text file, a truncated file: all unreadable the same
        raise ConfigError(f"ckpt_path={path}: not a readable checkpoint ({type(e).__name__}); pass one from an "
                          "earlier run's checkpoints/") from None
    method = get_class(cfg.method._target_)
    saved = checkpoint.get("method")      # the checkpointed method's class and the method classes it extends
    if saved and method.__name__ not in saved:
        raise ConfigError(f"ckpt_path={path}: a checkpoint of {saved[0]}, but this run trains {method.__name__}; "
                          "resume with the method it was trained with, or start without ckpt_path")
    step, max_steps = checkpoint.get("global_step", 0), cfg.trainer.get("max_steps", -1)
    if max_steps is not None and 0 <= max_steps <= step:
        raise ConfigError(f"ckpt_path={path}: already at step {step}, and trainer.max_steps={max_steps}; raise "
                          "trainer.max_steps to train further")
    world, devices = checkpoint.get("dp_world_size"), cfg.trainer.get("devices")
    if world is not None and isinstance(devices, int) and world != devices * cfg.trainer.get("num_nodes", 1):
        raise ConfigError(f"ckpt_path={path}: written by {world} processes, and DeepSpeed ZeRO partitions the "
                          f"optimizer states by process: resume with trainer.devices={world} (zero_to_fp32.py in that "
                          "directory gathers the weights alone)")
    return checkpoint


def check_checkpoint_model(path: Path, checkpoint: dict, model_spec) -> None:
    """The checkpoint was trained on a model of this run's sizes, and a frozen-base one on these very weights
    (checked once the model's stage is built)."""
    identity = checkpoint.get("base_identity")
    if identity is not None and identity != model_spec.identity():
        raise ConfigError(f"ckpt_path={path}: trained against another frozen base than {model_spec.name_or_path} "
                          "(its config or weight files differ; the checkpoint holds the trained part only): resume "
                          "with the model it was trained with")
    saved, wanted = checkpoint.get("model_shape"), model_shape(model_spec.load_config())
    differ = {k: (saved[k], wanted.get(k)) for k in (saved or {}) if saved[k] != wanted.get(k)}
    if differ:
        sizes = ", ".join(f"{k} {a} vs {b}" for k, (a, b) in differ.items())
        raise ConfigError(f"ckpt_path={path}: a checkpoint of a model of other sizes than {model_spec.name_or_path} "
                          f"({sizes}); resume with the model it was trained on")


MATMUL_PRECISIONS = ("highest", "high", "medium")   # torch.set_float32_matmul_precision's

# trainer settings that are counts: (minimum, may be null); Lightning's own -1 means "no limit" where it has one
TRAINER_COUNTS = {"max_steps": (-1, False), "max_epochs": (-1, True), "num_nodes": (1, False),
                  "accumulate_grad_batches": (1, False), "log_every_n_steps": (1, False),
                  "check_val_every_n_epoch": (1, True), "num_sanity_val_steps": (-1, False)}
# counts of batches, or (a float) a share of them
TRAINER_SHARES = ("val_check_interval", "limit_train_batches", "limit_val_batches")


def check_trainer(trainer: DictConfig) -> None:
    """The trainer's numbers, before any work (Lightning would fail on them mid-setup, or deep in a loop)."""
    for key, (minimum, optional) in TRAINER_COUNTS.items():
        if key in trainer:
            check_count(f"trainer.{key}", trainer[key], minimum, optional)
    for key in TRAINER_SHARES:
        value = trainer.get(key)
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            continue
        if not (isinstance(value, float) and 0.0 <= value <= 1.0):
            raise ConfigError(f"trainer.{key}={value!r}: a number of batches (an integer >= 0) or a share of them "
                              "(a float in [0, 1]), or null")
    devices = trainer.get("devices")
    if not (isinstance(devices, ListConfig) or (isinstance(devices, str) and re.fullmatch(r"auto|[\d,\s]+", devices))
            or (isinstance(devices, int) and not isinstance(devices, bool) and (devices >= 1 or devices == -1))):
        raise ConfigError(f"trainer.devices={devices!r}: a number of devices >= 1, -1 (all), auto or a list of ids")
    precisions = [v for group in get_args(_PRECISION_INPUT) for v in get_args(group)]
    if "precision" in trainer and trainer.precision not in precisions:
        raise ConfigError(f"trainer.precision={trainer.precision!r}: choose one of {precisions}")
    clip = trainer.get("gradient_clip_val")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
        raise ConfigError(f"trainer.gradient_clip_val={clip!r}: a norm >= 0, or null for no clipping")


def check_method_data(cfg: DictConfig) -> None:
    """The method reads the batches that the data config builds (e.g. method=cllm needs data=trajectories)."""
    method, data = get_class(cfg.method._target_), get_class(cfg.data._target_)
    wanted = getattr(method, "datamodule_class", None)
    if wanted is not None and not issubclass(data, wanted):
        raise ConfigError(f"method {method.__name__} trains on {wanted.__name__} batches, but the data config builds "
                          f"a {data.__name__}: use {method.data_configs}")
    if cfg.method.get("n_tokens") is not None:   # checked here, not as the collect.n_tokens it is passed on as
        check_count("method.n_tokens", cfg.method.n_tokens)
    if cfg.method.get("lora"):
        if issubclass(method, FrozenBaseModule):
            raise ConfigError(f"method.lora: {method.__name__} already trains a small part beside a frozen model; "
                              "adapters are for a full fine-tune (method=ar, cllm, jacobi_forcing): drop method.lora")
        lora_config(OmegaConf.to_container(cfg.method.lora))


def check_block_size(method: DictConfig, datamodule) -> None:
    """The method's block size is the one its trajectories were collected with."""
    check = getattr(datamodule, "check_block_size", None)
    if check is not None and method.get("n_tokens") is not None:
        check(method.n_tokens)
