"""``data=noisy_trajectories``: Jacobi Forcing's training sequences (Hu et al. 2025, arXiv 2512.14681, Fig. 6) from
the Jacobi trajectories that CLLM trains on (``data=trajectories``, the same collection and cache entry).

One item per record, its answer in the blocks it was collected in (n, the trained block size, is the collected one:
a piece of a longer block's states was never an n-token trajectory, its tokens conditioned on a noisy prefix that a
real n-token decode has already fixed). Block j gets a noise ratio t_j from the
progressive schedule, t_j = W[j mod w] with W = w ratios rising linearly from 0 to 1 (``progressive``, the paper's;
``random`` draws a ratio of W per block and epoch). Its noisy state is the trajectory state whose unconverged share
(the tokens from its first wrong one on, over n) is nearest to t_j, its clean state the fixed point. The item packs
the context and every (noisy, clean) pair, ``context k_0 l_0 k_1 l_1 ...``, each pair on the same position ids; the
noise-aware mask (``decoding.masks.noise_aware``) lets the clean blocks read as plain AR over the answer and the noisy
ones read the noisy blocks before them. One forward gives both losses:

- ``pairs``: (row, noisy position, clean position, block) of every noisy token from the block's first wrong one on,
  the last block's last included (as the authors' code keeps it): the model's next-token distribution there is
  compared with the clean copy's (the consistency loss);
- ``labels``: the next answer token at the context's last position and every clean position (the AR loss; the
  context's own pairs are added by the method under ``ar_prompt``);
- ``blocks``: the record's number of blocks, T (the authors' code divides its consistency mean by it).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from lit_spec.data.datamodule import IGNORE_INDEX
from lit_spec.data.trajectory_data import JacobiTrajectories, item_generator, student_pool
from lit_spec.decoding.masks import CLEAN, CONTEXT, NOISY, PADDING
from lit_spec.decoding.verify import greedy_accept_length
from lit_spec.errors import ConfigError, check_count

NOISE_SCHEDULES = ("progressive", "random", "uniform")


def record_blocks(record: dict) -> list[list[list[int]]]:
    """The record's blocks, each its list of states from the initial guess to the fixed point; empty ones left out."""
    return [block["states"] for block in record["blocks"] if block["states"][-1]]


def noise_ratios(window: int) -> list[float]:
    """W: ``window`` noise ratios rising linearly from 0 to 1 (a window of 1: only clean blocks)."""
    return [i / (window - 1) for i in range(window)] if window > 1 else [0.0]


def unconverged(state: list[int], fixed: list[int]) -> float:
    """The share of a state's tokens that are not yet final: from its first wrong token to the block's end."""
    return (len(fixed) - greedy_accept_length(state, fixed)) / len(fixed)


def pick_state(states: list[list[int]], ratio: float) -> list[int]:
    """The state whose unconverged share is nearest to ``ratio`` (the earliest on ties: the noisier)."""
    fixed = states[-1]
    return min(states, key=lambda s: abs(unconverged(s, fixed) - ratio))


def packed_item(context: list[int], blocks: list[list[list[int]]], noisy: list[list[int]]) -> dict:
    """Token lists of one sequence: ids, positions, streams, block ids, labels and the consistency pairs (see the
    module doc); ``noisy``: each block's noisy state."""
    item = {"ids": list(context), "positions": list(range(len(context))), "streams": [CONTEXT] * len(context),
            "block_ids": [-1] * len(context), "labels": [IGNORE_INDEX] * len(context), "pairs": [],
            "blocks": len(blocks)}

    def append(stream: int, tokens: list[int], start: int, block: int) -> int:
        at = len(item["ids"])
        item["ids"] += tokens
        item["positions"] += range(start, start + len(tokens))
        item["streams"] += [stream] * len(tokens)
        item["block_ids"] += [block] * len(tokens)
        item["labels"] += [IGNORE_INDEX] * len(tokens)
        return at

    last_clean = len(context) - 1                    # the position whose logits predict the next answer token
    for j, (states, state) in enumerate(zip(blocks, noisy)):
        fixed = states[-1]
        start = item["positions"][-1] + 1 if item["positions"] else 0
        noisy_at, clean_at = append(NOISY, state, start, j), append(CLEAN, fixed, start, j)
        for at, token in zip([last_clean] + list(range(clean_at, clean_at + len(fixed) - 1)), fixed):
            item["labels"][at] = token
        last_clean = clean_at + len(fixed) - 1
        first_wrong = greedy_accept_length(state, fixed)
        item["pairs"] += [(noisy_at + t, clean_at + t, j) for t in range(first_wrong, len(fixed))]
    return item


class _Records(Dataset):
    """One packed item per record with a trajectory; ``dataset[(index, epoch)]`` (``random`` draws per epoch)."""

    def __init__(self, records: list[dict], window: int, schedule: str, seed: int, max_context_tokens: int | None,
                 use_augmented: bool):
        self.ratios, self.schedule, self.seed = noise_ratios(window), schedule, seed
        self.max_context_tokens, self.use_augmented = max_context_tokens, use_augmented
        self.records = [r for r in records if any(b["states"][-1] for b in r["blocks"])]

    def __len__(self) -> int:
        return len(self.records)

    def length(self, index: int) -> int:
        """Record ``index``'s packed tokens: its context (as truncated) and two copies of every block."""
        record = self.records[index]
        context = len(record["prompt_ids"])
        if self.max_context_tokens is not None:
            context = min(context, self.max_context_tokens)
        return context + 2 * sum(len(states[-1]) for states in record_blocks(record))

    def __getitem__(self, key: tuple[int, int]) -> dict:
        index, epoch = key
        record = self.records[index]
        context = record["prompt_ids"]
        if self.max_context_tokens is not None:
            context = context[-self.max_context_tokens:]
        return packed_item(context, record_blocks(record), self.noisy_states(record, index, epoch))

    def noisy_states(self, record: dict, index: int, epoch: int) -> list[list[int]]:
        """Each block's noisy state under the schedule: by ratio, or drawn as CLLM draws its students (``uniform``:
        any state but the fixed point, the augmented ones too with ``use_augmented``)."""
        blocks, generator = record_blocks(record), item_generator(self.seed, epoch, index)
        if self.schedule == "uniform":
            pools = [[state for state, _ in student_pool(b, self.use_augmented)] for b in record["blocks"]
                     if b["states"][-1]]
            return [pool[int(torch.randint(len(pool), (1,), generator=generator))] for pool in pools]
        w = len(self.ratios)
        picks = ([j % w for j in range(len(blocks))] if self.schedule == "progressive"
                 else torch.randint(w, (len(blocks),), generator=generator).tolist())
        return [pick_state(states, self.ratios[i]) for states, i in zip(blocks, picks)]


class NoisyTrajectoryDataModule(JacobiTrajectories):
    """Args (besides ``JacobiTrajectories``'; ``batch_size`` counts records, ``use_augmented`` is read by
    ``uniform``):
        block_size: n, the training block size (``method.n_tokens``): the collected one; null: that one.
        noise_window: w, the ratios of the progressive schedule (the paper's data: n = 32, w = 16).
        noise_schedule: ``progressive`` (t_j = W[j mod w], the paper's), ``random`` (a ratio of W per block and
            epoch) or ``uniform`` (any state of the block's trajectory, per epoch: CLLM's Algorithm 2, for
            ``method=cllm_packed``).
    """

    def __init__(self, block_size: int | None = None, noise_window: int = 16, noise_schedule: str = "progressive",
                 **kwargs):
        super().__init__(**kwargs)
        check_count("method.n_tokens", block_size, optional=True)
        check_count("data.noise_window", noise_window)
        if noise_schedule not in NOISE_SCHEDULES:
            raise ConfigError(f"data.noise_schedule={noise_schedule!r}: choose one of {list(NOISE_SCHEDULES)}")
        if self.ar_target != "generated":
            raise ConfigError(f"data.ar_target={self.ar_target!r}: Jacobi Forcing's AR loss reads the clean blocks, "
                              "the generated answer; use ar_target=generated")
        self.block_size, self.noise_window, self.noise_schedule = block_size, noise_window, noise_schedule

    def items(self, split: str) -> Dataset:
        self.check_block_size(self.block_size or self.n_tokens)
        return _Records(self.records[split], self.noise_window, self.noise_schedule, self.seed,
                        self.max_context_tokens, self.use_augmented)

    def collate(self, items: list[dict]) -> dict:
        rows, width = len(items), max(len(it["ids"]) for it in items)
        batch = {"input_ids": torch.full((rows, width), self.pad_token_id, dtype=torch.long),
                 "position_ids": torch.zeros((rows, width), dtype=torch.long),
                 "streams": torch.full((rows, width), PADDING, dtype=torch.long),
                 "block_ids": torch.full((rows, width), -1, dtype=torch.long),
                 "labels": torch.full((rows, width), IGNORE_INDEX, dtype=torch.long),
                 "attention_mask": torch.zeros((rows, width), dtype=torch.long)}
        batch["blocks"] = torch.tensor([it["blocks"] for it in items], dtype=torch.long)
        pairs = []
        for i, it in enumerate(items):
            size = len(it["ids"])
            for key, seq in (("input_ids", "ids"), ("position_ids", "positions"), ("streams", "streams"),
                             ("block_ids", "block_ids"), ("labels", "labels")):
                batch[key][i, :size] = torch.tensor(it[seq], dtype=torch.long)
            batch["attention_mask"][i, :size] = 1
            base = max((p[3] for p in pairs), default=-1) + 1        # block ids unique in the batch
            pairs += [(i, s, c, base + b) for s, c, b in it["pairs"]]
        batch["pairs"] = torch.tensor(pairs, dtype=torch.long).reshape(-1, 4)
        return batch
