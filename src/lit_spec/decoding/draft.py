"""A draft model's own KV cache following one row's committed tokens (batch size 1): the token source of speculative
decoding and the default candidate source of tree verification.

The cache holds ``ids``: a prefix of the committed sequence (prompt + new tokens) followed by the last round's
drafts. ``propose`` rolls it back to the part that is still committed (``cache.crop``), feeds the committed tokens
it has not seen yet as one block, then drafts autoregressively, one draft forward per token. So the draft's cache
always equals the cache of the tokens it holds, and the prompt is read once.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from lit_spec.decoding import cache as kv
from lit_spec.decoding.fast import FastForward, StaticRow
from lit_spec.decoding.masks import attention_mask, causal
from lit_spec.decoding.state import selects_logits
from lit_spec.decoding.stats import sync_device
from lit_spec.errors import ConfigError


def vocab_size(model) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return int(weight.size(0)) if weight is not None else int(model.config.vocab_size)


def check_draft(target, draft, method: str) -> None:
    """A draft must exist and score the target's vocabulary (its tokens are fed to the target as they are)."""
    if draft is None:
        raise ConfigError(f"decoding method {method!r} needs a draft_model")
    tv, dv = vocab_size(target), vocab_size(draft)
    if tv != dv:
        raise ConfigError(f"{method}: draft vocabulary ({dv} tokens) differs from the target's ({tv}); the draft must "
                          "share the target's tokenizer")


def check_context(draft_model, state, method: str) -> None:
    limit = getattr(draft_model.config, "max_position_embeddings", None)
    need = state.prompt.size(1) + state.max_new_tokens
    if limit is not None and need > limit:
        raise ConfigError(f"{method}: prompt + max_new_tokens ({need}) exceeds the draft model's context of {limit}")


def draft_runner(draft_model, state) -> "DraftRunner":
    """The draft's runner for one decode: on the fast path, on an engine of the same kind, when the target's is."""
    engine = getattr(state, "engine", None)
    if engine is None:
        return DraftRunner(draft_model)
    fast = FastForward.of(draft_model, engine.kind)
    return DraftRunner(draft_model, fast, fast.positions(state.prompt.size(1), state.max_new_tokens))


class DraftRunner:
    def __init__(self, model, fast: FastForward | None = None, positions: int = 0):
        """``fast``: the draft model's fast engine (the target decodes on one too), its static cache holding at
        least ``positions``."""
        self.model = model
        self.row = StaticRow(fast, positions, next(model.parameters()).dtype, self.device) if fast else None
        self.cache = self.row.cache if fast else kv.new_cache(model)
        self.ids: list[int] = []       # tokens whose keys/values are in the cache, in order
        self.committed = 0             # ids[:committed] are known to be committed (never rolled back)
        self.forwards = 0              # draft model calls
        self.seconds = 0.0             # time inside them
        self.dtype = next(model.parameters()).dtype
        self.selects_logits = selects_logits(model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def feed(self, tokens: list[int], visible: torch.Tensor | None = None, depth: list[int] | None = None,
             logits_at: list[int] | None = None) -> torch.Tensor:
        """Feed ``tokens`` after the cached ones and return the draft's logits at the block offsets ``logits_at``
        ([n, V]; default: the last token's, [V]). A plain causal block by default; ``visible`` [q, q] and
        ``depth`` (positions after the cached ones) feed a tree (``keep_path`` then keeps one path of it)."""
        start, device = len(self.ids), self.device
        clock = time.perf_counter()
        positions = torch.arange(start, start + len(tokens), device=device) if depth is None else \
            start + torch.tensor(depth, device=device)
        rows = torch.tensor(logits_at if logits_at is not None else [len(tokens) - 1], device=device)
        block = torch.tensor([tokens], device=device)
        if self.row is not None:
            q = len(tokens)
            out = self.row.run(block, causal(q, device) if visible is None else visible, positions[None], False,
                               slice(0, q), eager=start == 0)      # the prompt runs eager, as the target's does
            logits = out.logits[0, rows]
        else:
            out = self.model(input_ids=block, position_ids=positions[None],
                             attention_mask=self._mask(start, len(tokens), visible),
                             **kv.cache_argument(self.model, self.cache), use_cache=True,
                             **({"logits_to_keep": rows} if self.selects_logits else {}))
            logits = out.logits[0] if self.selects_logits else out.logits[0, rows]
        sync_device(device)
        self.seconds += time.perf_counter() - clock
        self.ids.extend(tokens)
        self.forwards += 1
        return logits if logits_at is not None else logits[-1]

    def _mask(self, start: int, q: int, visible: torch.Tensor | None) -> torch.Tensor:
        """A plain causal block needs only the 2-D mask of the cached and fed tokens; a tree its 4-D visibility."""
        device = self.device
        if visible is None:
            return torch.ones(1, start + q, dtype=torch.long, device=device)
        return attention_mask(torch.ones(1, start, dtype=torch.bool, device=device), visible, self.dtype)

    def keep_path(self, q: int, keep: list[int]) -> None:
        """After feeding a tree of ``q`` tokens, keep only the block offsets ``keep`` (increasing; a root-to-node
        path), moved to follow the cached tokens (``cache.keep_positions``)."""
        start = len(self.ids) - q
        if self.row is not None:
            self.row.keep_path(q, keep)
        else:
            kv.keep_positions(self.cache, start, keep)
        self.ids[start:] = [self.ids[start + k] for k in keep]

    def sync(self, sequence: list[int]) -> int:
        """Roll the cache back to the longest prefix of ``sequence`` it holds (leaving at least one token to feed)."""
        n = min(self.committed, len(self.ids))
        limit = min(len(self.ids), len(sequence) - 1)
        while n < limit and self.ids[n] == sequence[n]:
            n += 1
        n = min(n, limit)
        if self.row is not None:
            self.row.set_length(n)
        else:
            kv.crop(self.cache, n)
        del self.ids[n:]
        self.committed = len(sequence)
        return n

    @torch.no_grad()
    def propose(self, sequence: list[int], n: int,
                choose: Callable[[torch.Tensor], int]) -> tuple[list[int], torch.Tensor]:
        """Draft ``n`` tokens after ``sequence`` (prompt + committed tokens, the pending one last).

        ``choose(logits [V]) -> token`` picks each draft token (argmax, or a sample). Returns the tokens and the
        draft's logits [n, V] at each drafted position (the distribution each token was chosen from)."""
        if n < 1:
            return [], torch.empty(0, vocab_size(self.model), device=self.device)
        start = self.sync(sequence)
        logits = self.feed(sequence[start:])
        tokens, scores = [], [logits]
        for i in range(n):
            tokens.append(int(choose(logits)))
            if i < n - 1:
                logits = self.feed(tokens[-1:])
                scores.append(logits)
        return tokens, torch.stack(scores)
