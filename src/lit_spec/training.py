"""The training pipeline behind ``python -m lit_spec.train``: check, ensure the stages, build everything from config,
fit, export."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lit_spec.callbacks import SpeedupCallback
from lit_spec.rank_watch import RankWatch, after_a_lost_peer, is_lost_peer
from lit_spec.checkpoints import AtomicCheckpointIO, resume_hint
from lit_spec.checks import check_block_size, check_checkpoint_model, check_run
from lit_spec.config import build
from lit_spec.console import training_summary, verdict
from lit_spec.errors import DiskFull, Interrupted, LitSpecError, LostRank, is_disk_full, signal_of
from lit_spec.export import export_pretrained
from lit_spec.io import write_json
from lit_spec.loggers import finish_wandb
from lit_spec.precision import check_policy, precision_policy
from lit_spec.stages import ensure_stages

log = logging.getLogger(__name__)


class _FinishRun(L.Callback):
    """Final metrics, export and ``metrics.json``, done at the end of training in the processes that trained.

    At ``on_train_end``, while the strategy still holds the model: Lightning tears the strategy down before
    ``on_fit_end``, and a strategy's teardown moves the module and its optimizer to the CPU (DeepSpeed's too), where
    the export's collectives (gathers, fp32 masters) cannot reach it on GPUs. With ``strategy=ddp_spawn`` the
    processes that trained are spawned workers: the launching process gets back neither the model (it never built
    one) nor the step count, so nothing there could be exported.
    """

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.metrics: dict[str, float] | None = None
        self.started = time.monotonic()

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        metrics["global_step"] = trainer.global_step
        if self.cfg.get("export_dir"):
            export_pretrained(trainer, module, self.cfg.export_dir, self.cfg.get("export_dtype", "auto"))
        speedup = next((c for c in trainer.callbacks if isinstance(c, SpeedupCallback)), None)
        prompts = len(speedup.records or []) if speedup else 0
        said = verdict(speedup.history[-1][1], prompts) if speedup and speedup.history else None
        if said:                  # the trade in words, in metrics.json too
            metrics["verdict"] = said
        if trainer.is_global_zero:
            write_json(Path(self.cfg.paths.output_dir) / "metrics.json", metrics)
            log.info("\n%s", training_summary(self.cfg, metrics, speedup.history if speedup else [], prompts,
                                               time.monotonic() - self.started))
        self.metrics = metrics


def _instantiate_group(group: DictConfig | None) -> list:
    """Build every entry of a ``{name: {_target_: ...}}`` group (callbacks, loggers); null entries are skipped."""
    return [instantiate(c) for c in (group or {}).values() if c is not None and "_target_" in c]


def _stopped(error: BaseException, trainer: L.Trainer, hint: str) -> LitSpecError | None:
    """What a fit that stopped before its end says, in one line with where to resume; None: not ours to explain."""
    step = trainer.global_step
    if isinstance(error, SystemExit):      # SIGTERM / Ctrl-C: InterruptCheckpoint has saved where training stood
        return Interrupted(f"training stopped at step {step}, before its end (no export, no metrics.json); {hint}",
                           signal_of(error))
    if is_disk_full(error):
        return DiskFull(f"{DiskFull.of(error).where} at step {step}", then=f"free space there, then {hint}")
    if isinstance(error, RuntimeError) and trainer.world_size > 1 and is_lost_peer(error):
        after_a_lost_peer()               # RankWatch may name the dead rank (and end this process) first
        return LostRank(f"a peer rank is gone ({str(error).strip().splitlines()[0][:160]}) at step {step}, so the "
                        f"run stopped: {hint}")
    return None


def run_training(cfg: DictConfig) -> dict[str, float]:
    """Fit ``cfg.method`` on ``cfg.data`` with ``cfg.trainer``; export to ``cfg.export_dir``; return final metrics."""
    checkpoint = check_run(cfg)   # everything the config alone can get wrong, in one line, before any work
    torch.set_float32_matmul_precision(cfg.get("float32_matmul_precision", "highest"))
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    ckpt_path = cfg.get("ckpt_path")

    ensure_stages(cfg)  # earlier stages (tiny model, tiny target, trajectories): cached, or built now
    model_spec = build(cfg.model)
    model_spec.validate()
    if checkpoint is not None:
        check_checkpoint_model(Path(ckpt_path), checkpoint, model_spec)
    tokenizer = model_spec.load_tokenizer()
    datamodule = build(cfg.data, tokenizer=tokenizer)
    datamodule.setup("fit")  # bad data fails here, before any training
    check_block_size(cfg.method, datamodule)
    module = build(cfg.method, model_spec=model_spec)

    finish, checkpoints = _FinishRun(cfg), Path(cfg.paths.output_dir) / "checkpoints"
    trainer: L.Trainer = instantiate(cfg.trainer, _partial_=True)(
        callbacks=[*_instantiate_group(cfg.get("callbacks")), finish],
        logger=_instantiate_group(cfg.get("logger")) or False, plugins=[AtomicCheckpointIO()])
    policy = precision_policy(trainer.strategy, trainer.precision)
    check_policy(policy, type(trainer.strategy).__name__, trainer.precision)
    if trainer.is_global_zero:
        log.info("model %s | data %s | output %s", model_spec.name_or_path, datamodule.source.describe(),
                 cfg.paths.output_dir)
        log.info("precision %s under %s: %s", trainer.precision, type(trainer.strategy).__name__, policy.describe())
        Path(cfg.paths.output_dir).mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, Path(cfg.paths.output_dir) / "config.yaml", resolve=True)
    try:
        with RankWatch(trainer, checkpoints):   # a rank that dies, from its start on, ends the run in one line
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        if finish.metrics is None:  # ddp_spawn: the run finished in worker processes, whose rank 0 wrote these
            return json.loads((Path(cfg.paths.output_dir) / "metrics.json").read_text())
        return finish.metrics
    except (SystemExit, Exception) as error:
        stop = _stopped(error, trainer, resume_hint(checkpoints))
        if stop is None:
            raise
        raise stop from None
    finally:
        finish_wandb()
