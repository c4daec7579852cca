"""Where prompt/answer records come from: the Hugging Face Hub, a local file, or the offline stdlib corpus.

Every source returns a ``datasets.DatasetDict`` with the splits ``train``, ``validation`` and ``test``. Splits a
dataset lacks are carved out of its train split with a fixed seed. An evaluation-only source
(``HFSource(eval_split=...)``: HumanEval, which has nothing but ``test``, or a benchmark that needs one split) keeps
that one split and leaves the others empty.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Callable, Mapping

import datasets
import pyarrow
import pyarrow.parquet

from lit_spec.errors import ConfigError, DataError
from lit_spec.data import stdlib_code
from lit_spec.packages import resolve

SPLITS = ("train", "validation", "test")
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def _format(path: Path) -> str | None:
    """The ``datasets`` loader of a local file (``.gz``-compressed json/jsonl/csv too), or None."""
    suffix = Path(path.stem).suffix if path.suffix == ".gz" else path.suffix
    return LOCAL_FORMATS.get(suffix)


def _complete_splits(dd: datasets.DatasetDict, val_fraction: float, test_fraction: float,
                     seed: int) -> datasets.DatasetDict:
    """Fill in missing validation/test splits from train, deterministically."""
    if "train" not in dd:
        raise DataError(f"dataset has no 'train' split (it has {sorted(dd)}); map one with data.source.splits, "
                        "or set data.source.eval_split=test (or validation) for evaluation-only data")
    out = dict(dd)
    for name, fraction in (("test", test_fraction), ("validation", val_fraction)):
        if name in out or fraction <= 0 or len(out["train"]) == 0:  # an empty dataset is reported by the caller
            continue
        if len(out["train"]) < 2:
            raise DataError(f"cannot carve a '{name}' split out of a train split of {len(out['train'])} record(s)")
        parts = out["train"].train_test_split(test_size=fraction, seed=seed, shuffle=True)
        out["train"], out[name] = parts["train"], parts["test"]
    for name in SPLITS:
        out.setdefault(name, out["train"].select([]))
    return datasets.DatasetDict({k: out[k] for k in SPLITS})


def _only_split(dd: datasets.DatasetDict, split: str) -> datasets.DatasetDict:
    """An evaluation-only dataset: ``split`` as it is, every other split empty, nothing carved out."""
    if split not in dd:
        raise DataError(f"dataset has no '{split}' split (it has {sorted(dd)}); set data.source.eval_split to a "
                        "validation or test split it has, or map one with data.source.splits")
    return datasets.DatasetDict({k: dd[split] if k == split else dd[split].select([]) for k in SPLITS})


def _has_no_records(path: Path) -> bool:
    """A blank file, an empty JSON list or a parquet table of 0 rows: ``datasets`` fails on them obscurely."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if len(head) < 4096 and b"".join(head.split()) in (b"", b"[]"):
        return True
    if path.suffix == ".parquet":
        try:
            return pyarrow.parquet.read_metadata(path).num_rows == 0
        except pyarrow.ArrowException:  # not parquet at all: loading it says so
            return False
    return False


class HFSource:
    """Records from a hub dataset id, or from a local ``.json/.jsonl/.parquet/.csv`` file when ``path`` is set.

    Args:
        hub_id: dataset id on the Hub (``openai/gsm8k``), used when ``path`` is not set.
        subset: the hub dataset's config name (``main`` for GSM8K), if it has several.
        path: a local file (``.gz`` too) or a directory of such files, or ``pkg://<package>/<file>`` (a file an
            installed package ships); takes precedence over ``hub_id``.
        splits: map of our split names to the dataset's own (e.g. ``{validation: dev}``).
        record_fn: optional importable function applied to every record (e.g. ShareGPT's first turn).
        val_fraction/test_fraction: share of train carved out for splits the dataset lacks.
        eval_split: evaluation only (``validation`` or ``test``): only this split is kept, nothing is carved out and
            train stays empty; a local file not named after a split becomes this split. For datasets without a train
            split (HumanEval) and for benchmarks, which then neither need nor tokenize the train split (4.5M pairs for
            WMT16 de-en). ``PromptDataModule`` refuses to train on such data.
    """

    def __init__(self, hub_id: str | None = None, subset: str | None = None, path: str | None = None,
                 splits: Mapping[str, str] | None = None, record_fn: Callable[[dict], dict | None] | None = None,
                 val_fraction: float = 0.05, test_fraction: float = 0.0, seed: int = 0,
                 data_files: Mapping[str, str] | None = None, eval_split: str | None = None):
        if not hub_id and not path:
            raise ConfigError("data.source needs a hub id (data.source.hub_id=...) or a local file (data.path=...)")
        if eval_split not in (None, "validation", "test"):
            raise ConfigError(f"data.source.eval_split={eval_split!r}: choose validation or test (or null to train)")
        self.hub_id, self.subset, self.path = hub_id, subset, path
        self.splits = dict(splits or {})
        self.record_fn = record_fn
        self.val_fraction, self.test_fraction, self.seed = val_fraction, test_fraction, seed
        self.data_files = dict(data_files) if data_files else None
        self.eval_split = eval_split

    def describe(self) -> str:
        return f"local file {self.path}" if self.path else f"hub dataset {self.hub_id}"

    def _load_local(self) -> datasets.DatasetDict:
        path = Path(os.path.expanduser(resolve(self.path)))
        if not path.exists():
            raise DataError(f"data.path={self.path}: no such file or directory")
        files = sorted(p for p in path.rglob("*") if _format(p)) if path.is_dir() else [path]
        if not files:
            raise DataError(f"data.path={self.path}: no .json/.jsonl/.parquet/.csv files in it")
        kinds = {_format(p) for p in files}
        if None in kinds or len(kinds) != 1:
            raise DataError(f"data.path={self.path}: expected one of {sorted(LOCAL_FORMATS)} "
                            f"(all files of one kind), got {sorted({p.suffix for p in files})}")
        empty = [str(p) for p in files if _has_no_records(p)]
        if empty:
            raise DataError(f"data.path={self.path}: empty dataset, no records in {', '.join(empty)}")
        # files named after a split (train.jsonl, test.parquet) become that split; others the train split, or the
        # evaluation split of an evaluation-only source (under the dataset's own name for it: data.source.splits)
        other = self.splits.get(self.eval_split, self.eval_split) if self.eval_split else "train"
        by_split: dict[str, list[str]] = {}
        for p in files:
            split = next((s for s in (*SPLITS, "dev", "val") if p.stem.lower().startswith(s)), other)
            split = {"dev": "validation", "val": "validation"}.get(split, split)
            by_split.setdefault(split, []).append(str(p))
        try:
            return datasets.load_dataset(kinds.pop(), data_files=by_split)
        except Exception as e:  # malformed JSON/parquet
            if isinstance(e, ValueError) and "corresponds to no data" in str(e):  # e.g. a CSV of only a header
                raise DataError(f"data.path={self.path}: empty dataset, a split has no records ({e})") from e
            cause = e.__cause__ or e  # DatasetGenerationError's own message says nothing about the file
            raise DataError(f"data.path={self.path}: could not be read ({type(cause).__name__}: {cause})") from e

    def _load_hub(self) -> datasets.DatasetDict:
        try:
            return datasets.load_dataset(self.hub_id, self.subset, data_files=self.data_files)
        except Exception as e:  # ConnectionError, FileNotFoundError, DatasetNotFoundError, ...
            raise DataError(
                f"hub dataset '{self.hub_id}' could not be loaded ({type(e).__name__}). Without network access, "
                f"download it elsewhere and point data.path at a local .json/.jsonl/.parquet copy."
            ) from e

    def load(self) -> datasets.DatasetDict:
        dd = self._load_local() if self.path else self._load_hub()
        if not isinstance(dd, datasets.DatasetDict):
            dd = datasets.DatasetDict({"train": dd})
        # the dataset's own split names mapped to ours; a split already under our name (a local file train.json of a
        # hub dataset whose own is train_sft) is kept
        mapped = {ours: dd[theirs] for ours, theirs in self.splits.items() if theirs in dd}
        dd = datasets.DatasetDict(mapped | {k: v for k, v in dd.items() if k in SPLITS and k not in mapped})
        if self.eval_split:  # before record_fn: the splits left out are never processed
            dd = _only_split(dd, self.eval_split)
        if self.record_fn is not None:
            dd = dd.map(partial(_records_of, self.record_fn), batched=True,
                        remove_columns=next(iter(dd.values())).column_names)
        if self.eval_split:
            return dd
        return _complete_splits(dd, self.val_fraction, self.test_fraction, self.seed)


def _records_of(fn: Callable[[dict], dict | list[dict] | None], batch: dict) -> dict:
    """A batch of records through ``record_fn``, which gives a record's new fields (None: drop it; a list: one record
    each, e.g. a conversation's turns), beside its own."""
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    out = []
    for row in rows:
        made = fn(row)
        out += [row | r for r in ([] if made is None else [made] if isinstance(made, dict) else made)]
    return {k: [r[k] for r in out] for k in (out[0] if out else batch)}


class MixedSource:
    """Several sources' records as one dataset, split by split, in the order given (EAGLE-3 trains on ShareGPT and
    UltraChat together): ``sources`` maps a name to each source; each split keeps the columns every source has
    (``prompt`` and ``answer`` after their ``record_fn``). A local file replaces one source's hub dataset:
    ``data.source.sources.<name>.path=...``."""

    def __init__(self, sources: Mapping[str, object]):
        if not sources:
            raise ConfigError("data.source.sources is empty: name the sources to mix")
        self.sources = dict(sources)

    def describe(self) -> str:
        return " + ".join(f"{name}: {source.describe()}" for name, source in self.sources.items())

    def load(self) -> datasets.DatasetDict:
        loaded = [source.load() for source in self.sources.values()]
        out = {}
        for split in SPLITS:
            parts = [dd[split] for dd in loaded if split in dd]
            common = sorted(set.intersection(*(set(part.column_names) for part in parts)))
            out[split] = datasets.concatenate_datasets([part.select_columns(common) for part in parts])
        return datasets.DatasetDict(out)


class StdlibCodeSource:
    """The offline docstring -> function corpus (see ``stdlib_code``). Needs no network, exists everywhere."""

    def __init__(self, seed: int = 0, val_fraction: float = 0.05, test_fraction: float = 0.05,
                 root: str | None = None, **filters):
        self.seed, self.val_fraction, self.test_fraction, self.root, self.filters = (
            seed, val_fraction, test_fraction, root, filters)

    def describe(self) -> str:
        return f"stdlib-code ({self.root or stdlib_code.stdlib_dir()})"

    def load(self) -> datasets.DatasetDict:
        """Parsing the whole standard library takes seconds; ``datasets`` caches the pairs (keyed by the settings and
        the files' ``fingerprint``), so a run, and each rank of one, reads them back instead."""
        pairs = datasets.Dataset.from_generator(_stdlib_pairs, gen_kwargs={
            "root": self.root, "seed": self.seed, "val_fraction": self.val_fraction,
            "test_fraction": self.test_fraction, "filters": self.filters,
            "fingerprint": stdlib_code.fingerprint(self.root)})
        return datasets.DatasetDict({split: pairs.filter(lambda row, s=split: row["split"] == s) for split in SPLITS})


def _stdlib_pairs(root, seed, val_fraction, test_fraction, filters, fingerprint):
    """``stdlib_code.iter_pairs`` for ``datasets``' generator cache (``fingerprint`` is only part of its key)."""
    yield from stdlib_code.iter_pairs(root, seed, val_fraction, test_fraction, **filters)


SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def sharegpt_first_turn(record: dict) -> dict | None:
    """ShareGPT: the first human turn is the prompt, the assistant's reply the answer (CLLM's MT-bench setup)."""
    turns = record.get("conversations") or []
    if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
        return None
    return {"prompt": turns[0]["value"], "answer": turns[1]["value"]}


def chat_first_turn(record: dict) -> dict | None:
    """UltraChat (``messages``: role/content turns): the first user turn is the prompt, the reply the answer."""
    turns = record.get("messages") or []
    if len(turns) < 2 or turns[0].get("role") != "user" or turns[1].get("role") != "assistant":
        return None
    return {"prompt": turns[0]["content"], "answer": turns[1]["content"]}


def every_turn(messages: list[dict]) -> list[dict]:
    """One record per assistant reply that follows a user turn: that turn the ``prompt``, the reply the ``answer``,
    the messages before it the ``history`` (JSON role/content turns, rendered by the chat template). A conversation
    is read up to its first turn of a role other than system, user and assistant."""
    records = []
    for i, turn in enumerate(messages):
        if turn["role"] not in ("system", "user", "assistant"):
            break
        if i and turn["role"] == "assistant" and messages[i - 1]["role"] == "user":
            records.append({"prompt": messages[i - 1]["content"], "answer": turn["content"],
                            "history": json.dumps(messages[: i - 1])})
    return records


def sharegpt_turns(record: dict) -> list[dict]:
    """ShareGPT, every assistant turn (EAGLE-3's and SpecForge's training data): ``every_turn``."""
    return every_turn([{"role": SHAREGPT_ROLES.get(t.get("from"), t.get("from")), "content": t.get("value")}
                       for t in record.get("conversations") or []])


def chat_turns(record: dict) -> list[dict]:
    """UltraChat (``messages``: role/content turns), every assistant turn: ``every_turn``."""
    return every_turn([{"role": t.get("role"), "content": t.get("content")} for t in record.get("messages") or []])


def mbpp_tests(record: dict) -> dict:
    """MBPP: its test cases (``test_list``, a list of asserts) as one ``tests`` text, one assert a line, for prompts
    that show them (the Ouroboros paper predicts the whole function from the task text and its test cases, §4.1)."""
    tests = record.get("test_list")
    if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
        raise DataError(f"MBPP record {record.get('task_id')!r}: 'test_list' should be a list of assert statements, "
                        f"got {type(tests).__name__}")
    return {"tests": "\n".join(tests)}
