"""``multiblock``: Jacobi Forcing's multi-block decoding with rejection recycling (Hu et al. 2025, "Fast and Accurate
Causal Parallel Decoding using Jacobi Forcing", arXiv 2512.14681; reference: hao-ai-lab/JacobiForcing, modeling/
cllm2_qwen2_modeling_kv_terminate_on_eos_improved_multiblock_lookahead_unified.py). Greedy, lossless, batch size 1.

The output is cut into blocks of ``n_tokens`` as ``jacobi`` cuts it. The *window* holds guesses for the positions
after the pending token up to the end of the last open block: the block holding the next position is the real-active
one, and up to ``blocks - 1`` pseudo-active blocks may follow it. A block opens (``GuessMaker`` guesses) after the
newest one once that one's provisional convergence (its committed tokens plus its leading guesses that equalled the
last forward's prediction) reaches ceil(spawn_ratio * n_tokens); when the real-active block is all committed, the
next open block becomes the real-active one, guesses kept. An iteration is one target forward of a token tree: the
pending token, the chain of window guesses but the last (a Jacobi iteration of every open block at once), and up to
``pool_size`` recycled branches off the pending token; ``tree.commit_tree`` commits the longest verified path plus the
target's next token, so the output is greedy AR's whatever the guesses. The next window is the Jacobi update (CLLM
eq. 3): the predictions along the winning path where it reaches, the chain's beyond. Rejection recycling: the chain
guesses that the update throws away (from the first rejected one) enter a FIFO of ``pool_size`` entries; a branch is
an entry's tokens after the first occurrence of the pending token. ``blocks=1, pool_size=0`` is ``jacobi`` with the
same guesses, forward for forward. Windows and branches never pass ``max_new_tokens``, so positions stay inside the
context that ``DecodeState`` checked.

Extras: ``iterations`` (forwards after the prefill), ``fast_forward_count`` (tokens committed per iteration, as
``jacobi``'s), ``recycled_tokens`` (tokens committed from recycled branches), ``mean_blocks`` (open blocks per
iteration). ``drafted_tokens`` counts the longest line fed (chain or branch) per forward.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from lit_spec.decoding.base import Decoder, register
from lit_spec.decoding.guesses import GuessMaker
from lit_spec.decoding.lookahead import layout_of
from lit_spec.decoding.state import DecodeState
from lit_spec.decoding.tree import commit_tree
from lit_spec.decoding.verify import greedy_accept_length, require_greedy
from lit_spec.errors import ConfigError, check_count


def branches_from(pool: deque, pending: int, window: list[int], limit: int) -> list[list[int]]:
    """Recycled candidates, newest entry first: the tokens after the pending token's first occurrence, at most
    ``limit``; ones the chain already feeds (a prefix of the window) or another candidate holds are left out."""
    branches: list[list[int]] = []
    for entry in reversed(pool):
        if pending in entry:
            branch = entry[entry.index(pending) + 1:][:limit]
            if branch and branch != window[: len(branch)] and branch not in branches:
                branches.append(branch)
    return branches


def check_settings(n_tokens, blocks, spawn_ratio, pool_size, prefix: str = "") -> None:
    """The decoder's settings, checked without a model (a method offering the decoder checks them before training);
    ``prefix`` names where they were set (``method.``)."""
    check_count(f"{prefix}n_tokens", n_tokens)
    check_count(f"{prefix}blocks", blocks)
    check_count(f"{prefix}pool_size", pool_size, minimum=0)
    if isinstance(spawn_ratio, bool) or not isinstance(spawn_ratio, (int, float)) or not 0 < spawn_ratio <= 1:
        raise ConfigError(f"{prefix}spawn_ratio={spawn_ratio!r}: must be a number in (0, 1] (the share of the newest "
                          "block converged before the next block opens)")


@register("multiblock")
class MultiBlockDecoder(Decoder):
    greedy_only = True

    def __init__(self, model, n_tokens: int = 64, blocks: int = 2, spawn_ratio: float = 0.85, pool_size: int = 4,
                 init: str = "prefix", init_token: int | None = None, seed: int | None = 0,
                 temperature: float = 0.0, top_p: float = 1.0, **kwargs):
        super().__init__(model, **kwargs)
        check_settings(n_tokens, blocks, spawn_ratio, pool_size)
        self.n_tokens, self.blocks, self.pool_size = int(n_tokens), int(blocks), int(pool_size)
        self.spawn_at = math.ceil(spawn_ratio * self.n_tokens)
        require_greedy("multiblock", temperature)    # top_p: taken as every decoder takes it, refused with T
        self.guess = GuessMaker(model, init, init_token, self.pad_token_id, seed)

    def open_blocks(self, start: int, end: int) -> int:
        """Blocks open when the window covers output positions [start, end)."""
        return (end - 1) // self.n_tokens - start // self.n_tokens + 1

    def refill(self, state: DecodeState, prompt: list[int], window: list[int], settled: set[int]) -> list[int]:
        """After a commit: open the block holding the next position if the window ran out, then the block after the
        newest one if that one provisionally converged (``settled``: positions whose guess the last forward
        predicted unchanged) and fewer than ``blocks`` are open."""
        start, n, limit = len(state.out[0]), self.n_tokens, state.max_new_tokens
        context = prompt + state.out[0]
        if not window:
            window = self.guess(context, min((start // n + 1) * n, limit) - start)
        end = start + len(window)
        newest = (end - 1) // n * n
        converged, q = max(start - newest, 0), max(start, newest)
        while q < end and q in settled:
            converged, q = converged + 1, q + 1
        if converged >= self.spawn_at and self.open_blocks(start, end) < self.blocks and end < limit:
            window = window + self.guess(context + window, min(end + n, limit) - end)
        return window

    def iterate(self, state: DecodeState, window: list[int], pool: deque, counts: dict) -> tuple[list[int], set[int]]:
        """One forward of [pending, chain, recycled branches]; commits, recycles the chain's rejected guesses and
        returns the next window (Jacobi update) and the positions whose guess was ``settled``."""
        out, device = state.out[0], state.prompt.device
        start, chain = len(out), window[:-1]
        # branches as long as a block (the reference's draft length), inside the window and the room left
        room = min(self.n_tokens, len(window), state.max_new_tokens - start - 1)
        lines = [chain] + branches_from(pool, out[-1], window, room)
        # lookahead's layout without a window: each line a chain off the pending token, the Jacobi chain first
        layout, visible = layout_of(0, 0, tuple(map(len, lines)), 1, device)
        tokens = out[-1:] + [t for line in lines for t in line]
        logits = state.forward(torch.tensor([tokens], device=device), visible,
                               torch.tensor(layout.depths, device=device))[0]
        step = commit_tree(state, layout.parents, max(map(len, lines)), tokens, logits, len(tokens))
        target = logits.argmax(-1).tolist()
        along = [[target[0]] + [target[i] for i in nodes] for nodes in layout.branches]   # [k][d]: of start + d
        won = next((k for k, nodes in enumerate(layout.branches) if step.path and step.path[0] + 1 in nodes), 0)
        committed = len(out) - start
        counts["iterations"] += 1
        counts["recycled_tokens"] += min(len(step.path), committed) if won else 0
        state.stats.fast_forwarded += committed - 1
        rejected = chain[greedy_accept_length(chain, along[0]):]
        if rejected:
            pool.append(rejected)
        predicted = along[won] + along[0][len(along[won]):]
        settled = {start + d for d, guess in enumerate(window) if guess == along[0][d]}
        return predicted[len(out) - start: len(window)], settled

    def _decode(self, state: DecodeState) -> dict:
        state.require_single_row(self.name)
        self.guess.reset()
        prompt = state.prompt[0][state.prompt_mask[0].bool()].tolist()
        state.commit([[int(state.prefill()[0].argmax(-1))]], advance=[0])
        pool: deque = deque(maxlen=self.pool_size)
        counts = {"iterations": 0, "recycled_tokens": 0, "blocks": 0}
        window = self.refill(state, prompt, [], set()) if not state.finished else []
        while not state.finished:
            counts["blocks"] += self.open_blocks(len(state.out[0]), len(state.out[0]) + len(window))
            window, settled = self.iterate(state, window, pool, counts)
            if not state.finished:
                window = self.refill(state, prompt, window, settled)
        iterations = counts["iterations"]
        return {"iterations": iterations, "recycled_tokens": counts["recycled_tokens"],
                "fast_forward_count": (state.stats.fast_forwarded + iterations) / iterations if iterations else 0.0,
                "mean_blocks": counts["blocks"] / iterations if iterations else 0.0}
