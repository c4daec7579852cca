"""A checkpoint saved when training stops early (Ctrl-C, SIGTERM, a crash), like Lightning's
``OnExceptionCheckpoint``, with two differences that keep what it leaves truthful:

- it is not an ``OnExceptionCheckpoint``: Lightning's ``fit(ckpt_path=None)`` turns into ``ckpt_path="last"`` when one
  is configured and resumes from any ``last.ckpt`` it finds, so a run would resume one nobody named;
- nothing is saved before the first optimizer step: a step-0 checkpoint (e.g. after a ``ckpt_path`` that failed to
  load) holds nothing to resume, only a misleading file;
- nothing is saved after a full disk or a lost peer rank, and a save that fails is logged, never raised over the
  exception that stopped training (the checkpoint is written whole or not at all: ``lit_spec.checkpoints``).
"""

from __future__ import annotations

import logging
import os

import lightning as L
from lightning.pytorch.callbacks import Checkpoint

from lit_spec.rank_watch import is_lost_peer
from lit_spec.errors import is_disk_full

log = logging.getLogger(__name__)


class InterruptCheckpoint(Checkpoint):
    def __init__(self, dirpath: str, filename: str = "interrupted"):
        super().__init__()
        self.dirpath, self.filename = dirpath, filename

    @property
    def ckpt_path(self) -> str:
        return os.path.join(self.dirpath, f"{self.filename}.ckpt")

    def on_exception(self, trainer: L.Trainer, module: L.LightningModule, exception: BaseException) -> None:
        if trainer.global_step == 0 or is_disk_full(exception) or is_lost_peer(exception):
            return                         # nothing to save yet, no room for it, or no peer to save it with
        try:
            trainer.save_checkpoint(self.ckpt_path)
        except Exception as e:            # never raised over the exception that stopped training
            log.warning("no %s: %s", self.ckpt_path, e)

    def teardown(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        """Called when a fit ends without an exception: no interrupted checkpoint is left behind (as Lightning's)."""
        trainer.strategy.remove_checkpoint(self.ckpt_path)
