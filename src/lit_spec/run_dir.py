"""A run directory holds one run. ``RunDirectory`` (a Hydra callback, conf/hydra/default.yaml) checks it before Hydra
writes anything there and holds a lock on it while the run lasts; ``check_run_dir`` is the same check for runs started
from Python (stages, tests).

A directory that already holds a run is refused, not reused: two runs in one directory mix their logs, metrics and
checkpoints, and the resume hint would name the wrong one. A run may continue in its own directory by resuming from
a ``ckpt_path`` inside it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lit_spec.errors import ConfigError, one_line_errors
from lit_spec.io import check_writable, launch_rank, one_writer

RUN_FILES = ("config.yaml", "metrics.json", "checkpoints", "csv", "bench.json")   # what a run of ours writes
LOCK = ".run.lock"


def _inside(path, directory: Path) -> bool:
    return bool(path) and directory.resolve() in Path(path).resolve().parents


def check_run_dir(directory: str | Path, ckpt_path: str | None = None, what: str = "hydra.run.dir",
                  markers: tuple[str, ...] = RUN_FILES) -> None:
    """``directory`` holds no earlier run, unless this run resumes from a checkpoint inside it."""
    directory = Path(directory)
    held = sorted(name for name in markers if (directory / name).exists())
    if held and not _inside(ckpt_path, directory):
        raise ConfigError(
            f"{what}={directory} already holds a run ({', '.join(held)}): a new run needs a new directory (leave "
            f"{what} unset: each run gets its own); to continue that run, resume from its checkpoint, e.g. "
            f"ckpt_path={directory / 'checkpoints' / 'last.ckpt'}")


class RunDirectory(Callback):
    """Refuse a run directory that cannot be written or holds an earlier run, and lock it for this run, before Hydra
    creates it, logs there or saves ``.hydra/``. Multirun: the sweep directory. Rank 0 only: the other processes of a
    launch share rank 0's directory."""

    def __init__(self) -> None:
        self._held = contextlib.ExitStack()

    def _claim(self, config: DictConfig, key: str, markers: tuple[str, ...]) -> None:
        if launch_rank() != 0:
            return
        HydraConfig.instance().set_config(config)    # resolves ${hydra:...} as run_job will (${now:} is cached)
        directory = Path(str(config.hydra[key].dir))
        with one_line_errors():
            check_writable(directory, f"hydra.{key}.dir")
            self._held.enter_context(one_writer(
                directory / LOCK, f"hydra.{key}.dir={directory}",
                advice="a run directory holds one run: leave hydra.run.dir unset, or wait for that run to end"))
            check_run_dir(directory, config.get("ckpt_path"), f"hydra.{key}.dir", markers)

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        # torchrun / srun start every rank at once: another node's rank may have written .hydra/ already
        siblings = int(os.environ.get("WORLD_SIZE", 1)) > 1
        self._claim(config, "run", RUN_FILES if siblings else (".hydra", *RUN_FILES))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._claim(config, "sweep", ("multirun.yaml",))

    def on_run_end(self, config: DictConfig, **kwargs) -> None:
        self._held.close()

    on_multirun_end = on_run_end
