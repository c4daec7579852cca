"""Training batches that a resumed run continues exactly: the same batches, in the same order, from where the
checkpoint stood, mid-epoch included (Lightning's stateful-loader interface, ``state_dict`` / ``load_state_dict`` on
the train DataLoader, which it saves in every checkpoint and restores before iterating).

An epoch's order is a function of (seed, epoch) alone (``EpochOrder.order``), so any epoch can be rebuilt; the
loader's state is the epoch and the number of its batches the training loop has consumed, and a restored loader
skips those (indices only: nothing is loaded or collated for them). Under data parallelism the sampler shards the
epoch itself, the way ``DistributedSampler`` does (rank r of w takes every w-th sample), so Lightning does not re-wrap
it and the shards resume the same way: w ranks with batch b see, step by step, the samples of one process with
batch w·b.
"""

from __future__ import annotations

import math

from torch.utils.data import DataLoader, DistributedSampler


def epoch_seed(seed: int, epoch: int) -> int:
    return hash((seed, epoch)) % 2**63


def data_parallel_rank(datamodule) -> tuple[int, int]:
    """(rank, world size) of the trainer a datamodule is attached to; (0, 1) without one."""
    trainer = getattr(datamodule, "trainer", None)
    return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)


class EpochOrder(DistributedSampler):
    """A sampler whose epoch order is ``order(epoch)``; rank ``rank`` of ``world`` takes every ``world``-th sample
    (the order padded with its own start to a multiple of ``world``: every rank takes as many steps); the first
    ``start`` samples of the epoch it was restored in are skipped once. Lightning calls ``set_epoch`` before every
    epoch (a new epoch starts at its first sample). A ``DistributedSampler`` by type only (its ``__init__`` needs a
    process group): Lightning leaves samplers of that type as they are."""

    def __init__(self, size: int, rank: int = 0, world: int = 1):
        self.size, self.rank, self.num_replicas, self.epoch, self.start = size, rank, world, 0, 0

    def order(self, epoch: int) -> list:
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0
        self.epoch = epoch

    def __len__(self) -> int:
        return math.ceil(self.size / self.num_replicas)

    def __iter__(self):
        start, self.start = self.start, 0
        order = self.order(self.epoch)
        order += order[: len(self) * self.num_replicas - len(order)]
        return iter(order[self.rank::self.num_replicas][start:])


class ResumableLoader(DataLoader):
    """A train DataLoader over an ``EpochOrder`` sampler that Lightning checkpoints and restores mid-epoch. Its length
    is known, so Lightning's fetcher takes batches only as the loop consumes them (no prefetch): the batches served
    in the current epoch are the batches consumed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._served = 0

    def __iter__(self):
        self._served = self.sampler.start // self.batch_size if isinstance(self.sampler, EpochOrder) else 0
        for batch in super().__iter__():
            self._served += 1
            yield batch

    def state_dict(self) -> dict:
        if not isinstance(self.sampler, EpochOrder):      # a sampler Lightning put in its place: not resumable here
            return {}
        return {"epoch": self.sampler.epoch, "batches": self._served}

    def load_state_dict(self, state: dict) -> None:
        if state and isinstance(self.sampler, EpochOrder):
            self.sampler.epoch, self.sampler.start = state["epoch"], state["batches"] * self.batch_size
