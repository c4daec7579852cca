"""``ouroboros``: phrase-based drafting for speculative decoding (Zhao et al. 2024, "Ouroboros: Generating Longer
Drafts Phrase by Phrase for Faster Speculative Decoding"). Training-free, lossless, batch size 1. At temperature > 0
the draft still drafts greedily and the target samples its verification tree by rejection with the drafts as point
masses (``verify.RejectionSampling``), as the paper's sampling runs do (§2: draft temperature 0; §4.2, Table 3).

Each round:

1. **Drafting via phrases** (§3.1): the draft model drafts ``gamma`` tokens (or a few more: a step commits whole
   phrases) with lookahead decoding (``lookahead.lookahead_step`` over the draft's own cache: a Jacobi window of
   ``window`` columns completing ``ngram``-grams, and up to ``guesses`` pool phrases of its pending token verified in
   the same draft forward), so a draft forward yields one token or a phrase.
2. **Lengthening via phrases** (§3.2, Eq. 7): up to ``phrases`` (K) pool phrases that start with the last draft token
   extend the draft into K longer drafts.
3. **One target forward** verifies them all (Fig. 3): [pending, d_1..d_γ, branch_1, ..., branch_K], the branches
   sharing positions γ+1.. and each seeing the draft and itself only (``masks.from_parents``). The longest verified
   path is committed plus the target's next token (Eq. 8-9); the cache keeps that path only (``tree.commit_tree``).
4. **Phrases from verification** (§3.3): when the draft is rejected, the sub-segments of its rejected tail that match
   the target's predictions (Fig. 4) become phrases (each with the target's token after it); when the draft is
   accepted whole, every tried phrase but the accepted one is replaced by the target's correction of it.
5. **Reuse across prompts** (§3.4): the pool (``phrases.PhrasePool``) belongs to the decoder and outlives ``generate``
   calls; ``reuse=False`` empties it before every prompt; ``pool_path`` starts from a saved pool.

Switches for the paper's Table 4 ablation: ``draft_lookahead`` (off: the draft drafts token by token),
``lengthen``, ``harvest``, ``reuse``. With all four off this is speculative decoding with ``gamma`` draft tokens.
Counters: a round's ``drafted_tokens`` is its longest branch (draft + longest phrase); ``draft_forwards`` the draft's
lookahead steps.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from lit_spec.decoding.base import Decoder, register
from lit_spec.decoding.draft import DraftRunner, check_context, check_draft, draft_runner
from lit_spec.decoding.guesses import GuessMaker
from lit_spec.decoding.lookahead import LookaheadWindow, lookahead_step
from lit_spec.decoding.masks import depths, from_parents
from lit_spec.decoding.phrases import PhrasePool
from lit_spec.decoding.state import DecodeState
from lit_spec.decoding.tree import commit_tree
from lit_spec.decoding.verify import draw, rejection_sampler
from lit_spec.errors import ConfigError, check_count


@functools.lru_cache(maxsize=512)
def verification_block(draft_len: int, branch_lengths: tuple[int, ...]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Parents, visibility and depths of [pending, d_1..d_n, branch_1, ..., branch_K] (Fig. 3): the draft is a chain
    from the pending token, every branch a chain from the draft's last token. Built once per shape."""
    parents = list(range(-1, draft_len))
    for length in branch_lengths:
        parents += [draft_len] + list(range(len(parents), len(parents) + length - 1))
    return parents, from_parents(parents), torch.tensor(depths(parents))


def matched_segments(draft: list[int], predicted: list[int]) -> list[list[int]]:
    """§3.3, Fig. 4: the runs of a rejected draft tail that equal the target's predictions at the same positions
    (``predicted[i]``: the target's token for position i given the draft before it), each followed by the target's
    token after its last position (``predicted`` has one more entry than ``draft``)."""
    segments, start = [], None
    for i, (d, v) in enumerate(zip(draft, predicted)):
        if d == v and start is None:
            start = i
        if d != v and start is not None:
            segments.append(draft[start:i] + [predicted[i]])
            start = None
    if start is not None:
        segments.append(draft[start:] + [predicted[len(draft)]])
    return segments


@register("ouroboros")
class OuroborosDecoder(Decoder):
    def __init__(self, model, draft_model=None, gamma: int = 4, window: int = 5, ngram: int = 4, guesses: int = 5,
                 phrases: int = 3, pool_capacity: int = 20, draft_lookahead: bool = True, lengthen: bool = True,
                 harvest: bool = True, reuse: bool = True, pool_path: str | None = None, init: str = "prefix",
                 init_token: int | None = None, seed: int | None = 0, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, **kwargs):
        super().__init__(model, **kwargs)
        check_draft(model, draft_model, "ouroboros")
        self.draft_model = draft_model
        self.gamma = check_count("gamma", gamma)
        self.window = check_count("window", window)
        self.ngram = check_count("ngram", ngram)
        self.guesses = check_count("guesses", guesses)
        self.phrases = check_count("phrases", phrases)
        if self.ngram < 2:
            raise ConfigError(f"ngram={ngram!r}: the phrase length N must be >= 2 (a key token and at least one more)")
        self.sampler = rejection_sampler(temperature, top_p, top_k, seed, model.device)
        self.draft_lookahead, self.lengthen = bool(draft_lookahead), bool(lengthen)
        self.harvest, self.reuse = bool(harvest), bool(reuse)
        self.pool_capacity = check_count("pool_capacity", pool_capacity)
        self.pool_path = None if pool_path is None else Path(pool_path)
        self.guess = GuessMaker(draft_model, init, init_token, self.pad_token_id, seed)
        self.reset()

    def reset(self) -> None:
        """Forget what earlier decodes taught: the pool goes back to empty, or to the one at ``pool_path``."""
        self.pool = (PhrasePool.load(self.pool_path, self.pool_capacity) if self.pool_path is not None
                     else PhrasePool(self.pool_capacity))

    def _decode(self, state: DecodeState) -> dict:
        state.require_single_row(self.name)
        check_context(self.draft_model, state, self.name)
        if not self.reuse:
            self.reset()
        runner = draft_runner(self.draft_model, state)
        prompt = state.prompt[0][state.prompt_mask[0].bool()].tolist()
        device = state.prompt.device
        state.commit([[draw(self.sampler, state.prefill()[0])]], advance=[0])
        window = None
        if self.draft_lookahead:
            window = LookaheadWindow(self.window, self.ngram, self.guess)
            window.reset(prompt + state.out[0])
        from_phrases = 0
        while not state.finished:
            done = len(state.out[0])
            room = state.max_new_tokens - done
            draft = self._draft(runner, window, prompt + state.out[0], room - 1, state)
            key, left = (draft[-1] if draft else state.out[0][-1]), room - 1 - len(draft)
            branches = [list(c[:left]) for c in self.pool.get(key, self.phrases)] if self.lengthen and left > 0 else []
            parents, visible, depth = verification_block(len(draft), tuple(len(b) for b in branches))
            tokens = state.out[0][-1:] + draft + [t for b in branches for t in b]
            logits = state.forward(torch.tensor([tokens], device=device), visible.to(device), depth.to(device))[0]
            step = commit_tree(state, parents, len(draft) + max(map(len, branches), default=0), tokens, logits,
                               len(tokens), self.sampler)
            committed = len(state.out[0]) - done           # the path and the target's token, cut at EOS
            from_phrases += max(min(len(step.path), committed) - len(draft), 0)
            if self.harvest:
                self._harvest(tokens, len(draft), branches, logits.argmax(-1).tolist(), [i + 1 for i in step.path])
        return {"pool_size": len(self.pool), "phrase_tokens": from_phrases}

    def _draft(self, runner: DraftRunner, window: LookaheadWindow | None, sequence: list[int], limit: int,
               state: DecodeState) -> list[int]:
        """Up to ``limit`` draft tokens after ``sequence`` (its last token the target's pending one): lookahead steps
        on the draft until it has ``gamma``; the draft's cache then holds ``sequence`` and the drafts but the last."""
        if limit < 1:
            return []
        forwards, seconds = runner.forwards, runner.seconds
        chain = sequence[runner.sync(sequence):]      # committed tokens the draft's cache lacks, the pending one last
        context = getattr(self.draft_model.config, "max_position_embeddings", None)
        guesses = self.guesses if self.draft_lookahead else 0
        device = runner.device

        def run(tokens, visible, depth, read):
            plain = len(tokens) == len(chain)         # no window or phrases: a plain causal block
            return runner.feed(tokens, None if plain else visible, None if plain else depth, read)

        drafted: list[int] = []
        while len(drafted) < min(self.gamma, limit):
            last = None if context is None else max(context - 1 - len(runner.ids), 0)
            step = lookahead_step(run, chain, window, self.pool, guesses, limit - len(drafted), last, device)
            runner.keep_path(step.fed, step.keep)
            drafted += step.tokens
            chain = drafted[-1:]
        state.stats.draft_forwards += runner.forwards - forwards
        state.stats.draft_time += runner.seconds - seconds
        return drafted

    def _harvest(self, tokens: list[int], n: int, branches: list[list[int]], predicted: list[int],
                 path: list[int]) -> None:
        """§3.3 over one verification: ``tokens`` [pending, draft (n), branches], the target's ``predicted`` token
        after every block token, the accepted ``path`` (block offsets)."""
        if len(path) < n:                                  # the draft was rejected at draft position len(path)
            tail = range(len(path) + 1, n)                 # the draft positions after the rejected one
            for segment in matched_segments([tokens[1 + i] for i in tail],
                                            [predicted[i] for i in tail] + [predicted[n]]):
                for start in range(len(segment) - 1):
                    self.pool.add(segment[start: start + self.ngram])
            return
        key, offset, last = tokens[n], n + 1, path[-1] if path else 0
        for branch in branches:
            nodes = range(offset, offset + len(branch))
            offset += len(branch)
            if last in nodes:                              # the accepted phrase: refreshed
                self.pool.add([key] + branch)
                continue
            corrected = [predicted[n]] + [predicted[i] for i in nodes[:-1]]   # the target's tokens along it
            if corrected != branch:
                self.pool.discard(key, branch)
                self.pool.add([key] + corrected)
