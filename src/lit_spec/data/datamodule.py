"""The LightningDataModules every non-CLLM method trains on: prompt/answer token records -> padded batches.

``AnswerBatches`` holds the batching (length-grouped shuffled training batches, evaluation records for decoding
callbacks); ``PromptDataModule`` fills it from a dataset through a prompt template, ``SelfDistilledDataModule``
(``data/self_distilled.py``) from the target's own collected answers."""

from __future__ import annotations

import json
import logging

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers.trainer_pt_utils import LengthGroupedSampler

from lit_spec.data.metrics import get_metric
from lit_spec.data.resumable import EpochOrder, ResumableLoader, data_parallel_rank, epoch_seed
from lit_spec.data.templates import PromptTemplate
from lit_spec.errors import ConfigError, DataError, check_count

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
# What every split holds after setup(), empty ones included.
TOKEN_FEATURES = datasets.Features({"prompt_ids": datasets.Sequence(datasets.Value("int64")),
                                   "answer_ids": datasets.Sequence(datasets.Value("int64"))})


def batch_size(batch: dict) -> int:
    return int(batch["input_ids"].size(0))


def num_tokens(batch: dict) -> int:
    """Real (non-padding) tokens in a batch: what throughput is counted in."""
    return int(batch["attention_mask"].sum())


def collate_answers(pairs: list[tuple[list[int], list[int]]], pad_token_id: int) -> dict:
    """(prompt ids, answer ids) pairs -> a right-padded batch: ``input_ids`` (prompt then answer), ``attention_mask``,
    and ``labels`` holding the answer tokens (``IGNORE_INDEX`` on the prompt and the padding)."""
    width = max(len(p) + len(a) for p, a in pairs)
    input_ids = torch.full((len(pairs), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(pairs), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for i, (prompt, answer) in enumerate(pairs):
        end = len(prompt) + len(answer)
        input_ids[i, :end] = torch.tensor(prompt + answer, dtype=torch.long)
        attention_mask[i, :end] = 1
        labels[i, len(prompt): end] = torch.tensor(answer, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def record_of(row: dict, answers: str = "answer_ids") -> dict:
    """A tokenized row as plain lists, its ``answers`` column as ``answer_ids`` (+ its ``problem`` as a dict, when
    the data config keeps one)."""
    out = {"prompt_ids": list(row["prompt_ids"]), "answer_ids": list(row[answers])}
    if row.get("problem") is not None:
        out["problem"] = json.loads(row["problem"])
    return out


def split_records(datamodule, split: str, n: int | None = None, setting: str = "split") -> list[dict]:
    """The first ``n`` records (None: all) of ``split`` of a datamodule with ``splits`` as plain records
    (``record_of``): the dataset's answers, and the ``problem`` an execution metric runs. A split the data lacks, or
    an empty one, is a ConfigError naming ``setting`` (``bench.split``)."""
    datamodule.setup("test")
    if split not in datamodule.splits:
        raise ConfigError(f"{setting}={split}: the data has no such split; choose one of {sorted(datamodule.splits)}")
    ds = datamodule.splits[split]
    if len(ds) == 0:
        raise ConfigError(f"{setting}={split}: that split of the data is empty")
    return [record_of(ds[i]) for i in range(len(ds) if n is None else min(n, len(ds)))]


class LengthGrouped(EpochOrder):
    """transformers' ``LengthGroupedSampler`` order (shuffled megabatches sorted by length), seeded by (seed, epoch),
    grouped for the global batch (``batch_size`` per rank times the ranks)."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int, rank: int = 0, world: int = 1):
        super().__init__(len(lengths), rank, world)
        self.lengths, self.batch_size, self.seed = lengths, batch_size, seed

    def order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        return list(LengthGroupedSampler(self.batch_size * self.num_replicas, lengths=self.lengths,
                                         generator=generator))


def check_loader_counts(batch_size, eval_batch_size, num_workers) -> None:
    """The loader settings every data config has, checked before any work."""
    check_count("data.batch_size", batch_size)
    check_count("data.eval_batch_size", eval_batch_size, optional=True)
    check_count("data.num_workers", num_workers, minimum=0)


class AnswerBatches(L.LightningDataModule):
    """Batches of the prompt/answer records in ``self.splits`` (split -> ``datasets.Dataset`` with ``prompt_ids`` and
    ``answer_ids``), which subclasses fill in ``setup``: right-padded ``input_ids``/``attention_mask``/``labels``
    with the prompt masked out of the labels; ``eval_records`` for methods and callbacks that decode. ``metric``
    names the task metric (``lit_spec.data.metrics``) such callbacks score decoded answers with, or is None."""

    eval_answers = "answer_ids"     # the column decoding callbacks score against

    def __init__(self, tokenizer=None, batch_size: int = 8, eval_batch_size: int | None = None, num_workers: int = 0,
                 shuffle_seed: int = 0, metric: str | None = None):
        super().__init__()
        check_loader_counts(batch_size, eval_batch_size, num_workers)
        if metric is not None:
            get_metric(metric)  # an unknown name fails here, before any work
        self.tokenizer, self.metric = tokenizer, metric
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.num_workers, self.shuffle_seed = num_workers, shuffle_seed
        self.splits: datasets.DatasetDict | None = None

    def eval_records(self, split: str, n: int) -> list[dict]:
        """The first ``n`` records of ``split`` (fewer when it is shorter; none when it is empty or absent) as
        ``{"prompt_ids": [...], "answer_ids": [...]}`` (+ ``problem`` with ``data.problem_columns``): prompts to
        decode, the dataset's answers (the column ``eval_answers``) to score and what an execution metric tests them
        with."""
        self.setup()
        ds = self.splits.get(split)
        if ds is None:
            return []
        ds = ds.select(range(min(n, len(ds))))
        return [record_of(r, self.eval_answers) for r in ds]

    def answer_token_counts(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size]: how often each token occurs in the training answers (what EAGLE-3's draft vocabulary keeps
        the most frequent of)."""
        self.setup("fit")
        ids = torch.tensor([t for answer in self.splits["train"]["answer_ids"] for t in answer], dtype=torch.long)
        return torch.bincount(ids, minlength=vocab_size)[:vocab_size]

    def collate(self, records: list[dict]) -> dict:
        return collate_answers([(r["prompt_ids"], r["answer_ids"]) for r in records], self.tokenizer.pad_token_id)

    def _loader(self, split: str, sampler=None) -> DataLoader:
        loader = DataLoader if sampler is None else ResumableLoader
        return loader(self.splits[split], batch_size=self.batch_size if sampler else self.eval_batch_size,
                      sampler=sampler, collate_fn=self.collate, num_workers=self.num_workers,
                      persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        """Shuffled batches of similar lengths (``LengthGrouped``): little compute goes to padding; resumable."""
        ds = self.splits["train"]
        lengths = [len(p) + len(a) for p, a in zip(ds["prompt_ids"], ds["answer_ids"])]
        return self._loader("train", LengthGrouped(lengths, self.batch_size, self.shuffle_seed,
                                                   *data_parallel_rank(self)))

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")


class PromptDataModule(AnswerBatches):
    """Tokenizes ``template.render(record)`` into ``prompt_ids`` + ``answer_ids`` (+EOS) for every split (batches:
    ``AnswerBatches``). ``problem_columns``: raw columns kept with every record as its ``problem``
    (an execution metric's tests, e.g. HumanEval's ``test`` and ``entry_point`` for ``pass_at_1``).

    ``eval_shuffle_seed``: shuffle the validation/test records with this seed before ``max_eval_samples`` (and the
    bench's ``num_prompts``) take the first ones, i.e. a seeded random sample (the Ouroboros paper samples 100
    prompts of GSM8K, CNN/DM and WMT16); None keeps the dataset's order. An evaluation-only source (one with an
    ``eval_split``, e.g. HumanEval) has no train split: ``setup("fit")`` refuses it.
    """

    def __init__(self, source, template: PromptTemplate, tokenizer=None, path: str | None = None,
                 batch_size: int = 8,
                 eval_batch_size: int | None = None, max_prompt_tokens: int = 512, max_answer_tokens: int = 512,
                 max_train_samples: int | None = None, max_eval_samples: int | None = None,
                 num_workers: int = 0, shuffle_seed: int = 0, metric: str | None = None,
                 eval_shuffle_seed: int | None = None, problem_columns: list[str] | None = None):
        super().__init__(tokenizer, batch_size, eval_batch_size, num_workers, shuffle_seed, metric)
        for key, value in (("max_prompt_tokens", max_prompt_tokens), ("max_answer_tokens", max_answer_tokens)):
            check_count(f"data.{key}", value)
        for key, value in (("max_train_samples", max_train_samples), ("max_eval_samples", max_eval_samples)):
            check_count(f"data.{key}", value, optional=True)
        if path is not None:  # data.path=... replaces the hub id with a local file
            if not hasattr(source, "path"):
                raise DataError(f"data.path is not supported by {type(source).__name__}")
            source.path = path
        self.source, self.template = source, template
        self.max_prompt_tokens, self.max_answer_tokens = max_prompt_tokens, max_answer_tokens
        self.max_train_samples, self.max_eval_samples = max_train_samples, max_eval_samples
        self.eval_shuffle_seed, self.problem_columns = eval_shuffle_seed, list(problem_columns or [])
        # the one split an evaluation-only source fills (None: a training source, whose train split must not be empty)
        self.eval_split: str | None = getattr(source, "eval_split", None)

    # ---- building -------------------------------------------------------------------------------------------
    def _tokenize(self, record: dict) -> dict:
        prompt, answer = self.template.render(record)
        history = json.loads(record["history"]) if record.get("history") else None
        prompt_ids = self.template.prompt_ids(self.tokenizer, prompt, history)
        answer_ids = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
        if len(answer_ids) < self.max_answer_tokens:
            answer_ids = answer_ids + [self.tokenizer.eos_token_id]  # a finished answer ends in EOS
        else:
            answer_ids = answer_ids[: self.max_answer_tokens]
        out = {"prompt_ids": prompt_ids, "answer_ids": answer_ids}
        if self.problem_columns:        # what an execution metric runs the answer against (e.g. HumanEval's tests)
            out["problem"] = json.dumps({c: record.get(c) for c in self.problem_columns})
        return out

    def setup(self, stage: str | None = None) -> None:
        if stage == "fit" and self.eval_split is not None:
            raise DataError(f"{self.source.describe()}: evaluation-only data (data.source.eval_split="
                            f"{self.eval_split}) has no train split to train on; benchmark it with python -m "
                            "lit_spec.bench, or train on a dataset with a train split")
        if self.splits is not None:
            return
        if self.tokenizer is None:
            raise DataError("PromptDataModule needs a tokenizer (the training pipeline passes the model's)")
        raw = self.source.load()
        name = self.source.describe()
        required = self.eval_split or "train"
        if len(raw[required]) == 0:
            raise DataError(f"{name}: the {required} split is empty; check data.path / data.source")
        for split, ds in raw.items():
            if len(ds):
                self.template.check_columns(ds.column_names, f"{name} [{split}]")
        limits = {"train": self.max_train_samples, "validation": self.max_eval_samples, "test": self.max_eval_samples}
        out = {}
        for split, ds in raw.items():
            if split != "train" and self.eval_shuffle_seed is not None and len(ds):
                ds = ds.shuffle(seed=self.eval_shuffle_seed)
            if limits[split] is not None:
                ds = ds.select(range(min(limits[split], len(ds))))
            if len(ds) == 0:
                features = TOKEN_FEATURES | ({"problem": datasets.Value("string")} if self.problem_columns else {})
                out[split] = datasets.Dataset.from_dict({k: [] for k in features}, features=datasets.Features(features))
                continue
            ds = ds.map(self._tokenize, remove_columns=ds.column_names, desc=f"tokenizing {split}")
            before = len(ds)
            ds = ds.filter(lambda r: 0 < len(r["prompt_ids"]) <= self.max_prompt_tokens)
            if len(ds) < before:
                log.info("%s: dropped %d of %d records whose prompt exceeds data.max_prompt_tokens=%d",
                         split, before - len(ds), before, self.max_prompt_tokens)
            out[split] = ds
        if len(out[required]) == 0:
            raise DataError(f"{name}: no {required} record fits data.max_prompt_tokens={self.max_prompt_tokens}")
        self.splits = datasets.DatasetDict(out)
