"""A test-only callback the sharded-training tests add to their runs (``+callbacks.base_unchanged=...``): it checks,
inside the training processes, what only they can see."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch

from lit_spec.strategies import whole_parameters


class FrozenBaseUnchanged(L.Callback):
    """At fit end every rank compares its frozen base (made whole first: ZeRO-3 partitions it) with the weights it
    was loaded from, bit for bit, and writes ``base_unchanged.rank<r>.json`` into the run directory."""

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with whole_parameters(pl_module.model):
            live = {k: v.detach().cpu().clone() for k, v in pl_module.model.state_dict().items()}
        original = pl_module.model_spec.load_model().state_dict()
        equal = live.keys() == original.keys() and all(torch.equal(live[k], original[k]) for k in original)
        result = {"tensors": len(original), "equal": equal}
        Path(trainer.default_root_dir, f"base_unchanged.rank{trainer.global_rank}.json").write_text(json.dumps(result))
