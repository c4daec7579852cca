"""The frozen base's last hidden states and greedy next tokens of every self-distilled training answer, computed
once (the "offline" mode of EAGLE and SpecForge): the ``base_states`` stage of ``lit_spec.stages``. Draft heads
(Chimera, Medusa) train on the frozen base's last states, which do not change; with them cached a step runs the
heads only, not the base's forward over prompt + answer.

``data.base_states`` (``BaseStates``) is off unless ``enabled``; the stage then writes ``<cache_dir>/base_states-<key>``
(keyed by the model, the answers collection and how answers are cut) and fills in ``path``. Each record is run
through the base alone (a batch of one: no padding), in fp32 or the model's dtype, and its states are stored in
``dtype`` (bf16 by default: half the disk and memory). ``SelfDistilledDataModule`` then adds ``base_hidden``
[B, T, d] and ``base_next`` [B, T] (padded like ``input_ids``) to its batches, checked against the record's tokens;
``methods/draft_heads.py`` reads them instead of running the base. ``layers`` stores the states of several
``hidden_states`` indices side by side instead ([B, T, d · layers]): EAGLE-3 reads its three feature layers and the
last one, whose LM head gives the teacher's distribution (``methods/eagle3.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from lit_spec.errors import ConfigError, DataError
from lit_spec.io import atomic_dir
from lit_spec.models.spec import DTYPES

log = logging.getLogger(__name__)

FILE = "base_states.safetensors"


@dataclass
class BaseStates:
    """Where the cached states are (``path``, filled in by the stage) and what they are of.

    Args:
        enabled: cache them (false: heads methods run the base every step).
        path: the stage's directory.
        model: the frozen base's spec (the run's ``model``).
        answers: the answers collection (the run's ``data.path``).
        max_answer_tokens, max_train_records: as the datamodule cuts the records.
        dtype: what the states are stored in.
        layers: the ``hidden_states`` indices stored, concatenated (null: the last layer, what draft heads read).
        cache_dir: where the stage is cached.
    """

    enabled: bool = False
    path: str | None = None
    model: object = None
    answers: str | None = None
    max_answer_tokens: int | None = None
    max_train_records: int | None = None
    dtype: str = "bfloat16"
    layers: list[int] | None = None
    cache_dir: str | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES or DTYPES[self.dtype] == "auto":
            raise ConfigError(f"data.base_states.dtype={self.dtype!r}: choose float32 or bfloat16")
        if self.layers is not None:
            self.layers = [int(t) for t in self.layers]
            if not self.layers or min(self.layers) < 0:
                raise ConfigError(f"data.base_states.layers={self.layers}: give hidden_states indices >= 0, or null "
                                  "(the last layer)")

    def load(self) -> dict[str, torch.Tensor]:
        """``ids``, ``hidden``, ``next`` (every record's tokens concatenated) and ``offsets`` [records + 1]."""
        if self.path is None:
            raise ConfigError("data.base_states.path is null: the base_states stage fills it in "
                              "(lit_spec.stages.ensure_stages(cfg)) before the datamodule is built")
        file = Path(self.path) / FILE
        if not file.is_file():
            raise DataError(f"{file}: no cached base states; delete {self.path} and rerun to build them again")
        return load_file(str(file))


@torch.no_grad()
def build_base_states(spec, records: list[dict], dtype: str, out: Path, layers: list[int] | None = None) -> None:
    """Run every record (``prompt_ids`` + ``answer_ids``, in order) alone through the frozen base (``spec``); write
    its tokens, hidden states at ``layers`` (None: the last; in ``dtype``) and greedy next tokens into ``out/FILE``,
    atomically."""
    model = spec.load_model().eval()
    store, layers = DTYPES[dtype], layers or [-1]
    if max(layers) > model.config.num_hidden_layers:
        raise ConfigError(f"data.base_states.layers={layers}: the model has {model.config.num_hidden_layers} "
                          f"layers, so hidden_states indices run 0..{model.config.num_hidden_layers}")
    tokens = sum(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in records)
    width = model.config.hidden_size * len(layers)
    log.info("base_states: %d records, %d tokens x %d -> %.0f MB in %s (in memory while training, and on disk)",
             len(records), tokens, width, tokens * width * store.itemsize / 2**20, dtype)
    ids, hidden, following, offsets = [], [], [], [0]
    for record in tqdm(records, desc="base states", unit="answer"):
        seq = torch.tensor([record["prompt_ids"] + record["answer_ids"]], device=model.device)
        result = model(input_ids=seq, output_hidden_states=True)
        ids.append(seq[0].cpu())
        hidden.append(torch.cat([result.hidden_states[t][0] for t in layers], dim=-1).to(store).cpu())
        following.append(result.logits[0].argmax(-1).cpu())
        offsets.append(offsets[-1] + seq.size(1))
    with atomic_dir(out) as tmp:
        save_file({"ids": torch.cat(ids), "hidden": torch.cat(hidden), "next": torch.cat(following),
                   "offsets": torch.tensor(offsets)}, str(tmp / FILE))


def cached_batch(states: dict[str, torch.Tensor], records: list[dict], width: int, path: str) -> dict:
    """``base_hidden`` [B, width, d] and ``base_next`` [B, width] of a right-padded batch of ``records`` (each with
    its ``row`` in the cache), checked against the records' tokens."""
    hidden = states["hidden"].new_zeros(len(records), width, states["hidden"].size(-1))
    following = torch.zeros(len(records), width, dtype=torch.long)
    for i, record in enumerate(records):
        start, end = states["offsets"][record["row"]].item(), states["offsets"][record["row"] + 1].item()
        if states["ids"][start:end].tolist() != record["prompt_ids"] + record["answer_ids"]:
            raise DataError(f"{path}: the cached base states of row {record['row']} are of other tokens than its "
                            "answer; delete that directory and rerun to build them again")
        hidden[i, : end - start] = states["hidden"][start:end]
        following[i, : end - start] = states["next"][start:end]
    return {"base_hidden": hidden, "base_next": following}
