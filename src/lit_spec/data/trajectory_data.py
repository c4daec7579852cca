"""``data=trajectories``: CLLM training batches (Kou et al. 2024, Algorithm 2) from a collected Jacobi trajectory
directory (``lit_spec.data.trajectories``, written by ``python -m lit_spec.collect``).

One training item per (record, block), as Algorithm 1 appends one (x, J) per block: with the context
c = prompt + the fixed points of the record's earlier blocks, a state y of the block's trajectory J drawn at random
(uniform over its states but the fixed point y*, plus the augmented states when ``use_augmented``; a block that is
already at its fixed point gives y = y*), the item holds

- ``input_ids`` = c + y (the student's input), ``teacher_ids`` = c + y* (global teacher, eq. 4) and
  ``local_teacher_ids`` = c + y^(j+1) (local teacher, eq. 5; y* for an augmented state), all of one length, with
  ``attention_mask``;
- ``consistency_mask``: the positions whose next-token distributions are compared: the predictions of the block's
  tokens from y's first wrong one on (eq. 4's terms before it compare equal contexts, 0; the authors' code leaves them
  out, which its mean reduction counts);
- ``prompt_mask``: the prompt's tokens in c (the block AR sequence, c + y*, is ``teacher_ids``);
- ``ar_input_ids`` / ``ar_attention_mask`` / ``ar_labels``: prompt + l for the answer AR sequence (eq. 6), l being
  the target's generated answer (``ar_target: generated``, the paper's) or the dataset's answer (``dataset``), prompt
  masked.

The states are drawn with a generator seeded by (seed, epoch, item index): reproducible, new states every epoch;
validation always uses epoch 0 and the items in order. ``num_tokens`` (throughput) counts the student's tokens only.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lit_spec.data.datamodule import IGNORE_INDEX, check_loader_counts
from lit_spec.data.metrics import get_metric
from lit_spec.data.resumable import EpochOrder, ResumableLoader, data_parallel_rank, epoch_seed
from lit_spec.data.trajectories import CollectionSource, read_meta, read_records, split_off_validation
from lit_spec.decoding.verify import greedy_accept_length
from lit_spec.errors import ConfigError, DataError, check_count

AR_TARGETS = ("generated", "dataset")


def student_pool(block: dict, use_augmented: bool = True) -> list[tuple[list[int], list[int]]]:
    """(student state, local teacher state) pairs a block's item draws from: (y^(j), y^(j+1)) for every state but the
    fixed point, then (augmented state, y*); [(y*, y*)] when the trajectory is its fixed point alone."""
    states = block["states"]
    fixed = states[-1]
    pool = [(states[j], states[j + 1]) for j in range(len(states) - 1)]
    if use_augmented:
        pool += [(state, fixed) for state in block.get("augmented", [])]
    return pool or [(fixed, fixed)]


def consistency_item(record: dict, block: int, choice: int, use_augmented: bool = True,
                     max_context_tokens: int | None = None) -> dict:
    """Token lists for block ``block`` of ``record`` with the student state ``student_pool(...)[choice]``."""
    offset = sum(len(b["states"][-1]) for b in record["blocks"][:block])
    context = record["prompt_ids"] + record["answer_ids"][:offset]
    cut = 0 if max_context_tokens is None else max(0, len(context) - max_context_tokens)
    context = context[cut:]                                             # left-truncate, keep the block
    student, local = student_pool(record["blocks"][block], use_augmented)[choice]
    fixed = record["blocks"][block]["states"][-1]
    start = len(context) - 1                                            # logits here predict the block's 1st token
    return {"student": context + student, "teacher": context + fixed, "local_teacher": context + local,
            "mask": (start + greedy_accept_length(student, fixed), start + len(fixed)),
            "prompt": max(0, len(record["prompt_ids"]) - cut)}


def ar_item(record: dict, ar_target: str = "generated", max_context_tokens: int | None = None) -> dict:
    """Eq. 6's sequence: prompt + the answer (generated: the target's l; dataset: the reference), prompt masked."""
    prompt = record["prompt_ids"]
    if max_context_tokens is not None:
        prompt = prompt[-max_context_tokens:]
    answer = record["answer_ids"] if ar_target == "generated" else record["reference_ids"]
    return {"ids": prompt + answer, "labels": [IGNORE_INDEX] * len(prompt) + answer}


def item_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """The generator of an item's random draws: reproducible, new every epoch."""
    return torch.Generator().manual_seed(hash((seed, epoch, index)) % 2**63)


class _Items(Dataset):
    """(record, block) items; ``dataset[(index, epoch)]`` draws the item's student state for that epoch."""

    def __init__(self, records: list[dict], seed: int, use_augmented: bool, max_context_tokens: int | None,
                 ar_target: str):
        self.records, self.seed = records, seed
        self.use_augmented, self.max_context_tokens, self.ar_target = use_augmented, max_context_tokens, ar_target
        self.items = [(r, b) for r, record in enumerate(records) for b, block in enumerate(record["blocks"])
                      if block["states"][-1]]

    def __len__(self) -> int:
        return len(self.items)

    def length(self, index: int) -> int:
        """Item ``index``'s tokens: its context (as truncated) and block, without building it."""
        r, b = self.items[index]
        record = self.records[r]
        context = len(record["prompt_ids"]) + sum(len(block["states"][-1]) for block in record["blocks"][:b])
        if self.max_context_tokens is not None:
            context = min(context, self.max_context_tokens)
        return context + len(record["blocks"][b]["states"][-1])

    def __getitem__(self, key: tuple[int, int]) -> dict:
        index, epoch = key
        r, b = self.items[index]
        record = self.records[r]
        size = len(student_pool(record["blocks"][b], self.use_augmented))
        generator = item_generator(self.seed, epoch, index)
        choice = int(torch.randint(size, (1,), generator=generator))
        return {**consistency_item(record, b, choice, self.use_augmented, self.max_context_tokens),
                "ar": ar_item(record, self.ar_target, self.max_context_tokens)}


class EpochSampler(EpochOrder):
    """Yields (index, epoch): a permutation seeded by (seed, epoch) when shuffling; the items in order with epoch 0
    otherwise (validation sees the same states every time).

    With ``lengths`` (each item's tokens) the permutation is bucketed by length, as transformers' ``group_by_length``
    does: each run of ``window`` steps' items (``step``: the items of one optimizer step over all ranks) is sorted by
    length and cut into steps, and the steps are shuffled (a last, partial one stays last, so every batch keeps its
    items). A step's items are about as long, so a batch pads to little more than its own tokens."""

    def __init__(self, size: int, seed: int = 0, shuffle: bool = True, rank: int = 0, world: int = 1,
                 lengths: list[int] | None = None, step: int = 1, window: int = 50):
        super().__init__(size, rank, world)
        self.seed, self.shuffle, self.lengths, self.step, self.window = seed, shuffle, lengths, step, window

    def order(self, epoch: int) -> list[tuple[int, int]]:
        if not self.shuffle:
            return [(i, 0) for i in range(self.size)]
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        order = torch.randperm(self.size, generator=generator).tolist()
        if self.lengths is not None:
            order = self._bucketed(order, generator)
        return [(i, epoch) for i in order]

    def _bucketed(self, order: list[int], generator: torch.Generator) -> list[int]:
        steps, run = [], self.step * self.window
        for start in range(0, len(order), run):
            part = sorted(order[start: start + run], key=lambda i: self.lengths[i])
            steps += [part[k: k + self.step] for k in range(0, len(part), self.step)]
        last = [steps.pop()] if steps and len(steps[-1]) < self.step else []
        return [i for k in torch.randperm(len(steps), generator=generator).tolist() for i in steps[k]] + sum(last, [])


class JacobiTrajectories(L.LightningDataModule):
    """A collected trajectory directory as training batches; subclasses make the items (``items``, ``collate``).
    Args:
        tokenizer: the model's (its pad token pads; the speedup callback decodes with it).
        path: a collected trajectory directory (the ``trajectories`` stage of ``lit_spec.stages`` sets it when the
            config leaves it null).
        collect, cache_dir: that stage's ``conf/collect.yaml`` overrides and cache (read by the stage, not here).
        batch_size, eval_batch_size: items (blocks) per batch.
        use_augmented: augmented states (§3.2.1) join the states a student input is drawn from.
        max_context_tokens: left-truncate the context before a block (and the prompt of the AR sequence).
        ar_target: ``generated`` (the target's answer l, eq. 6) or ``dataset`` (the reference answer).
        metric: the task metric callbacks score decoded answers with (``lit_spec.data.metrics``), or null.
        max_train_records: train on the first this many kept train records only (trajectory-set size ablations).
        length_buckets: train batches bucketed by length over runs of this many steps (``EpochSampler``), or null:
            batches drawn as they come, each padded to its longest item.
        num_workers, seed: data loading; the seed of the shuffling and of the states drawn.
    """

    def __init__(self, tokenizer=None, path: str | None = None, collect: list[str] | None = None,
                 cache_dir: str | None = None, batch_size: int = 8, eval_batch_size: int | None = None,
                 use_augmented: bool = True, max_context_tokens: int | None = None, ar_target: str = "generated",
                 metric: str | None = None, max_train_records: int | None = None, length_buckets: int | None = 50,
                 num_workers: int = 0, seed: int = 0):
        super().__init__()
        if ar_target not in AR_TARGETS:
            raise ConfigError(f"data.ar_target={ar_target!r}: choose one of {list(AR_TARGETS)}")
        check_loader_counts(batch_size, eval_batch_size, num_workers)
        check_count("data.max_context_tokens", max_context_tokens, optional=True)
        check_count("data.max_train_records", max_train_records, optional=True)
        check_count("data.length_buckets", length_buckets, optional=True)
        if metric is not None:
            get_metric(metric)
        self.tokenizer, self.path = tokenizer, path
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.use_augmented, self.max_context_tokens, self.ar_target = use_augmented, max_context_tokens, ar_target
        self.metric, self.max_train_records, self.num_workers, self.seed = metric, max_train_records, num_workers, seed
        self.length_buckets = length_buckets
        self.source = CollectionSource(path, "Jacobi trajectories")
        self.records: dict[str, list[dict]] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.records is not None:
            return
        self.source.require_path()
        if read_meta(self.path)["config"].get("collect", {}).get("decoder") == "ar":
            raise DataError(f"{self.path}: an answers-only collection (collect.decoder=ar) has no Jacobi trajectories "
                            "to train CLLM on; collect with collect.decoder=null (Jacobi), or train a frozen-base "
                            "method on it with data=self_distilled")
        train = read_records(self.path, "train")
        if not any(block["states"][-1] for r in train for block in r["blocks"]):
            raise DataError(f"{self.path}: no train record with a Jacobi trajectory; collect more prompts "
                            "(or check the post-processing, which drops repetitive answers)")
        train, val = split_off_validation(self.path, train)
        self.records = {"train": train[: self.max_train_records], "validation": val}

    @property
    def n_tokens(self) -> int:
        """The block size n the trajectories were collected with."""
        return read_meta(self.path)["config"]["collect"]["n_tokens"]

    def eval_records(self, split: str, n: int) -> list[dict]:
        """The first ``n`` records of ``split`` (none when it is empty or absent) as ``{"prompt_ids", "answer_ids"}``
        with the dataset's answers (``reference_ids``): prompts to decode and answers to score."""
        self.setup()
        records = self.records.get(split)
        if records is None:
            records = read_records(self.path, split)
        return [{"prompt_ids": list(r["prompt_ids"]), "answer_ids": list(r["reference_ids"])} for r in records[:n]]

    # ---- batches --------------------------------------------------------------------------------------------
    @property
    def pad_token_id(self) -> int:
        tok = self.tokenizer
        pad = None if tok is None else (tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        return 0 if pad is None else pad

    def check_block_size(self, n: int) -> None:
        """The methods train and decode with the block size their trajectories were collected with."""
        if n != self.n_tokens:
            raise ConfigError(f"method.n_tokens={n}, but the trajectories at {self.path} were collected with "
                              f"n={self.n_tokens}: set method.n_tokens={self.n_tokens}, or collect with n={n} "
                              f"(data.path=null collects with method.n_tokens)")

    def items(self, split: str) -> Dataset:
        """The split's items, indexed by (index, epoch) (``EpochSampler``)."""
        raise NotImplementedError

    def collate(self, items: list[dict]) -> dict:
        raise NotImplementedError

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        items = self.items(split)
        loader = ResumableLoader if shuffle else DataLoader
        rank, world = data_parallel_rank(self)
        lengths = [items.length(i) for i in range(len(items))] if self.length_buckets and shuffle else None
        sampler = EpochSampler(len(items), self.seed, shuffle, rank, world, lengths, self.batch_size * world,
                               self.length_buckets)
        return loader(items, batch_size=self.batch_size if shuffle else self.eval_batch_size, sampler=sampler,
                      collate_fn=self.collate,
                      num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", shuffle=False)


class TrajectoryDataModule(JacobiTrajectories):
    """CLLM's batches: one item per (record, block), a state of the block's trajectory drawn per epoch (module doc)."""

    def items(self, split: str) -> Dataset:
        return _Items(self.records[split], self.seed, self.use_augmented, self.max_context_tokens, self.ar_target)

    def collate(self, items: list[dict]) -> dict:
        pad, rows = self.pad_token_id, len(items)
        width = max(len(it["student"]) for it in items)
        ar_width = max(len(it["ar"]["ids"]) for it in items)
        batch = {key: torch.full((rows, width), pad, dtype=torch.long)
                 for key in ("input_ids", "teacher_ids", "local_teacher_ids")}
        batch["attention_mask"] = torch.zeros((rows, width), dtype=torch.long)
        batch["consistency_mask"] = torch.zeros((rows, width), dtype=torch.bool)
        batch["prompt_mask"] = torch.zeros((rows, width), dtype=torch.bool)
        batch["ar_input_ids"] = torch.full((rows, ar_width), pad, dtype=torch.long)
        batch["ar_attention_mask"] = torch.zeros((rows, ar_width), dtype=torch.long)
        batch["ar_labels"] = torch.full((rows, ar_width), IGNORE_INDEX, dtype=torch.long)
        for i, it in enumerate(items):
            size = len(it["student"])
            for key, seq in (("input_ids", "student"), ("teacher_ids", "teacher"),
                             ("local_teacher_ids", "local_teacher")):
                batch[key][i, :size] = torch.tensor(it[seq])
            batch["attention_mask"][i, :size] = 1
            batch["consistency_mask"][i, slice(*it["mask"])] = True
            batch["prompt_mask"][i, : it["prompt"]] = True
            ar = it["ar"]
            batch["ar_input_ids"][i, : len(ar["ids"])] = torch.tensor(ar["ids"], dtype=torch.long)
            batch["ar_attention_mask"][i, : len(ar["ids"])] = 1
            batch["ar_labels"][i, : len(ar["ids"])] = torch.tensor(ar["labels"], dtype=torch.long)
        return batch
