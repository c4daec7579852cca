"""``lookahead``: lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding"). Lossless, batch size 1, no draft model: one target forward per step runs two branches.

- **Lookahead branch**: a 2D window of ``ngram - 1`` levels of ``window`` tokens, the last Jacobi iterations of a
  window of future positions. Level l (1-based) column j sits at ``l + j`` positions after the pending token and sees
  the pending token, level 1's columns 0..j and the levels 2..l of its own column: so each column, read upwards, is a
  chain of consecutive positions, and the model's prediction on top of it completes an n-gram (level 1..N-1 tokens +
  the prediction). Those W n-grams go to the **n-gram pool** (``phrases.PhrasePool`` keyed by their first token; at
  most ``guesses`` per key, the least recently seen dropped first); then level 1 is dropped, the levels move down and
  the predictions become the new top level. The window starts from one level of ``init`` guesses
  (``window + ngram - 2`` tokens) and grows a level per step (losing its first column each time) until it has
  ``ngram - 1`` levels, as in the reference implementation.
- **Verification branch**: up to ``guesses`` pool n-grams that start with the pending token, their other N-1 tokens fed
  as branches from the pending token (positions 1..N-1). The longest branch prefix that equals the model's own argmax
  is accepted, plus the model's next token; only the accepted branch's KV entries stay in the cache. At temperature
  > 0 the branches are verified by the paper's sampling verification (``verify_branches``), which keeps the model's
  distribution; the window still guesses greedily (a guess only drafts).

Every block token's visibility is the ancestor set of a tree (``masks.from_parents``), its position its depth.
Counters: ``drafted_tokens`` = the longest verified branch per step (like a tree's depth), ``accepted_tokens`` = the
branch tokens committed. ``pool_from_prompt=True`` also seeds the pool with the prompt's n-grams (an option of the
reference implementation, off in the paper's algorithm).

The step (``lookahead_step``) runs over any model call, so Ouroboros drafts with it on its draft model (§3.1).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from lit_spec.decoding.base import Decoder, register
from lit_spec.decoding.guesses import GuessMaker
from lit_spec.decoding.masks import depths, from_parents
from lit_spec.decoding.phrases import PhrasePool
from lit_spec.decoding.state import DecodeState
from lit_spec.decoding.verify import RejectionSampling, draw, greedy_accept_length, rejection_sampler
from lit_spec.errors import ConfigError, check_count


class LookaheadLayout:
    """The block of one step: [chain, lookahead levels (level-major), verification branches]. The chain is the
    pending token, after the committed tokens the cache still lacks (``chain - 1`` of them: Ouroboros's draft
    catching up with what the target accepted); the window and the branches hang off the pending token."""

    def __init__(self, levels: int, width: int, branch_lengths: list[int], chain: int = 1):
        self.levels, self.width = levels, width
        self.pending = chain - 1
        self.window_start = chain
        parents = list(range(-1, chain - 1))
        for level in range(levels):
            for col in range(width):
                if level:
                    parents.append(self.window_index(level - 1, col))
                else:
                    parents.append(self.window_index(0, col - 1) if col else self.pending)
        self.branches: list[list[int]] = []
        for length in branch_lengths:
            idx = []
            for k in range(length):
                parents.append(idx[-1] if idx else self.pending)
                idx.append(len(parents) - 1)
            self.branches.append(idx)
        self.parents = parents
        self.depths = depths(parents)
        top = [self.window_index(levels - 1, col) for col in range(width)] if levels else []
        self.read = [self.pending] + top + [i for b in self.branches for i in b]

    def window_index(self, level: int, col: int) -> int:
        return self.window_start + level * self.width + col

    def __len__(self) -> int:
        return len(self.parents)


@functools.lru_cache(maxsize=256)
def layout_of(levels: int, width: int, branch_lengths: tuple[int, ...], chain: int,
              device: torch.device) -> tuple[LookaheadLayout, torch.Tensor]:
    """A step's layout and its visibility, built once per shape (a handful of shapes recur)."""
    layout = LookaheadLayout(levels, width, list(branch_lengths), chain)
    return layout, from_parents(layout.parents, device)


class LookaheadWindow:
    """The lookahead branch's window (module doc): ``levels`` of guesses for the positions after the pending token."""

    def __init__(self, width: int, ngram: int, guess: GuessMaker):
        self.width, self.ngram, self.guess = width, ngram, guess
        self.levels: list[list[int]] = []

    def reset(self, context: list[int]) -> None:
        """A fresh window of guesses for the tokens after ``context`` (seeded guesses: every decode alike)."""
        self.guess.reset()
        self.levels = [self.guess(context, self.width + self.ngram - 2)]

    def advance(self, top: list[int], pool: PhrasePool) -> None:
        """One Jacobi iteration: ``top`` (the model's predictions above the top level) completes a column's n-gram
        once the window is full; the lowest level is dropped and ``top`` becomes the new top level."""
        if len(self.levels) == self.ngram - 1:
            for c in range(self.width):
                pool.add([level[c] for level in self.levels] + [top[c]])
            self.levels = self.levels[1:] + [top]
        else:
            self.levels = [level[1:] for level in self.levels] + [top[1:]]


class LookaheadStep(NamedTuple):
    tokens: list[int]      # committed: the accepted branch prefix, then the model's next token
    keep: list[int]        # block offsets whose keys/values stay: the chain and the accepted path
    drafted: int           # the longest verified branch (0: none)
    fed: int               # block length


# run(tokens, visible [q, q], depths, read offsets) -> the model's logits at the read offsets [len(read), V]
Run = Callable[[list[int], torch.Tensor, list[int], list[int]], torch.Tensor]


def lookahead_step(run: Run, chain: list[int], window: LookaheadWindow | None, pool: PhrasePool, guesses: int,
                   room: int, last_depth: int | None, device,
                   sampler: RejectionSampling | None = None) -> LookaheadStep:
    """One step over the block [chain, window, up to ``guesses`` pool branches of the pending token ``chain[-1]``]:
    verify the branches, advance the window. ``room``: tokens the step may still commit; ``last_depth``: the largest
    depth whose position is inside the model's context (window tokens beyond it are clamped). With a ``sampler`` the
    branches are verified by rejection sampling, greedily otherwise; the window always guesses greedily."""
    pending = chain[-1]
    branches = [list(c[: room - 1]) for c in pool.get(pending, guesses)] if room > 1 and guesses else []
    branches = [b for b in branches if b]
    levels = window.levels if window is not None else []
    width = len(levels[0]) if levels else 0
    layout, visible = layout_of(len(levels), width, tuple(len(b) for b in branches), len(chain), device)
    tokens = chain + [t for level in levels for t in level] + [t for b in branches for t in b]
    depth = layout.depths if last_depth is None else [min(d, last_depth) for d in layout.depths]
    logits = run(tokens, visible, depth, layout.read)
    predicted = dict(zip(layout.read, logits.argmax(-1).tolist()))
    path, extra = verify_branches(layout, tokens, logits, predicted, sampler)
    if window is not None and levels:
        window.advance([predicted[layout.window_index(len(levels) - 1, c)] for c in range(width)], pool)
    committed = [tokens[i] for i in path] + [extra]
    return LookaheadStep(committed, list(range(len(chain))) + path, max(map(len, branches), default=0), len(layout))


def verify_branches(layout: LookaheadLayout, tokens: list[int], logits: torch.Tensor, predicted: dict[int, int],
                    sampler: RejectionSampling | None) -> tuple[list[int], int]:
    """The accepted branch prefix (block offsets) and the token after it. Greedy: the longest prefix equal to the
    model's argmax (``predicted`` at each read offset). Sampled: the Lookahead paper's sampling verification (§3.3,
    after SpecInfer), i.e. ``RejectionSampling`` over the tree [pending, branches], n-grams sharing a prefix merged."""
    if sampler is not None:
        nodes = [layout.pending] + [i for idx in layout.branches for i in idx]
        at = {offset: n for n, offset in enumerate(nodes)}
        rows = {offset: r for r, offset in enumerate(layout.read)}
        path, extra = sampler.choose([-1] + [at[layout.parents[i]] for i in nodes[1:]], [tokens[i] for i in nodes],
                                     logits[[rows[i] for i in nodes]])
        return [nodes[n] for n in path], extra
    path = []
    for idx in layout.branches:
        n = greedy_accept_length([tokens[i] for i in idx], [predicted[i] for i in [layout.pending] + idx[:-1]])
        if n > len(path):
            path = idx[:n]
    return path, predicted[path[-1] if path else layout.pending]


@register("lookahead")
class LookaheadDecoder(Decoder):
    def __init__(self, model, window: int = 5, ngram: int = 4, guesses: int = 5, init: str = "prefix",
                 init_token: int | None = None, seed: int | None = 0, pool_from_prompt: bool = False,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, **kwargs):
        super().__init__(model, **kwargs)
        self.window = check_count("window", window)
        self.ngram = check_count("ngram", ngram)
        self.guesses = check_count("guesses", guesses)
        if self.ngram < 2:
            raise ConfigError(f"ngram={ngram!r}: the n-gram size N must be >= 2 (N - 1 lookahead levels, n-grams of "
                              "a first token and at least one more)")
        self.sampler = rejection_sampler(temperature, top_p, top_k, seed, model.device)
        self.guess = GuessMaker(model, init, init_token, self.pad_token_id, seed)
        self.pool_from_prompt = bool(pool_from_prompt)

    def _decode(self, state: DecodeState) -> dict:
        state.require_single_row(self.name)
        device = state.prompt.device
        prompt = state.prompt[0][state.prompt_mask[0].bool()].tolist()
        pool = PhrasePool(self.guesses)
        if self.pool_from_prompt:
            for i in range(len(prompt) - self.ngram + 1):
                pool.add(prompt[i: i + self.ngram])
        limit = getattr(self.model.config, "max_position_embeddings", None)

        def run(tokens, visible, depth, read):
            return state.forward(torch.tensor([tokens], device=device), visible, torch.tensor([depth], device=device),
                                 logits_at=torch.tensor(read, device=device))[0]

        state.commit([[draw(self.sampler, state.prefill()[0])]], advance=[0])
        window = LookaheadWindow(self.window, self.ngram, self.guess)
        window.reset(prompt + state.out[0])
        steps = 0
        while not state.finished:
            room = state.max_new_tokens - len(state.out[0])
            # window tokens near the end of the context: keep their positions in range
            last = None if limit is None else max(limit - 1 - int(state.next_pos[0]), 0)
            step = lookahead_step(run, state.out[0][-1:], window, pool, self.guesses, room, last, device,
                                  self.sampler)
            state.keep_path(step.fed, step.keep)
            state.commit([step.tokens], advance=[len(step.keep)], drafted=[step.drafted])
            steps += 1
        return {"pool_size": len(pool), "steps": steps}
