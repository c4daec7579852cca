"""Logger factories that need a decision at run time."""

from __future__ import annotations

import os

from lightning.pytorch.loggers import WandbLogger


def wandb_logger(offline: bool | None = None, **kwargs) -> WandbLogger:
    """W&B logger that never prompts: online only when an API key is available, offline otherwise.

    ``offline=None`` decides from ``WANDB_API_KEY`` / ``WANDB_MODE``; runs written offline can be uploaded later with
    ``wandb sync <run dir>``. Model upload is off offline (W&B refuses it there).
    """
    if offline is None:
        offline = os.environ.get("WANDB_MODE") in {"offline", "disabled"} or not os.environ.get("WANDB_API_KEY")
    if offline:
        kwargs["log_model"] = False
    return WandbLogger(offline=offline, **kwargs)


def finish_wandb() -> None:
    """End the current W&B run so that the next multirun job starts its own."""
    import sys

    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()
