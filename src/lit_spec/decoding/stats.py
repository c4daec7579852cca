"""Decoding statistics, counted in one place and the same way for every method and for the AR baseline.

A *target forward* is one call of the target model (the prefill included: it commits the first new token), counted
once per active batch row in ``row_forwards``. τ (``mean_accepted``) = new tokens / row forwards: 1.0 for AR.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch


def sync_device(device: torch.device) -> None:
    """Wait for queued GPU work, so that a host clock read afterwards measures it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class DecodeStats:
    new_tokens: int = 0            # tokens committed to the outputs (all rows, EOS included, padding not)
    target_forwards: int = 0       # calls of the target model
    row_forwards: int = 0          # target calls x rows still decoding in them
    draft_forwards: int = 0        # calls of a draft model (speculative, Ouroboros)
    drafted_tokens: int = 0        # tokens proposed for verification (draft tokens, guesses, tree nodes on the path)
    accepted_tokens: int = 0       # proposed tokens that verification accepted
    wall_time: float = 0.0         # seconds, measured around the whole decode (synchronised on CUDA)
    forward_time: float = 0.0      # seconds inside target forwards (the rest of wall_time is drafting + engine)
    draft_time: float = 0.0        # seconds inside draft forwards
    compile_time: float = 0.0      # seconds of wall_time spent compiling a new block width (engine=compiled)
    fast_forwarded: int = 0        # Jacobi (CLLM Table 3): tokens beyond the first committed by one iteration
    stationary: int = 0            # Jacobi: tokens that were correct before their prefix was, and stayed so
    accepted_per_forward: list[int] = field(default_factory=list)  # tokens committed per row forward

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / self.row_forwards if self.row_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time else 0.0

    @property
    def engine_overhead(self) -> float:
        """Share of the wall time spent outside model forwards: masks, verification, bookkeeping."""
        return 1.0 - (self.forward_time + self.draft_time) / self.wall_time if self.wall_time else 0.0

    @contextmanager
    def timed(self, field_name: str, device: torch.device):
        """Add the duration of the block (synchronised on CUDA) to ``forward_time`` or ``draft_time``."""
        sync_device(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            sync_device(device)
            setattr(self, field_name, getattr(self, field_name) + time.perf_counter() - start)

    def commit(self, counts: list[int]) -> None:
        """Record one target forward that committed ``counts[r]`` tokens to each still-active row r."""
        self.target_forwards += 1
        self.row_forwards += len(counts)
        self.new_tokens += sum(counts)
        self.accepted_per_forward.extend(counts)

    def __add__(self, other: "DecodeStats") -> "DecodeStats":
        out = DecodeStats()
        for k, v in asdict(self).items():
            setattr(out, k, v + getattr(other, k))
        return out

    def summary(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "accepted_per_forward"}
        d.update(mean_accepted=self.mean_accepted, acceptance_rate=self.acceptance_rate,
                 tokens_per_s=self.tokens_per_s, engine_overhead=self.engine_overhead)
        return d
