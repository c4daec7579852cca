"""``lookahead``: lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding"). Greedy, lossless, batch size 1, no draft model: one target forward per step runs two branches.

- **Lookahead branch**: a 2D window of ``ngram - 1`` levels of ``window`` tokens, the last Jacobi iterations of a
  window of future positions. Level l (1-based) column j sits at ``l + j`` positions after the pending token and sees
  the pending token, level 1's columns 0..j and the levels 2..l of its own column: so each column, read upwards, is a
  chain of consecutive positions, and the target's prediction on top of it completes an n-gram (level 1..N-1 tokens +
  the prediction). Those W n-grams go to the **n-gram pool** (keyed by their first token; at most ``guesses`` per key,
  the least recently seen dropped first); then level 1 is dropped, the levels move down and the predictions become the
  new top level. The window starts from one level of ``init`` guesses (``window + ngram - 2`` tokens) and grows a level
  per step (losing its first column each time) until it has ``ngram - 1`` levels, as in the reference implementation.
- **Verification branch**: up to ``guesses`` pool n-grams that start with the pending token, their other N-1 tokens fed
  as branches from the pending token (positions 1..N-1). The longest branch prefix that equals the target's own argmax
  is accepted, plus the target's next token; only the accepted branch's KV entries stay in the cache.

Every block token's visibility is the ancestor set of a tree (``masks.from_parents``), its position its depth.
Counters: ``drafted_tokens`` = the longest verified branch per step (like a tree's depth), ``accepted_tokens`` = the
branch tokens committed. ``pool_from_prompt=True`` also seeds the pool with the prompt's n-grams (an option of the
reference implementation, off in the paper's algorithm).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from lit_spec.decoding.base import Decoder, register
from lit_spec.decoding.jacobi import GuessMaker
from lit_spec.decoding.masks import depths, from_parents
from lit_spec.decoding.state import DecodeState
from lit_spec.decoding.verify import greedy_accept_length
from lit_spec.errors import ConfigError, check_count


class NGramPool:
    """n-grams keyed by their first token, at most ``per_key`` each (least recently added or refreshed dropped)."""

    def __init__(self, per_key: int):
        self.per_key = per_key
        self.table: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, ngram) -> None:
        ngram = tuple(int(t) for t in ngram)
        entries = self.table.setdefault(ngram[0], OrderedDict())
        rest = ngram[1:]
        if rest in entries:
            entries.move_to_end(rest)
        else:
            entries[rest] = None
            if len(entries) > self.per_key:
                entries.popitem(last=False)

    def get(self, token: int) -> list[tuple[int, ...]]:
        """The continuations stored for n-grams starting with ``token``, most recent first."""
        return list(reversed(self.table.get(int(token), ())))

    def __len__(self) -> int:
        return sum(len(v) for v in self.table.values())


class LookaheadLayout:
    """The block of one step: [pending token, lookahead levels (level-major), verification branches]."""

    def __init__(self, levels: int, width: int, branch_lengths: list[int]):
        self.levels, self.width = levels, width
        self.window_start = 1
        parents = [-1]
        for level in range(levels):
            for col in range(width):
                if level:
                    parents.append(self.window_index(level - 1, col))
                else:
                    parents.append(self.window_index(0, col - 1) if col else 0)
        self.branches: list[list[int]] = []
        for length in branch_lengths:
            idx = []
            for k in range(length):
                parents.append(idx[-1] if idx else 0)
                idx.append(len(parents) - 1)
            self.branches.append(idx)
        self.parents = parents
        self.depths = depths(parents)
        top = [self.window_index(levels - 1, col) for col in range(width)] if levels else []
        self.read = [0] + top + [i for b in self.branches for i in b]

    def window_index(self, level: int, col: int) -> int:
        return self.window_start + level * self.width + col

    def __len__(self) -> int:
        return len(self.parents)


@register("lookahead")
class LookaheadDecoder(Decoder):
    def __init__(self, model, window: int = 5, ngram: int = 4, guesses: int = 5, init: str = "prefix",
                 init_token: int | None = None, seed: int | None = 0, pool_from_prompt: bool = False,
                 temperature: float = 0.0, **kwargs):
        super().__init__(model, **kwargs)
        self.window = check_count("window", window)
        self.ngram = check_count("ngram", ngram)
        self.guesses = check_count("guesses", guesses)
        if self.ngram < 2:
            raise ConfigError(f"ngram={ngram!r}: the n-gram size N must be >= 2 (N - 1 lookahead levels, n-grams of "
                              "a first token and at least one more)")
        if temperature != 0:
            raise ConfigError(f"lookahead: temperature={temperature}; lookahead decoding here is greedy only "
                              "(temperature 0)")
        self.guess = GuessMaker(model, init, init_token, self.pad_token_id, seed)
        self.pool_from_prompt = bool(pool_from_prompt)
        self._layouts: dict[tuple, tuple[LookaheadLayout, torch.Tensor]] = {}

    def _layout(self, levels: int, width: int, branch_lengths: list[int]) -> tuple[LookaheadLayout, torch.Tensor]:
        """The step's block layout and its visibility, built once per shape (a handful of shapes recur)."""
        key = (levels, width, tuple(branch_lengths))
        if key not in self._layouts:
            layout = LookaheadLayout(levels, width, branch_lengths)
            self._layouts[key] = layout, from_parents(layout.parents, self.model.device)
        return self._layouts[key]

    def _decode(self, state: DecodeState) -> dict:
        if state.prompt.size(0) != 1:
            raise ConfigError(f"decoding method 'lookahead' supports batch size 1 only, got {state.prompt.size(0)} "
                              "prompts: decode them one at a time")
        self.guess.reset()
        device = state.prompt.device
        prompt = state.prompt[0][state.prompt_mask[0].bool()].tolist()
        n, w = self.ngram, self.window
        pool = NGramPool(self.guesses)
        if self.pool_from_prompt:
            for i in range(len(prompt) - n + 1):
                pool.add(prompt[i: i + n])
        limit = getattr(self.model.config, "max_position_embeddings", None)

        state.commit([[int(state.prefill()[0].argmax(-1))]], advance=[0])
        levels = [self.guess(prompt + state.out[0], w + n - 2)]
        steps = 0
        while not state.finished:
            pending = state.out[0][-1]
            room = state.max_new_tokens - len(state.out[0])
            branches = [list(c[: room - 1]) for c in pool.get(pending)[: self.guesses]] if room > 1 else []
            branches = [b for b in branches if b]
            layout, visible = self._layout(len(levels), len(levels[0]), [len(b) for b in branches])
            tokens = [pending] + [t for level in levels for t in level] + [t for b in branches for t in b]
            depth = layout.depths
            if limit is not None:  # window tokens near the end of the context: keep their positions in range
                last = max(limit - 1 - int(state.next_pos[0]), 0)
                depth = [min(d, last) for d in depth]
            ids = torch.tensor([tokens], device=device)
            # logits only where they are read: the pending token, the window's top level, the branches
            read = layout.read
            logits = state.forward(ids, visible, torch.tensor([depth], device=device),
                                   logits_at=torch.tensor(read, device=device))[0]
            predicted_list = [-1] * len(layout)
            for i, t in zip(read, logits.argmax(-1).tolist()):
                predicted_list[i] = t

            # verification branch: the branch with the longest prefix equal to the target's predictions
            best, accepted = -1, 0
            if branches:
                k = max(len(b) for b in branches)
                lengths = [greedy_accept_length(b, [predicted_list[i] for i in [0] + idx[:-1]])
                           for b, idx in zip(branches, layout.branches)]
                best = max(range(len(branches)), key=lambda g: (lengths[g], -g))
                accepted = lengths[best]
            path = layout.branches[best][:accepted] if best >= 0 else []
            commit = branches[best][:accepted] + [predicted_list[path[-1] if path else 0]] if best >= 0 \
                else [predicted_list[0]]
            state.keep_path(len(layout), [0] + path)
            state.commit([commit], advance=[accepted + 1], drafted=[k if best >= 0 else 0])
            steps += 1

            # lookahead branch: collect the window's n-grams, slide it one Jacobi iteration on
            top = [predicted_list[layout.window_index(len(levels) - 1, c)] for c in range(len(levels[0]))]
            if len(levels) == n - 1:
                for c in range(w):
                    pool.add([level[c] for level in levels] + [top[c]])
                levels = levels[1:] + [top]
            else:
                levels = [level[1:] for level in levels] + [top[1:]]
        return {"pool_size": len(pool), "steps": steps}
