"""``tree``: verification of a static token tree in one target forward (Medusa-style tree attention).

The component later methods plug into (Chimera, Hidden Transfer heads): they supply, for each of the next ``depth``
positions after the pending token, their top-k candidate tokens; ``TreeSpec`` says which combinations form the tree.

- ``TreeSpec.from_paths([(0,), (1,), (0, 0), ...])`` (Medusa's ``medusa_choices``: each node is the path of top-k
  ranks from the root) or ``TreeSpec.from_topk([3, 2, 1])`` (every combination of the per-depth top-k) or
  ``TreeSpec.parse(x)`` for either form; it yields ``parents`` / ``depths`` / ``ranks`` of its nodes.
- ``spec.build_candidates(top_k_tokens)``: [depth, >= spec.top_k] candidate tokens per position -> [nodes] tokens.
- ``verify_tree(state, spec, tokens)``: one forward of [pending token + nodes] (``masks.from_parents``, positions
  by depth), acceptance of the longest root-to-node path plus the target's next token; the accepted path's KV
  entries are kept (``DecodeState.keep_path``), the rest dropped; commits. Greedy (temperature 0, lossless: every
  node must equal the target's argmax); at temperature > 0 rejection sampling over the tree (lossless,
  ``verify.RejectionSampling``), or typical acceptance (``acceptance=typical``, lossy: ``verify.TypicalAcceptance``).

The registered decoder takes its candidates from a ``draft_model`` (top-k at each step of the draft's greedy path:
no training needed), or from any ``candidates(state, depth, k) -> [depth, k]`` function. Batch size 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Callable, NamedTuple

import torch

from lit_spec.decoding.base import Decoder, register
from lit_spec.decoding.draft import check_context, check_draft, draft_runner
from lit_spec.decoding.masks import from_parents
from lit_spec.decoding.state import DecodeState
from lit_spec.decoding.verify import (RejectionSampling, TypicalAcceptance, draw, greedy_tree_accepts,
                                      rejection_sampler, tree_accept_path)
from lit_spec.errors import ConfigError

Candidates = Callable[[DecodeState, int, int], torch.Tensor]
Sampler = RejectionSampling | TypicalAcceptance
ACCEPTANCE = ("rejection", "typical")


def tree_sampler(temperature: float, top_p: float, top_k: int, acceptance: str, posterior_threshold: float,
                 posterior_alpha: float, seed: int | None, device) -> Sampler | None:
    """How a tree decoder accepts at ``temperature``: greedily at 0 (None); rejection sampling (lossless) or, with
    ``acceptance=typical``, Medusa's typical acceptance (lossy: no top-k / top-p)."""
    if acceptance not in ACCEPTANCE:
        raise ConfigError(f"acceptance={acceptance!r}: choose one of {ACCEPTANCE}")
    if acceptance == "rejection" or temperature == 0:
        return rejection_sampler(temperature, top_p, top_k, seed, device)
    if top_p != 1.0 or top_k:
        raise ConfigError("acceptance=typical samples the target at its temperature only: drop top_p / top_k, or "
                          "use acceptance=rejection")
    return TypicalAcceptance(temperature, posterior_threshold, posterior_alpha, seed, device)


@dataclass(frozen=True)
class TreeSpec:
    """A static token tree: node i is ``paths[i]``, the top-k ranks of its tokens from depth 1 down to it.

    Nodes are ordered by depth then ranks, so a parent always comes before its children."""

    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def from_paths(cls, paths) -> "TreeSpec":
        nodes = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        known = set(nodes)
        for p in nodes:
            if not p or min(p) < 0:
                raise ConfigError(f"tree path {list(p)}: must be a non-empty list of top-k ranks >= 0")
            if len(p) > 1 and p[:-1] not in known:
                raise ConfigError(f"tree path {list(p)} lacks its parent {list(p[:-1])}: list every prefix of a path")
        return cls(tuple(nodes))

    @classmethod
    def from_topk(cls, ks) -> "TreeSpec":
        """Every combination of the top ``ks[d]`` candidates at depth d+1 (a full tree of ``sum(prod(ks[:d]))``)."""
        ks = [int(k) for k in ks]
        if not ks or min(ks) < 1:
            raise ConfigError(f"tree top-k per depth {ks}: need at least one depth, each k >= 1")
        level, paths = [()], []
        for k in ks:
            level = [p + (r,) for p in level for r in range(k)]
            paths += level
        return cls.from_paths(paths)

    @classmethod
    def chain(cls, depth: int) -> "TreeSpec":
        """A single path: the top-1 candidate at each of ``depth`` positions (plain speculative-style chain)."""
        return cls.from_topk([1] * depth)

    @classmethod
    def parse(cls, tree) -> "TreeSpec":
        """A ``TreeSpec``; a list of ints (top-k per depth); or a list of paths (lists of ranks)."""
        if isinstance(tree, TreeSpec):
            return tree
        try:
            items = list(tree)
        except TypeError:
            raise ConfigError(f"tree={tree!r}: give top-k per depth ([3, 2, 1]) or paths ([[0], [1], [0, 0]])") from None
        if not items:
            raise ConfigError("tree=[]: the tree has no nodes")
        if all(isinstance(x, int) for x in items):
            return cls.from_topk(items)
        return cls.from_paths([list(x) for x in items])

    # ---- structure ------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.paths)

    @cached_property
    def parents(self) -> list[int]:
        """Parent node index of each node; -1 for depth-1 nodes (their parent is the pending token)."""
        index = {p: i for i, p in enumerate(self.paths)}
        return [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]

    @cached_property
    def depths(self) -> list[int]:
        """Depth of each node: 1 = the position right after the pending token."""
        return [len(p) for p in self.paths]

    @cached_property
    def ranks(self) -> list[int]:
        return [p[-1] for p in self.paths]

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def top_k(self) -> int:
        """How many candidates per position the tree uses."""
        return max(self.ranks, default=-1) + 1

    @cached_property
    def block_parents(self) -> list[int]:
        """Parents within the verified block [pending token, nodes...]: the pending token is the root."""
        return [-1] + [p + 1 for p in self.parents]

    @cached_property
    def block_visible(self) -> torch.Tensor:
        """[1 + nodes]^2 visibility of the verified block (a node sees the pending token and its ancestors)."""
        return from_parents(self.block_parents)

    @cached_property
    def block_depths(self) -> torch.Tensor:
        """Position offsets of the verified block from the pending token: 0, then each node's depth."""
        return torch.tensor([0] + self.depths)

    @lru_cache(maxsize=64)
    def truncated(self, depth: int) -> "TreeSpec":
        """The nodes at depth <= ``depth`` (still a tree: ancestors are shallower); cached, with its properties."""
        return TreeSpec(tuple(p for p in self.paths if len(p) <= depth))

    def build_candidates(self, top_k_tokens: torch.Tensor) -> torch.Tensor:
        """Tree tokens [nodes] from candidates [>= depth, >= top_k]: row d-1 holds the ranked tokens of depth d."""
        if len(self) == 0:
            return top_k_tokens.new_empty(0)
        if top_k_tokens.dim() != 2 or top_k_tokens.size(0) < self.depth or top_k_tokens.size(1) < self.top_k:
            raise ValueError(f"tree of depth {self.depth} and top-{self.top_k} needs candidates of shape at least "
                             f"[{self.depth}, {self.top_k}], got {tuple(top_k_tokens.shape)}")
        d = torch.tensor(self.depths, device=top_k_tokens.device) - 1
        r = torch.tensor(self.ranks, device=top_k_tokens.device)
        return top_k_tokens[d, r]


class TreeStep(NamedTuple):
    tokens: list[int]          # committed: the accepted path's tokens, then the target's next token
    path: list[int]            # accepted nodes (indices into the spec's nodes)
    logits: torch.Tensor       # the target's logits over the block [1 + nodes, V]


@torch.no_grad()
def verify_tree(state: DecodeState, spec: TreeSpec, tree_tokens: torch.Tensor,
                sampler: Sampler | None = None) -> TreeStep:
    """One target forward of [pending token + ``tree_tokens``] (batch size 1); keeps the accepted path's KV, commits
    its tokens plus the target's next one, and counts drafted (tree depth) / accepted tokens. Greedy acceptance
    unless a ``sampler`` is given."""
    device = state.pending.device
    block = torch.cat([state.pending[:1], tree_tokens.to(device)])[None]
    logits = state.forward(block, spec.block_visible.to(device), spec.block_depths.to(device))[0]
    return commit_tree(state, spec.block_parents, spec.depth, block[0].tolist(), logits, block.size(1), sampler)


def commit_tree(state: DecodeState, parents: list[int], drafted: int, tokens: list[int], logits: torch.Tensor,
                fed: int, sampler: Sampler | None = None) -> TreeStep:
    """Acceptance over a verified tree: ``tokens`` [pending + nodes] with their ``parents`` in the block (the pending
    token the root) and their ``logits`` from the forward that fed ``fed`` tokens (the tree first; anything after it
    is dropped from the cache with the rejected nodes). ``drafted``: the tree's depth, for the counters."""
    if sampler is None:
        target = logits[: len(tokens)].argmax(-1).tolist()
        path = tree_accept_path(parents, greedy_tree_accepts(parents, tokens, target))
        extra = target[path[-1] if path else 0]
    else:
        path, extra = sampler.choose(parents, tokens, logits)
    committed = [tokens[i] for i in path] + [extra]
    state.keep_path(fed, [0] + path)
    state.commit([committed], advance=[len(path) + 1], drafted=[drafted])
    return TreeStep(committed, [i - 1 for i in path], logits)


class DraftCandidates:
    """Top-k candidates without training: run the draft along its greedy path and take its top-k at each step."""

    def __init__(self, draft_model, state: DecodeState):
        self.runner = draft_runner(draft_model, state)
        self.prompt: list[int] | None = None

    def __call__(self, state: DecodeState, depth: int, k: int) -> torch.Tensor:
        if self.prompt is None:
            self.prompt = state.prompt[0][state.prompt_mask[0].bool()].tolist()
        forwards, seconds = self.runner.forwards, self.runner.seconds
        _, logits = self.runner.propose(self.prompt + state.out[0], depth, lambda x: int(x.argmax(-1)))
        state.stats.draft_forwards += self.runner.forwards - forwards
        state.stats.draft_time += self.runner.seconds - seconds
        return logits.topk(k, dim=-1).indices


@register("tree")
class TreeDecoder(Decoder):
    needs_draft = True   # candidates from ``draft_model`` unless given; subclasses with their own source say False

    def __init__(self, model, tree=(3, 2, 1, 1), draft_model=None, candidates: Candidates | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, acceptance: str = "rejection",
                 posterior_threshold: float = 0.09, posterior_alpha: float = 0.3, seed: int | None = None, **kwargs):
        """At ``temperature`` > 0: ``acceptance=rejection`` (lossless, with ``top_p`` / ``top_k``) or ``typical``
        (Medusa's, lossy, with ``posterior_threshold`` ε and ``posterior_alpha`` δ)."""
        super().__init__(model, **kwargs)
        self.sampler = tree_sampler(temperature, top_p, top_k, acceptance, posterior_threshold, posterior_alpha,
                                    seed, model.device)
        if candidates is None and self.needs_draft:
            check_draft(model, draft_model, "tree")
        self.spec = TreeSpec.parse(tree)
        self.draft_model, self.candidates = draft_model, candidates

    def new_candidates(self, state: DecodeState) -> Candidates:
        """The candidate source of one decode (fresh per call: a source may keep per-decode state)."""
        if self.candidates is not None:
            return self.candidates
        check_context(self.draft_model, state, self.name)
        return DraftCandidates(self.draft_model, state)

    def commit_first(self, state: DecodeState) -> None:
        """The prefill and the target's first token (argmax, or sampled at the temperature)."""
        state.commit([[draw(self.sampler, state.prefill()[0])]], advance=[0])

    def spec_for(self, state: DecodeState) -> TreeSpec:
        """The tree, cut to the tokens still to decode (a path longer than that could not be committed)."""
        room = state.max_new_tokens - len(state.out[0]) - 1
        return self.spec if room >= self.spec.depth else self.spec.truncated(max(room, 0))

    def _decode(self, state: DecodeState) -> None:
        state.require_single_row(self.name)
        candidates = self.new_candidates(state)
        self.commit_first(state)
        while not state.finished:
            spec = self.spec_for(state)
            top_k = candidates(state, spec.depth, spec.top_k) if len(spec) else None
            verify_tree(state, spec, spec.build_candidates(top_k) if top_k is not None
                        else state.pending.new_empty(0), self.sampler)
