"""The collection's progress bar shows the decoding rate."""

from __future__ import annotations

import time

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar


class TokensPerSecond(L.Callback):
    """``tok/s`` (answer tokens this process decoded per second) on the predict progress bar."""

    def on_predict_start(self, trainer, module) -> None:
        self.tokens, self.start = 0, time.perf_counter()

    def on_predict_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.tokens += outputs["tokens"]
        rate = f"{self.tokens / (time.perf_counter() - self.start):.0f}"
        bar = trainer.progress_bar_callback
        if isinstance(bar, TQDMProgressBar):
            bar.predict_progress_bar.set_postfix({"tok/s": rate})
        elif isinstance(bar, RichProgressBar) and bar.progress is not None and bar.predict_progress_bar_id is not None:
            # rich shows metrics during fit only: the rate goes into the bar's description
            bar.progress.update(bar.predict_progress_bar_id, description=f"{bar.predict_description} {rate} tok/s")
