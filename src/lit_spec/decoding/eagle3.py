"""EAGLE-3, decoding part (the models/ and methods/ files of this name build and train the draft): ``eagle3``,
tree-verified decoding whose drafts come from the EAGLE-3 draft on the target's features. Greedy verification
(``tree``) keeps it lossless whatever the draft proposes; at temperature > 0 it follows the tree decoders' rule
(rejection sampling over the tree, lossless; or ``acceptance=typical``).

Each step the draft first reads what the target's last forward cached: the features of those positions
(``DecodeState.hidden`` at the draft's layers, no extra target forward), each beside the token after it, into its own
KV cache (the training-time test's first step). The row of the last cached position, which reads the pending token,
gives the draft's distribution over depth 1. Then the tree grows one depth per draft forward: every node to expand is
fed (its token, its parent's output state) at once, attending to the cached rows and to its ancestors (the training
mask's chain), and its top-k become its children. The tree's shape:

- ``tree=[1, 1, 1, 1]``: a chain (the top-1 at each depth);
- ``tree=[3, 2, 1]`` or paths: a static tree (``TreeSpec``), each node's children its own top-k (not a depth's);
- ``tree=dynamic``: EAGLE-2's dynamic tree (Li et al. 2024, §4): each depth expands the ``top_k`` nodes of highest
  cumulative draft log-probability, each giving its ``top_k`` children; of every drafted node the ``total_tokens``
  of highest cumulative log-probability are verified (a prefix-closed set: a child never scores above its parent).

The drafted rows are dropped from the draft's cache after each step; the accepted tokens' rows come back at the next
step with the target's own features.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from lit_spec.decoding.base import register
from lit_spec.decoding.cache import GrowingLayer, StaticLayer
from lit_spec.decoding.draft_heads import _count_draft, load_draft
from lit_spec.decoding.draft_step import DraftStep, SteppedDraft
from lit_spec.decoding.state import DecodeState
from lit_spec.decoding.tree import TreeDecoder, TreeSpec, verify_tree
from lit_spec.errors import ConfigError, check_count
from lit_spec.models.eagle3 import Eagle3Draft

DYNAMIC = "dynamic"


class Node:
    """A drafted token: its rank path from the root, target id, cumulative log-probability and parent (None: the
    pending token); once expanded, its output state and its row among the draft cache's drafted rows."""

    __slots__ = ("path", "token", "score", "parent", "state", "row")

    def __init__(self, path: tuple[int, ...], token: int, score: float, parent: "Node | None"):
        self.path, self.token, self.score, self.parent = path, token, score, parent
        self.state: torch.Tensor | None = None
        self.row: int | None = None


def draft_forward(draft: Eagle3Draft, kv, tokens: torch.Tensor, states: torch.Tensor, positions: torch.Tensor,
                  allowed: torch.Tensor, rows: torch.Tensor | None, k: int, fuse: bool):
    """One draft forward of Q rows appended to ``kv`` (``tokens`` [Q], ``states`` [Q, H], or with ``fuse`` the target's
    concatenated features [Q, kH], ``positions`` [Q]), seeing the cache's keys where ``allowed`` [Q, keys]: the output
    states [Q, H] and, of ``rows`` (None: all), the top-``k`` next-token log-probabilities and their target ids. What
    ``DraftStep`` compiles on the fast path."""
    if fuse:
        states = draft.features(states)
    states = states[None]
    q, key, value = draft.midlayer.qkv(draft.embed(tokens[None]).to(states.dtype), states,
                                       draft.rotary(states, positions[None]))
    keys, values = kv.update(key, value)
    attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[None, None], enable_gqa=True)
    out = draft.midlayer.finish(states, attended)[0]
    scored = out if rows is None else out.index_select(0, rows)
    values, ids = draft.logits(scored).float().log_softmax(-1).topk(k, dim=-1)
    return out, values, draft.draft_ids[ids]


class Eagle3Drafter:
    """One decode's drafting state: the draft's KV cache (``kv``) of the verified prefix (``length`` rows) and, within a
    step, the ``drafted`` rows after it. Eager, ``kv`` grows as the decode does; on the fast path it is a static layer
    kept by the decoder, each forward padded to a power-of-two width (a pad row sees only itself and is rolled back)
    and run through the compiled ``step``. Each forward scores the ``k`` best next tokens of the rows it reads."""

    def __init__(self, draft: Eagle3Draft, prompt: list[int], step: DraftStep, kv, k: int):
        self.draft, self.prompt, self.step, self.kv, self.k = draft, prompt, step, kv, k
        self.static = isinstance(kv, StaticLayer)
        draft.rotary.on(draft.fc.weight.device)
        self.length = self.drafted = 0
        self.forwards = 0

    def _layer(self, tokens: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
               rows: torch.Tensor | None = None, fuse: bool = False):
        """``draft_forward`` on this decode's cache, after its ``length + drafted`` rows; its outputs cut to the Q
        rows given."""
        q, cached = tokens.size(0), self.length + self.drafted
        width = self.step.width(q)
        keys = self.kv.max_cache_len if self.static else cached + q
        if cached + width > keys:
            raise RuntimeError(f"eagle3: {cached + width} draft rows in a cache of {keys}")
        pad = width - q
        allowed = F.pad(allowed, (0, keys - cached - q, 0, pad))         # every key of the cache, the pad rows
        if pad:
            tokens, positions = F.pad(tokens, (0, pad)), F.pad(positions, (0, pad))
            states = F.pad(states, (0, 0, 0, pad))
            idle = torch.arange(q, width, device=allowed.device)
            allowed[idle, cached + idle] = True
        label = f"{'root' if fuse else 'expand'}{width}/top{self.k}@{keys}"
        out, values, ids = self.step(label, self.kv, tokens, states, positions, allowed, rows, self.k, fuse)
        if pad:
            self.kv.crop(-pad)
        self.forwards += 1
        return out[:q], values[:q], ids[:q]

    def root(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Read the positions the target's last forward cached into the draft's cache: the output state [H] of the
        last one, which reads the pending token, and its top-``k`` (log-probabilities, target ids), each [k]."""
        features = state.hidden[0]                                       # [m, kH]
        m, device = features.size(0), features.device
        tokens = self.prompt + state.out[0]
        if self.length + m != len(tokens) - 1:
            raise RuntimeError(f"eagle3: {self.length + m} target features for {len(tokens) - 1} cached tokens")
        following = torch.tensor(tokens[self.length + 1:], device=device)     # the token after each position
        positions = torch.arange(self.length, self.length + m, device=device)
        allowed = torch.ones(m, self.length + m, dtype=torch.bool, device=device).tril(self.length)
        last = torch.tensor([m - 1], device=device)
        out, values, ids = self._layer(following, features, positions, allowed, rows=last, fuse=True)
        self.length += m
        return out[-1], values[0], ids[0]

    def expand(self, nodes: list[Node], depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``nodes`` (all at ``depth``, parents expanded) in one forward; store their output states; return the
        top-``k`` of each's next-token log-probabilities as (values, target ids), each [len(nodes), k]."""
        device = self.draft.d2t.device
        allowed = torch.zeros(len(nodes), self.length + self.drafted + len(nodes), dtype=torch.bool, device=device)
        allowed[:, : self.length] = True
        for i, node in enumerate(nodes):
            node.row = self.drafted + i
            ancestor = node
            while ancestor.parent is not None:               # itself and its drafted ancestors, not the pending token
                allowed[i, self.length + ancestor.row] = True
                ancestor = ancestor.parent
        states = torch.stack([node.parent.state for node in nodes])
        tokens = torch.tensor([node.token for node in nodes], device=device)
        positions = torch.full((len(nodes),), self.length - 1 + depth, device=device)
        out, values, ids = self._layer(tokens, states, positions, allowed)
        self.drafted += len(nodes)
        for node, s in zip(nodes, out):
            node.state = s
        return values, ids

    def drop_drafted(self) -> None:
        if self.drafted:
            self.kv.crop(-self.drafted)
            self.drafted = 0


def children(parent: Node, values: torch.Tensor, ids: torch.Tensor) -> list[Node]:
    """``parent``'s drafted children, ranked: their cumulative log-probabilities add the parent's."""
    return [Node(parent.path + (r,), int(t), parent.score + float(v), parent)
            for r, (v, t) in enumerate(zip(values, ids))]


def static_tree(drafter: Eagle3Drafter, pending: Node, top: torch.Tensor, spec: TreeSpec) -> list[Node]:
    """Every node of ``spec``, each child the given rank of its parent's own top-k (``top``: the pending token's,
    ranked target ids); the nodes in spec order."""
    nodes, tops = {(): pending}, {(): top}
    parents = {p[:-1] for p in spec.paths}
    for depth in range(1, spec.depth + 1):
        level = [p for p in spec.paths if len(p) == depth]
        for path in level:
            nodes[path] = Node(path, int(tops[path[:-1]][path[-1]]), 0.0, nodes[path[:-1]])
        expanding = [p for p in level if p in parents]
        if expanding:
            ids = drafter.expand([nodes[p] for p in expanding], depth)[1]
            tops.update(zip(expanding, ids))
    return [nodes[p] for p in spec.paths]


def dynamic_tree(drafter: Eagle3Drafter, pending: Node, top: tuple[torch.Tensor, torch.Tensor], depth: int,
                 top_k: int, total: int) -> list[Node]:
    """EAGLE-2's tree: expand the ``top_k`` best of each depth (the pending token's ``top``: its top-k log-probabilities
    and target ids), keep the ``total`` best of all drafted nodes."""
    level = children(pending, *top)
    drafted = list(level)
    for d in range(1, depth):
        expanding = sorted(level, key=lambda n: -n.score)[:top_k]
        values, ids = drafter.expand(expanding, d)
        level = [c for node, v, t in zip(expanding, values, ids) for c in children(node, v, t)]
        drafted += level
    # best first; a tie goes to the shallower node, so a parent never loses its place to its own child
    return sorted(drafted, key=lambda n: (-n.score, len(n.path)))[:total]


@register("eagle3")
class Eagle3Decoder(SteppedDraft, TreeDecoder):
    """Tree decoding with an EAGLE-3 draft (``heads``: an ``Eagle3Draft`` or a directory from ``save_heads``).
    ``tree``: top-k per depth or paths (a chain: ``[1] * depth``), or ``dynamic`` with ``depth``, ``top_k`` and
    ``total_tokens`` (EAGLE-2's tree)."""

    needs_draft = False
    draft_forward = staticmethod(draft_forward)

    def __init__(self, model, heads, tree=DYNAMIC, depth: int = 6, top_k: int = 10, total_tokens: int = 60,
                 **kwargs):
        self.draft = load_draft(heads, Eagle3Draft, model)
        self.draft.check_vocab()
        self.dynamic = tree == DYNAMIC
        if self.dynamic:
            self.top_k, self.total = check_count("top_k", top_k), check_count("total_tokens", total_tokens)
            # the depth lives in this placeholder spec, which spec_for cuts to the room left; its top-k is checked below
            tree = [top_k] + [1] * (check_count("depth", depth) - 1)
        elif isinstance(tree, str):
            raise ConfigError(f"tree={tree!r}: give {DYNAMIC!r}, top-k per depth ([3, 2, 1]) or paths")
        super().__init__(model, tree=tree, **kwargs)
        if self.spec.top_k > self.draft.draft_vocab_size:
            raise ConfigError(f"top_k={self.spec.top_k} exceeds the draft's vocabulary of "
                              f"{self.draft.draft_vocab_size}")
        self.record_hidden = tuple(self.draft.layers)
        # the draft rows a step may add after the verified ones: every expanded node, each forward padded
        expanded = self.top_k * (self.spec.depth - 1) if self.dynamic else len(self.spec)
        self.draft_rows = 2 * (expanded + self.spec.depth + 1)

    def _draft_cache(self, state: DecodeState):
        """Eager: a cache that grows as the decode does. Fast: the decoder's static layer."""
        if self.fast is None:
            return GrowingLayer()
        return self.static_layers([self.draft.midlayer.self_attn], state, self.draft_rows)[0]

    def _tree(self, drafter: Eagle3Drafter, state: DecodeState) -> tuple[TreeSpec, torch.Tensor]:
        """The step's tree and its tokens (in the spec's node order), cut to the tokens still to decode."""
        spec = self.spec_for(state)
        if not len(spec):
            return spec, state.pending.new_empty(0)
        start, forwards = time.perf_counter(), drafter.forwards
        pending = Node((), int(state.pending[0]), 0.0, None)
        pending.state, *top = drafter.root(state)
        if self.dynamic:
            nodes = dynamic_tree(drafter, pending, top, spec.depth, self.top_k, self.total)
            spec = TreeSpec.from_paths([n.path for n in nodes])
            token = {n.path: n.token for n in nodes}
            tokens = [token[p] for p in spec.paths]
        else:
            tokens = [n.token for n in static_tree(drafter, pending, top[1], spec)]
        drafter.drop_drafted()
        _count_draft(state, start, drafter.forwards - forwards)
        return spec, torch.tensor(tokens, device=state.pending.device)

    def _decode(self, state: DecodeState) -> None:
        state.require_single_row(self.name)
        drafter = Eagle3Drafter(self.draft, state.prompt[0][state.prompt_mask[0].bool()].tolist(), self.step,
                                self._draft_cache(state), self.spec.top_k)
        self.commit_first(state)
        while not state.finished:
            spec, tokens = self._tree(drafter, state)
            verify_tree(state, spec, tokens, self.sampler)
