"""The state every decoder shares: per-row committed tokens, the KV cache, which cache positions are valid.

Convention: the cache holds every committed token but the last one, the *pending* token. Each target forward feeds
a block whose first token is the pending one, followed by whatever the method proposes (draft tokens, a Jacobi guess,
tree nodes); the logits at a block position predict the token after it. After verification the decoder commits the
accepted tokens and marks which block positions stay in the cache; rejected ones become masked holes (batch) or are
cropped away (when every row rejected them), so the cache always equals the cache of the accepted prefix.

With ``record_hidden`` the state also keeps ``hidden``: the target's last-layer hidden states (what its LM head
reads) of the positions the last step added to the cache (the prompt after ``prefill``, the pending token and the
accepted path after ``keep_path``): what draft heads on the target (Medusa, Chimera) read. ``record_hidden`` may
instead name ``hidden_states`` indices, whose states are concatenated (EAGLE-3's low, middle and high features).
"""

from __future__ import annotations

import inspect

import torch

from lit_spec.decoding import cache as kv
from lit_spec.decoding.fast import FastForward, StaticRow
from lit_spec.decoding.masks import attention_mask, causal
from lit_spec.decoding.stats import DecodeStats
from lit_spec.errors import ConfigError


def eos_ids(eos_token_id: int | list[int] | None) -> set[int]:
    """``eos_token_id`` as transformers takes it (one id, several, or none) -> the set of ids that end a row."""
    if eos_token_id is None:
        return set()
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first one in ``eos`` (all of them when none is)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def selects_logits(model) -> bool:
    """transformers' causal LMs compute logits only where asked (``logits_to_keep``); others get sliced after."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


class DecodeState:
    def __init__(self, model, input_ids: torch.Tensor, attention_mask_2d: torch.Tensor | None,
                 max_new_tokens: int, eos_token_id: int | list[int] | None,
                 record_hidden: bool | tuple[int, ...] = False):
        if input_ids.dim() != 2 or input_ids.size(1) == 0:
            raise ConfigError(f"input_ids must be a non-empty [batch, length] tensor, got shape {tuple(input_ids.shape)}")
        if attention_mask_2d is None:
            attention_mask_2d = torch.ones_like(input_ids)
        if (attention_mask_2d.sum(-1) == 0).any():
            raise ConfigError("a prompt in the batch is empty (its attention mask is all zeros)")
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={max_new_tokens}: must be at least 1")
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and input_ids.size(1) + max_new_tokens > limit:
            raise ConfigError(f"prompt ({input_ids.size(1)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                              f"model's context of {limit} positions")
        self.model = model
        self.prompt, self.prompt_mask = input_ids, attention_mask_2d
        self.max_new_tokens = max_new_tokens
        self.eos = eos_ids(eos_token_id)
        self.cache = self._new_cache()
        self.out: list[list[int]] = [[] for _ in range(input_ids.size(0))]
        self.active = list(range(input_ids.size(0)))     # original row index of each row still in the batch
        self.stats = DecodeStats()
        self.past_valid = attention_mask_2d.bool()
        self.next_pos = attention_mask_2d.sum(-1)          # position id of each active row's pending token
        self.pending: torch.Tensor | None = None
        self.record_hidden = record_hidden
        self.hidden: torch.Tensor | None = None            # [B, positions, d · layers] (``record_hidden``)
        self.dtype = next(model.parameters()).dtype
        self.model_selects_logits = selects_logits(model)

    def _new_cache(self):
        return kv.new_cache(self.model)

    def prompt_positions(self) -> torch.Tensor:
        """The prompt tokens' position ids: a left-padded row's first real token is at 0."""
        return (self.prompt_mask.cumsum(-1) - 1).clamp(min=0)

    # ---- forwards -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self) -> torch.Tensor:
        """Run the prompts; returns the logits of their last position ([B, V]) to pick the first new token."""
        with self.stats.timed("forward_time", self.prompt.device):
            logits = self._run(self.prompt, self.prompt_mask, self.prompt_positions(),
                               logits_at=torch.tensor([self.prompt.size(1) - 1]))
        return logits[:, -1]

    @torch.no_grad()
    def forward(self, block: torch.Tensor, visible: torch.Tensor, depth: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Feed ``block`` [B, q] (``block[:, 0]`` the pending tokens) with block visibility ``visible``; returns logits
        [B, q, V]. ``depth`` ([q] or [B, q]) gives positions relative to the pending token (default 0..q-1).
        ``logits_at`` (1-D block offsets): compute the logits of these positions only (``[B, len(logits_at), V]``),
        sparing the LM head the rows a method does not read."""
        q = block.size(1)
        if depth is None:
            depth = torch.arange(q, device=block.device)
        position_ids = self.next_pos[:, None] + depth
        mask = attention_mask(self.past_valid, visible.to(block.device), self.dtype)
        with self.stats.timed("forward_time", block.device):
            logits = self._run(block, mask, position_ids, logits_at)
        self.past_valid = torch.cat([self.past_valid, torch.ones_like(block, dtype=torch.bool)], dim=1)
        return logits

    @torch.no_grad()
    def forward_next(self) -> torch.Tensor:
        """One plain step (AR): the pending tokens alone; returns their logits [B, V]. A 2-D mask over the cache's
        valid positions is enough here: no block to shape."""
        b = len(self.active)
        mask = torch.cat([self.past_valid, self.past_valid.new_ones(b, 1)], 1)
        with self.stats.timed("forward_time", mask.device):
            out = self.model(input_ids=self.pending[:, None], position_ids=self.next_pos[:, None],
                             attention_mask=mask.long(), **kv.cache_argument(self.model, self.cache), use_cache=True)
        self.past_valid = mask
        return out.logits[:, -1]

    def _run(self, ids, mask, position_ids, logits_at: torch.Tensor | None) -> torch.Tensor:
        kwargs = {"output_hidden_states": True} if self.record_hidden else {}
        if logits_at is not None and self.model_selects_logits:
            kwargs["logits_to_keep"] = logits_at.to(ids.device)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids,
                         **kv.cache_argument(self.model, self.cache), use_cache=True, **kwargs)
        self._record_hidden(out, ids.size(1))
        logits = out.logits
        return logits if logits_at is None or self.model_selects_logits else logits[:, logits_at.to(ids.device)]

    def _record_hidden(self, out, q: int) -> None:
        if self.record_hidden:
            layers = (-1,) if self.record_hidden is True else self.record_hidden
            self.hidden = torch.cat([out.hidden_states[t][:, :q] for t in layers], dim=-1)

    # ---- committing -----------------------------------------------------------------------------------------
    def keep_prefix(self, q: int, kept: list[int]) -> None:
        """After a forward of ``q`` tokens: row r keeps the first ``kept[r]`` of them in the cache (the pending token
        and the accepted ones); the rest become holes, and the tail no row kept is cropped away."""
        start = self.past_valid.size(1) - q
        for r, k in enumerate(kept):
            if k < q:
                self.past_valid[r, start + k:] = False
        if max(kept) < q:
            kv.crop(self.cache, start + max(kept))
            self.past_valid = self.past_valid[:, : start + max(kept)]

    def keep_path(self, q: int, keep: list[int]) -> None:
        """After a forward of ``q`` tokens (batch size 1, tree verification): keep only the block offsets ``keep``
        (increasing: the pending token and the accepted path), moved to a contiguous run after the past."""
        start = self.past_valid.size(1) - q
        kv.keep_positions(self.cache, start, keep)
        if self.hidden is not None:
            self.hidden = self.hidden[:, keep]
        self.past_valid = self.past_valid[:, : start + len(keep)]
        self.past_valid[:, start:] = True

    def require_single_row(self, method: str) -> None:
        if self.prompt.size(0) != 1:
            raise ConfigError(f"decoding method {method!r} supports batch size 1 only, got {self.prompt.size(0)} "
                              "prompts: decode them one at a time")

    def commit(self, tokens: list[list[int]], advance: list[int], drafted: list[int] | None = None) -> None:
        """Append ``tokens[r]`` to active row r (cut at EOS / max_new_tokens); the last committed token becomes the
        row's pending token. ``advance[r]``: how many of the row's positions entered the cache in this step.

        ``tokens[r]`` is the accepted proposals followed by the target's own next token (empty for a row that sat
        idle in the forward: it is not counted); ``drafted[r]`` the number of tokens proposed for verification.
        Accepted tokens are counted as they are *output* (after the cut), so ``new_tokens == row_forwards +
        accepted_tokens`` for every method.
        """
        counts, pending = [], []
        for r, new in enumerate(tokens):
            if drafted is not None:
                self.stats.drafted_tokens += drafted[r]
            if not new:  # an idle row (it waited in this forward, e.g. Jacobi's aligned blocks): nothing to count
                pending.append(self.out[self.active[r]][-1])
                continue
            row = self.out[self.active[r]]
            room = self.max_new_tokens - len(row)
            new = until_eos(new[:room], self.eos)
            row.extend(new)
            counts.append(len(new))
            if drafted is not None:
                self.stats.accepted_tokens += len(new) - 1  # every forward yields one token of its own
            pending.append(row[-1])
        self.stats.commit(counts)
        device = self.next_pos.device
        self.next_pos = self.next_pos + torch.tensor(advance, device=device)
        self.pending = torch.tensor(pending, device=device)
        self._drop_finished()

    def row_done(self, r: int) -> bool:
        row = self.out[self.active[r]]
        return len(row) >= self.max_new_tokens or (bool(row) and row[-1] in self.eos)

    def _drop_finished(self) -> None:
        keep = [r for r in range(len(self.active)) if not self.row_done(r)]
        if len(keep) == len(self.active):
            return
        idx = torch.tensor(keep, device=self.next_pos.device, dtype=torch.long)
        if keep:
            self._keep_rows(idx)
        self.active = [self.active[r] for r in keep]
        self.next_pos, self.pending = self.next_pos[idx], self.pending[idx]

    def _keep_rows(self, idx: torch.Tensor) -> None:
        """Only the active rows ``idx`` stay in the cache."""
        kv.select_rows(self.cache, idx)
        self.past_valid = self.past_valid[idx]

    @property
    def finished(self) -> bool:
        return not self.active

    # ---- result ---------------------------------------------------------------------------------------------
    def sequences(self, pad_token_id: int) -> torch.Tensor:
        """Prompts followed by their new tokens, right-padded with ``pad_token_id`` (as ``model.generate`` returns)."""
        width = max(len(o) for o in self.out)
        new = torch.full((len(self.out), width), pad_token_id, dtype=self.prompt.dtype, device=self.prompt.device)
        for r, o in enumerate(self.out):
            new[r, : len(o)] = torch.tensor(o, dtype=self.prompt.dtype)
        return torch.cat([self.prompt, new], dim=1)


class FastDecodeState(DecodeState):
    """``DecodeState`` on the fast path (``lit_spec.decoding.fast``): the cache is the engine's static one, followed by
    a ``StaticRow``. A batch (AR, Jacobi) keeps its shape to the end, every forward over all its rows, so that one
    compiled width serves the whole decode: a finished row rides along with padding, its outputs unread."""

    def __init__(self, engine: FastForward, model, input_ids, attention_mask_2d, max_new_tokens, eos_token_id,
                 record_hidden=False):
        self.engine = engine
        super().__init__(model, input_ids, attention_mask_2d, max_new_tokens, eos_token_id, record_hidden)
        self.slots = torch.arange(input_ids.size(0), device=input_ids.device)   # each active row's row in the batch

    def _new_cache(self):
        self.row = StaticRow(self.engine, self.engine.positions(self.prompt.size(1), self.max_new_tokens),
                             next(self.model.parameters()).dtype, self.prompt.device, self.prompt.size(0))
        return self.row.cache

    @property
    def length(self) -> int:
        return self.row.length

    @property
    def riding(self) -> bool:
        """Some of the batch's rows have finished and ride along."""
        return len(self.slots) < self.prompt.size(0)

    @torch.no_grad()
    def prefill(self) -> torch.Tensor:
        n = self.prompt.size(1)
        valid = self.prompt_mask.bool()
        # a padding entry sees itself, so that no row of the softmax is empty (its output is never read)
        visible = causal(n, self.prompt.device) & (valid[:, None, :] | torch.eye(n, dtype=torch.bool,
                                                                                 device=valid.device))
        with self.stats.timed("forward_time", self.prompt.device):
            out = self.row.run(self.prompt, visible, self.prompt_positions(), bool(self.record_hidden),
                               slice(n - 1, n), valid=valid, eager=True)
        self._record_hidden(out, n)
        return out.logits[:, -1]

    @torch.no_grad()
    def forward(self, block, visible, depth=None, logits_at=None) -> torch.Tensor:
        q = block.size(1)
        if depth is None:
            depth = torch.arange(q, device=block.device)
        positions = self.next_pos[:, None] + depth
        if self.riding:     # finished rows ride along: padding at position 0
            block, positions = (t.new_zeros(self.prompt.size(0), q).index_copy_(0, self.slots, t)
                                for t in (block, positions))
        with self.stats.timed("forward_time", block.device):
            out = self.row.run(block, visible, positions, bool(self.record_hidden), slice(0, q))
        self._record_hidden(out, q)
        logits = out.logits[self.slots, :q] if self.riding else out.logits[:, :q]
        return logits if logits_at is None else logits[:, logits_at.to(logits.device)]

    def forward_next(self) -> torch.Tensor:
        return self.forward(self.pending[:, None], causal(1, self.pending.device))[:, -1]

    def _record_hidden(self, out, q: int) -> None:
        super()._record_hidden(out, q)
        if self.hidden is not None and self.riding:
            self.hidden = self.hidden[self.slots]

    def keep_prefix(self, q: int, kept: list[int]) -> None:
        every = [0] * self.prompt.size(0)       # a finished row keeps nothing
        for slot, k in zip(self.slots.tolist(), kept):
            every[slot] = k
        self.row.keep_prefix(q, every)

    def keep_path(self, q: int, keep: list[int]) -> None:
        self.row.keep_path(q, keep)
        if self.hidden is not None:
            self.hidden = self.hidden[:, keep]

    def _keep_rows(self, idx: torch.Tensor) -> None:
        self.slots = self.slots[idx]
