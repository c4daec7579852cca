"""``data=self_distilled``: the target's own greedy answers as training data for what trains against a frozen target
(draft heads, transfer maps, a distilled draft). Medusa-2, EAGLE and SpecForge regenerate their training answers
with the target itself: a draft learns the distribution it will be verified against.

The answers are a collection (``lit_spec.data.trajectories``' format) of ``collect.decoder=ar``: the target decodes
the prompts of a dataset (``data.collect``'s overrides of ``conf/collect.yaml``) greedily with the batched AR
decoder, resumably, cached as the ``answers`` stage of ``lit_spec.stages``, which fills in ``data.path``. A Jacobi
trajectory collection holds the same answers and reads as well. Kept records (the repetition filter's) become
prompt/answer batches (``AnswerBatches``); decoding callbacks score against the dataset's own answers.
"""

from __future__ import annotations

import datasets

from lit_spec.data.base_states import BaseStates, cached_batch
from lit_spec.data.datamodule import AnswerBatches
from lit_spec.data.trajectories import CollectionSource, read_records, split_off_validation
from lit_spec.errors import DataError, check_count


class SelfDistilledDataModule(AnswerBatches):
    """Decoding callbacks (``eval_records``) score against the dataset's answers, not the target's own.

    Args:
        tokenizer: the target's (its pad token pads).
        path: a collected directory (the ``answers`` stage sets it when the config leaves it null).
        collect, engine, cache_dir: that stage's ``conf/collect.yaml`` overrides, engine and cache (read by the stage,
            not here).
        max_train_records: train on the first this many kept train records only (data-size ablations).
        max_answer_tokens: cut every answer to this many tokens (null: as collected).
        base_states: ``BaseStates``: when enabled, batches also hold the frozen base's cached last hidden states and
            greedy next tokens (``base_hidden``, ``base_next``; ``data/base_states.py``).
        batch_size, eval_batch_size, num_workers, shuffle_seed, metric: as ``AnswerBatches``.
    """

    eval_answers = "reference_ids"

    def __init__(self, tokenizer=None, path: str | None = None, collect: list[str] | None = None,
                 engine: str | None = None, cache_dir: str | None = None, max_train_records: int | None = None,
                 max_answer_tokens: int | None = None, base_states: BaseStates | None = None, batch_size: int = 8,
                 eval_batch_size: int | None = None, num_workers: int = 0, shuffle_seed: int = 0,
                 metric: str | None = None):
        super().__init__(tokenizer, batch_size, eval_batch_size, num_workers, shuffle_seed, metric)
        for key, value in (("max_train_records", max_train_records), ("max_answer_tokens", max_answer_tokens)):
            check_count(f"data.{key}", value, optional=True)
        self.path, self.max_train_records, self.max_answer_tokens = path, max_train_records, max_answer_tokens
        self.source = CollectionSource(path, "the target's own answers")
        self.base_states = base_states if base_states is not None and base_states.enabled else None
        self.states: dict | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.splits is not None:
            return
        self.source.require_path()
        train = read_records(self.path, "train")
        if not train:
            raise DataError(f"{self.path}: no kept train answer; collect more prompts (or check the repetition "
                            "filter, which drops looping answers)")
        train, val = split_off_validation(self.path, train[: self.max_train_records])
        self.splits = datasets.DatasetDict({"train": self._dataset(train, 0),
                                            "validation": self._dataset(val, len(train))})
        if self.base_states is not None:
            self.states = self.base_states.load()

    def _dataset(self, records: list[dict], first_row: int) -> datasets.Dataset:
        """Training pairs are (prompt, the target's answer); ``reference_ids`` keeps the dataset's answer; ``row``
        numbers train then validation records (the base-state cache's order)."""
        return datasets.Dataset.from_dict({"prompt_ids": [r["prompt_ids"] for r in records],
                                           "answer_ids": [r["answer_ids"][: self.max_answer_tokens] for r in records],
                                           "reference_ids": [r["reference_ids"] for r in records],
                                           "row": list(range(first_row, first_row + len(records)))})

    def records(self) -> list[dict]:
        """Every training and validation record, in ``row`` order: what the base-state cache holds."""
        self.setup()
        return [row for split in ("train", "validation") for row in self.splits[split]]

    def collate(self, records: list[dict]) -> dict:
        batch = super().collate(records)
        if self.states is not None:
            batch |= cached_batch(self.states, records, batch["input_ids"].size(1), self.base_states.path)
        return batch
