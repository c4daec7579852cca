"""Trained draft heads on disk: ``heads.safetensors`` + ``heads.json`` (kind, config, the base model's spec), for
every kind of heads on a frozen base (Medusa, Chimera, Hidden Transfer's maps, the EAGLE-3 and DFlash drafts). The registry of kinds lives here,
where all of them are imported."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from lit_spec.errors import ConfigError
from lit_spec.io import atomic_dir, write_json
from lit_spec.models.chimera import ChimeraDraft
from lit_spec.models.dflash import DFlashDraft
from lit_spec.models.draft_heads import DraftHeads, MedusaHeads
from lit_spec.models.eagle3 import Eagle3Draft
from lit_spec.models.hidden_transfer import HiddenTransfer

WEIGHTS, CONFIG = "heads.safetensors", "heads.json"
KINDS: dict[str, type[DraftHeads]] = {cls.kind: cls for cls in (MedusaHeads, ChimeraDraft, HiddenTransfer,
                                                                 Eagle3Draft, DFlashDraft)}


def save_heads(heads: DraftHeads, directory: str | Path, base_model: dict, state: dict | None = None) -> Path:
    """Write the heads' parameters (``state`` if given: e.g. gathered from shards; else their own) as safetensors,
    and ``heads.json`` (kind, config, the base model's spec), into ``directory``, atomically."""
    directory = Path(directory)
    with atomic_dir(directory) as tmp:
        state = {k: v.detach().contiguous().cpu() for k, v in (state or heads.state_dict()).items()}
        save_file(state, str(tmp / WEIGHTS))
        write_json(tmp / CONFIG, {"kind": heads.kind, "config": heads.config, "base_model": base_model})
    return directory


def load_heads(directory: str | Path) -> tuple[DraftHeads, dict]:
    """(heads, base model spec dict) from ``save_heads``' directory; put the heads on the base's device."""
    directory = Path(directory)
    if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
        raise ConfigError(f"{directory}: no draft heads there (expected {CONFIG} and {WEIGHTS}, written by a "
                          "method=chimera, medusa, hidden_transfer or eagle3 run's export_dir)")
    meta = json.loads((directory / CONFIG).read_text())
    if meta.get("kind") not in KINDS:
        raise ConfigError(f"{directory / CONFIG}: unknown heads kind {meta.get('kind')!r} (have {sorted(KINDS)})")
    heads = KINDS[meta["kind"]](**meta["config"])
    state = load_file(str(directory / WEIGHTS))
    if heads.counts_labels:
        state.setdefault("token_counts", heads.token_counts)   # heads saved before training counted their labels
    heads.load_state_dict(state)
    return heads.eval(), meta["base_model"]
