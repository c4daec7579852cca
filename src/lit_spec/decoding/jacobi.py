"""``jacobi``: Jacobi fixed-point decoding of n-token blocks with a KV cache (CLLM, Kou et al. 2024, §3.1, Alg. 3).

The output is cut into consecutive blocks of ``n_tokens`` tokens (output positions [0, n), [n, 2n), ...; the last block
is shorter when ``max_new_tokens`` is not a multiple of n). A block's *state* is a guess of all its n tokens; one Jacobi
iteration is one target forward of [pending token, the state's not-yet-fixed tokens but the last] under a causal mask,
and its argmax at every position is the next state (CLLM eq. 3). With the KV cache (Algorithm 3) the leading tokens of
the new state that are known to be correct are *fixed*: the target's token after the pending one always, plus one more
for every guess that equalled the target's own prediction at its position (``greedy_accept_length``). Fixed tokens
are committed and their KV entries kept; the entries of the false guesses are dropped (holes in a batch, cropped when
every row dropped them), so the next iteration feeds only the remaining tokens: the state shrinks by at least one token
per forward, and the fixed point equals greedy AR decoding token for token.

The first block's first token comes from the prefill (Algorithm 3, line 4); every other token of a block starts as a
guess, made by ``init``: ``prefix`` (uniform random tokens of the row's prompt and output so far: CLLM's "random
tokens from x"), ``random`` (uniform over the vocabulary), ``pad`` (``init_token``, default the pad token) or
``repeat_last`` (the last committed token). Random guesses come from a ``torch.Generator`` seeded with ``seed`` at the
start of every ``generate`` call, so a decode is reproducible.

Batches: every row runs its own blocks and converges on its own; the forward block is right-padded to the longest
row's, and padding never enters the cache. Rows drift out of phase (one fast-forwards, then opens its next 16-token
block while the others are down to a few tokens), and the padding grows with the drift. ``align_blocks=True`` keeps
them in phase: a row whose block reached its fixed point sits idle (fed nothing, counted nowhere) until every row's
block has, and then all open their next blocks together. Any guess gives the same fixed points, so the output is
the same; the trajectories differ only in the random initial guesses drawn (the draw order changes). Trajectory
collection uses it.

``return_trajectory=True`` puts the Jacobi trajectories in ``DecodeOutput.extras["trajectories"]`` (what CLLM's data
collection, Algorithm 1, stores): per prompt a list of blocks, each a list of states (lists of token ids) from the
initial guess to the fixed point, consecutive states distinct; the fixed points concatenated are the row's output.
A block cut short by EOS or ``max_new_tokens`` is reported with its states cut to the tokens that were output.

Counters (``DecodeStats``; the prefill is a target forward that commits one token, as for AR):
- ``fast_forwarded``: tokens committed by a Jacobi iteration beyond the one it always fixes (CLLM §3.3 "fast
  forwarding"). The paper's Table 3 figure, which counts that one token too, is ``extras["fast_forward_count"]``:
  tokens committed per Jacobi iteration.
- ``stationary``: tokens that some iteration predicted correctly while a token before them in the block was still
  wrong, and that stayed unchanged until the block's fixed point (CLLM §3.3 "stationary tokens"); per block in
  ``extras["stationary_count"]`` (Table 3). Counted from the trajectory (``stationary_tokens``).
- ``drafted_tokens`` / ``accepted_tokens``: guess tokens fed / guess tokens committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lit_spec.decoding.base import Decoder, register
from lit_spec.decoding.guesses import GuessMaker
from lit_spec.decoding.masks import causal
from lit_spec.decoding.state import DecodeState
from lit_spec.decoding.verify import greedy_accept_length, require_greedy
from lit_spec.errors import check_count


def stationary_tokens(states: list[list[int]], fixed_point: list[int]) -> int:
    """CLLM §3.3: positions that a predicted state (not the initial guess) got right while an earlier position of the
    same state was wrong, and that kept that token in every later state. ``states`` is a Jacobi trajectory from the
    initial guess to ``fixed_point`` (consecutive states distinct)."""
    prefix = [greedy_accept_length(s, fixed_point) for s in states]   # correct leading tokens of each state
    count = 0
    for i, token in enumerate(fixed_point):
        start = len(states)              # first state of the final run of states that have ``token`` at i
        while start > 0 and states[start - 1][i] == token:
            start -= 1
        first = max(start, 1)            # the initial guess is not a prediction
        if first < len(states) and prefix[first] < i:
            count += 1
    return count


@dataclass
class _Block:
    start: int                         # output index of the block's first token
    tokens: list[int]                  # current state: n (or fewer, at the end) tokens
    fixed: int                         # leading tokens of the state known correct (committed)
    states: list[list[int]] = field(default_factory=list)   # every state since the initial guess


@register("jacobi")
class JacobiDecoder(Decoder):
    greedy_only = True

    def __init__(self, model, n_tokens: int = 16, init: str = "prefix", init_token: int | None = None,
                 seed: int | None = 0, return_trajectory: bool = False, align_blocks: bool = False,
                 temperature: float = 0.0, top_p: float = 1.0, **kwargs):
        super().__init__(model, **kwargs)
        self.n_tokens = check_count("n_tokens", n_tokens)
        require_greedy("jacobi", temperature)    # top_p: taken as every decoder takes it, refused with T
        self.guess = GuessMaker(model, init, init_token, self.pad_token_id, seed)
        self.return_trajectory = bool(return_trajectory)
        self.align_blocks = bool(align_blocks)

    def initial_guess(self, context: list[int], size: int) -> list[int]:
        """Guesses for the ``size`` tokens after ``context`` (the row's prompt and output so far): ``init``'s; a
        subclass may guess otherwise (any guess gives the same output, only the number of forwards changes)."""
        return self.guess(context, size)

    def _decode(self, state: DecodeState) -> dict:
        self.guess.reset()
        batch = state.prompt.size(0)
        prompts = [state.prompt[r][state.prompt_mask[r].bool()].tolist() for r in range(batch)]
        trajectories: list[list[list[list[int]]]] = [[] for _ in range(batch)]
        counts = {"iterations": 0, "blocks": 0}
        blocks: dict[int, _Block] = {}
        idle: set[int] = set()           # align_blocks: rows at their block's fixed point, waiting for the others

        def open_block(row: int, first: bool) -> None:
            out = state.out[row]
            start = len(out) - 1 if first else len(out)
            size = min(self.n_tokens, state.max_new_tokens - start)
            known = out[start:]
            tokens = known + self.initial_guess(prompts[row] + out, size - len(known))
            blocks[row] = _Block(start, tokens, len(known), [list(tokens)])

        def close_block(row: int) -> None:
            block = blocks.pop(row)
            fixed_point = state.out[row][block.start:]
            states: list[list[int]] = []
            for s in block.states:           # cut to the tokens output (EOS / max_new_tokens); drop repeats
                if not states or s[: len(fixed_point)] != states[-1]:
                    states.append(s[: len(fixed_point)])
            if states[-1] != fixed_point:
                raise RuntimeError(f"jacobi: block did not end at its fixed point ({states[-1]} vs {fixed_point})")
            state.stats.stationary += stationary_tokens(states, fixed_point)
            counts["blocks"] += 1
            trajectories[row].append(states)

        def advance(rows: list[int]) -> None:
            """After a commit: close blocks that are complete or whose row finished, open the next ones."""
            active = set(state.active)
            for row in rows:
                block = blocks.get(row)
                if block is not None and (row not in active or block.fixed >= len(block.tokens)):
                    close_block(row)
                    if row in active:
                        idle.add(row)
            if not self.align_blocks or not blocks.keys() & active:   # aligned: once every active row is done
                for row in sorted(idle & active):
                    open_block(row, first=False)
                idle.clear()

        first = state.prefill().argmax(-1).tolist()
        rows = list(state.active)
        state.commit([[t] for t in first], advance=[0] * batch)
        for row in rows:
            open_block(row, first=True)
        advance(rows)

        device = state.prompt.device
        while not state.finished:
            rows = list(state.active)
            inputs = []
            for row in rows:     # [pending token (the row's last output), the block's unfixed guesses but the last]
                block = blocks.get(row)
                inputs.append([] if block is None else      # idle (align_blocks): all padding, nothing kept
                              state.out[row][-1:] + block.tokens[block.fixed: len(block.tokens) - 1])
            lengths = torch.tensor([len(x) for x in inputs], device=device)
            q = max(len(x) for x in inputs)
            ids = torch.tensor([x + [self.pad_token_id] * (q - len(x)) for x in inputs], device=device)
            slots = torch.arange(q, device=device)[None]
            real = slots < lengths[:, None]
            # right padding of shorter rows: after every real token (causal: never seen), at depth 0, never kept
            predicted = state.forward(ids, causal(q, device), torch.where(real, slots, 0)).argmax(-1).tolist()
            # fixed this iteration: the pending token's prediction and every guess that equalled it (0 when idle)
            fixed = [greedy_accept_length(x[1:], p) + 1 if x else 0 for x, p in zip(inputs, predicted)]
            state.keep_prefix(q, fixed)
            before = [len(state.out[row]) for row in rows]
            state.commit([predicted[r][: fixed[r]] for r in range(len(rows))], advance=fixed,
                         drafted=[max(len(x) - 1, 0) for x in inputs])
            stats = state.stats
            busy = [(r, row) for r, row in enumerate(rows) if inputs[r]]
            for r, row in busy:
                block, n_in = blocks[row], len(inputs[r])
                block.tokens[block.fixed:] = predicted[r][:n_in]          # the next Jacobi state
                committed = len(state.out[row]) - before[r]
                block.fixed += committed
                block.states.append(list(block.tokens))
                stats.fast_forwarded += committed - 1
            counts["iterations"] += len(busy)
            advance(rows)

        extras = {
            "fast_forward_count": (state.stats.fast_forwarded + counts["iterations"]) / counts["iterations"]
            if counts["iterations"] else 0.0,
            "stationary_count": state.stats.stationary / counts["blocks"] if counts["blocks"] else 0.0,
            "jacobi_iterations": counts["iterations"],
            "blocks": counts["blocks"],
        }
        if self.return_trajectory:
            extras["trajectories"] = trajectories
        return extras
