"""The Jacobi trajectory store: what ``python -m lit_spec.collect`` writes and ``method=cllm`` trains on.

On disk (format ``lit_spec.trajectories``, version 1), a directory::

    meta.json                  format, version, the collection settings, "complete", totals and, once complete,
                               every part's sha256 (``check_parts``: what each reader verifies)
    parts/<split>-<batch>.jsonl  one file per collected batch of prompts, one JSON record per line
    .lock                      held by the one process collecting into the directory

Each part is written atomically (temporary file + rename) once its whole batch is decoded, so a killed collection
leaves only complete parts; rerunning skips the batches whose part exists. A record::

    {"id": "train/000042",           # split / index of the prompt in that split
     "split": "train",
     "prompt_ids": [...],            # the prompt's token ids
     "answer_ids": [...],            # the target's complete greedy answer = the blocks' fixed points concatenated
     "reference_ids": [...],         # the dataset's own answer (for an AR loss on ground truth)
     "blocks": [{"states": [[...], ...],      # Jacobi trajectory: initial guess ... fixed point (CLLM Alg. 1)
                 "augmented": [[...], ...]}], # extra states: false tokens corrected at random (§3.2.1)
                                     # [] in an answers-only collection (collect.decoder=ar)
     "keep": true,                   # false: dropped by post-processing (repetition), kept for the record
     "drop_reason": null}            # why it was dropped

Consecutive states of a block differ; a block's states all have its fixed point's length (the last block of an
answer cut by EOS or ``max_new_tokens`` is shorter than n).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from lit_spec.errors import ConfigError, DataError
from lit_spec.io import file_sha256, set_aside, write_json, write_text

log = logging.getLogger(__name__)

FORMAT, VERSION = "lit_spec.trajectories", 1
VAL_FRACTION = 0.05  # held out from train when the collection has no validation split
META = "meta.json"
LOCK = ".lock"               # held by the collector writing the directory (lit_spec.io.one_writer)
PARTS = "parts"


# ---- writing ------------------------------------------------------------------------------------------------------
def part_path(directory: str | Path, split: str, batch: int) -> Path:
    return Path(directory) / PARTS / f"{split}-{batch:06d}.jsonl"


def write_part(directory: str | Path, split: str, batch: int, records: list[dict]) -> None:
    """All records of one collected batch, in one atomic write."""
    write_text(part_path(directory, split, batch), "".join(json.dumps(r, separators=(",", ":")) + "\n"
                                                        for r in records))


def done_batches(directory: str | Path, split: str) -> set[int]:
    """Batches of ``split`` whose part is on disk (complete: parts are renamed into place only when written)."""
    parts = Path(directory) / PARTS
    return {int(p.stem.rsplit("-", 1)[1]) for p in parts.glob(f"{split}-*.jsonl")} if parts.is_dir() else set()


def write_meta(directory: str | Path, config: dict, complete: bool, stats: dict | None = None,
               parts: dict[str, str] | None = None) -> None:
    """``parts``: every part's sha256 by file name, written when the collection completes (``check_parts``)."""
    meta = {"format": FORMAT, "version": VERSION, "config": config, "complete": complete, "stats": stats or {}}
    write_json(Path(directory) / META, meta | ({"parts": parts} if parts is not None else {}))


def part_checksums(directory: str | Path) -> dict[str, str]:
    parts = Path(directory) / PARTS
    return {p.name: file_sha256(p) for p in sorted(parts.glob("*.jsonl"))} if parts.is_dir() else {}


def check_parts(directory: str | Path, meta: dict) -> list[str]:
    """The parts of a complete collection that are missing, changed or unexpected against meta.json's checksums
    (a collection from before checksums: only whether parts are missing). Any found are set aside (renamed
    ``*.damaged``) and the collection is marked not complete, so rerunning the collection redoes exactly those
    batches; returns their names (empty: intact)."""
    on_disk = part_checksums(directory)
    listed = meta.get("parts")
    if listed is not None:
        bad = sorted(name for name in listed.keys() | on_disk.keys() if listed.get(name) != on_disk.get(name))
    else:
        planned = meta["stats"].get("batches", len(on_disk))
        bad = [] if len(on_disk) == planned else [f"{planned - len(on_disk)} of {planned} parts"]
    if bad:
        for name in bad:
            path = Path(directory) / PARTS / name
            if path.is_file():
                set_aside(path)
        write_meta(directory, meta["config"], complete=False)
        log.warning("%s: parts missing or changed since the collection completed: %s; set aside and marked not "
                    "complete", directory, bad)
    return bad


@dataclass
class CollectionSource:
    """A collected directory as a datamodule's ``source``: what the training log names (``what`` and the path), and
    the path to read, which the ``trajectories`` / ``answers`` stage fills in when the config leaves it null."""

    path: str | None
    what: str

    def describe(self) -> str:
        return f"{self.what} {self.path}"

    def require_path(self) -> str:
        if self.path is None:
            raise ConfigError(f"data.path is null: the {self.what} of data.collect are a stage, collected (or found "
                              "cached) by lit_spec.stages.ensure_stages(cfg) before the datamodule is built")
        return self.path


# ---- reading ------------------------------------------------------------------------------------------------------
def read_meta(directory: str | Path) -> dict:
    path = Path(directory) / META
    if not path.is_file():
        raise DataError(f"{directory}: not a trajectory directory (no {META}); collect one with "
                        "`python -m lit_spec.collect`")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e}); delete the directory and collect again") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DataError(f"{path}: format {meta.get('format')!r} version {meta.get('version')!r}, expected "
                        f"{FORMAT!r} version {VERSION}; collect again with this version of lit_spec")
    return meta


def _ids(value, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in value):
        raise ValueError(f"{what} must be a list of token ids")
    return value


def check_record(record) -> dict:
    """Raise ValueError naming the first field that breaks the format; return the record."""
    if not isinstance(record, dict):
        raise ValueError("a record must be a JSON object")
    for key in ("id", "split", "prompt_ids", "answer_ids", "reference_ids", "blocks", "keep"):
        if key not in record:
            raise ValueError(f"missing field {key!r}")
    if not _ids(record["prompt_ids"], "prompt_ids"):
        raise ValueError("prompt_ids is empty")
    _ids(record["answer_ids"], "answer_ids")
    _ids(record["reference_ids"], "reference_ids")
    if not isinstance(record["blocks"], list):
        raise ValueError("blocks must be a list")
    answer: list[int] = []
    for b, block in enumerate(record["blocks"]):
        states = block.get("states") if isinstance(block, dict) else None
        if not isinstance(states, list) or not states:
            raise ValueError(f"blocks[{b}].states must be a non-empty list of states")
        augmented = block.get("augmented", [])
        if not isinstance(augmented, list):
            raise ValueError(f"blocks[{b}].augmented must be a list of states")
        fixed = _ids(states[-1], f"blocks[{b}].states[-1]")
        for s, state in enumerate(states + augmented):
            if len(_ids(state, f"blocks[{b}] state {s}")) != len(fixed):
                raise ValueError(f"blocks[{b}] state {s} has {len(state)} tokens, its fixed point {len(fixed)}")
        answer += fixed
    if record["blocks"] and answer != record["answer_ids"]:
        raise ValueError("answer_ids differ from the blocks' fixed points concatenated")
    return record


def read_records(directory: str | Path, split: str | None = None, include_dropped: bool = False,
                 require_complete: bool = True) -> list[dict]:
    """Every record of a collected directory (one split or all), in a fixed order (split, batch, line).

    A corrupt or truncated part raises ``DataError`` naming the file and line. ``require_complete=False`` reads an
    unfinished collection (the collector does, to check its parts before marking the directory complete).
    """
    meta = read_meta(directory)
    if require_complete and not meta.get("complete"):
        raise DataError(f"{directory}: the collection is not complete; rerun the same `python -m lit_spec.collect` "
                        "command to finish it (it resumes)")
    if require_complete and (bad := check_parts(directory, meta)):
        raise DataError(f"{directory}: {len(bad)} part(s) missing or changed since the collection completed "
                        f"({', '.join(bad[:5])}): set aside and marked not complete; rerun the same collection (the "
                        "`python -m lit_spec.collect` command, or the run whose stage collected it) to redo exactly "
                        "those batches")
    records = []
    for path in sorted((Path(directory) / PARTS).glob(f"{split or '*'}-*.jsonl")):
        text = path.read_text()
        if text and not text.endswith("\n"):
            raise DataError(f"{path}:{text.count(chr(10)) + 1}: truncated record (no end of line); delete this "
                            "file and rerun the collection to redo its batch")
        for line_no, line in enumerate(text.splitlines(), 1):
            try:
                record = check_record(json.loads(line))
            except (json.JSONDecodeError, ValueError) as e:
                raise DataError(f"{path}:{line_no}: bad trajectory record: {e}; delete this file and rerun the "
                                "collection to redo its batch") from None
            if record["keep"] or include_dropped:
                records.append(record)
    return records


def split_off_validation(directory: str | Path, train: list[dict]) -> tuple[list[dict], list[dict]]:
    """``train`` (the kept train records of ``directory``) and the validation records: the collection's validation
    split, or with none the last ``VAL_FRACTION`` of ``train`` held out (all of it when too few to hold out)."""
    val = read_records(directory, "validation")
    if val:
        return train, val
    n, k = len(train), max(1, math.ceil(VAL_FRACTION * len(train)))
    if n > k:
        log.info("%s: no validation split; holding out the last %d of its %d train records", directory, k, n)
        return train[:-k], train[-k:]
    log.info("%s: no validation split; validating on its %d train records (too few to hold out)", directory, n)
    return train, train


# ---- augmentation and post-processing ----------------------------------------------------------------------------
def augment_states(states: list[list[int]], copies: int, prob: float, generator: torch.Generator) -> list[list[int]]:
    """CLLM §3.2.1 data augmentation: for each intermediate state (not the fixed point), ``copies`` variants where
    every false token is corrected (set to the fixed point's token) with probability ``prob``. Variants equal to a
    state already in the trajectory or to the fixed point are skipped."""
    fixed = states[-1]
    seen = {tuple(s) for s in states}
    out = []
    for state in states[:-1]:
        wrong = [i for i, (a, b) in enumerate(zip(state, fixed)) if a != b]
        for _ in range(copies):
            flips = torch.rand(len(wrong), generator=generator).lt(prob).tolist()
            variant = list(state)
            for i, flip in zip(wrong, flips):
                if flip:
                    variant[i] = fixed[i]
            if tuple(variant) not in seen:
                seen.add(tuple(variant))
                out.append(variant)
    return out
