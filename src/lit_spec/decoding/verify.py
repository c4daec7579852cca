"""Verification: which proposed tokens the target accepts.

Greedy (lossless): the longest prefix of the proposal that equals the target's own argmax, plus the target's next
token. Sampling (temperature > 0): speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023), which
leaves the target's distribution exactly unchanged; over a token tree, typical acceptance (Medusa's).
"""

from __future__ import annotations

import torch

from lit_spec.errors import ConfigError


def greedy_accept_length(proposal: list[int], target_tokens: list[int]) -> int:
    """How many leading tokens of ``proposal`` equal the target's argmax at the position before each of them
    (``target_tokens``): the length of the two lists' common prefix, the one prefix counter of the package. Plain
    lists: a handful of tokens per step, compared faster in Python than by a chain of small tensor ops (the tokens
    are needed on the host to commit anyway)."""
    n = 0
    for proposed, target in zip(proposal, target_tokens):
        if proposed != target:
            break
        n += 1
    return n


def check_sampling(temperature, top_p=1.0, prefix: str = "") -> tuple[float, float]:
    """``temperature`` >= 0 (0 = greedy) and ``top_p`` in (0, 1], or a ConfigError naming the bad one (after
    ``prefix``, the config key's, e.g. ``bench.``)."""
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{prefix}{name}={value!r}: must be a number")
    if temperature < 0:
        raise ConfigError(f"{prefix}temperature={temperature}: must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ConfigError(f"{prefix}top_p={top_p}: must be in (0, 1] (1: no top-p)")
    return float(temperature), float(top_p)


def require_greedy(method: str, temperature) -> None:
    """For the Jacobi-style decoders (jacobi, multiblock): temperature 0, or a ConfigError saying why."""
    if temperature != 0:
        raise ConfigError(
            f"{method}: temperature={temperature}; Jacobi decoding is greedy by definition: a block is accepted where "
            "it equals its own greedy fixed point (the argmax at every position), and a sampled token has no fixed "
            "point to converge to. Use temperature=0, or a drafting decoder (prompt_lookup, lookahead, a tree) to "
            "sample")


def logits_to_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Softmax at ``temperature`` with optional top-k then nucleus (top-p) truncation, over the last dimension (the
    order of transformers' warpers)."""
    if 0 < top_k < logits.size(-1):
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cut = sorted_p.cumsum(-1) - sorted_p > top_p
        sorted_p = sorted_p.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def speculative_accept(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                       generator: torch.Generator | None = None) -> tuple[int, int]:
    """One row of speculative sampling.

    ``draft_tokens`` [k] were sampled from ``draft_probs`` [k, V]; ``target_probs`` [k + 1, V] are the target's
    distributions at the same positions plus the one after the last draft token. Token i is accepted with probability
    min(1, p(x)/q(x)); at the first rejection a token is drawn from norm(max(0, p - q)); if all k are accepted the
    next token is drawn from p at position k. Returns (number accepted, the extra token).
    """
    k = draft_tokens.size(0)
    idx = torch.arange(k, device=draft_tokens.device)
    p = target_probs[idx, draft_tokens]
    q = draft_probs[idx, draft_tokens]
    u = torch.rand(k, generator=generator, device=draft_tokens.device)
    rejected = (u * q > p).nonzero()
    if rejected.numel() == 0:
        extra = torch.multinomial(target_probs[k], 1, generator=generator)
        return k, int(extra)
    n = int(rejected[0])
    residual = (target_probs[n] - draft_probs[n]).clamp(min=0)
    total = residual.sum()
    residual = residual / total if total > 0 else target_probs[n]
    return n, int(torch.multinomial(residual, 1, generator=generator))


def tree_accept_path(parents: list[int], accepted: list[bool]) -> list[int]:
    """The longest accepted root-to-node path of a verified token tree (one row).

    Block position 0 is the pending token (the root, ``parents[0] == -1``); every other position's parent comes
    before it. ``accepted[i]``: node i's token passes the test under the target's distribution at its parent (greedy:
    it is the argmax there; typical: ``TypicalAcceptance``). A node is on an accepted path when it and all its
    ancestors pass; returns the block positions of the longest such path (root excluded, first such node in block
    order on ties: the higher-ranked candidates come first).
    """
    ok, depth, best = [True] + [False] * (len(parents) - 1), [0] * len(parents), 0
    for i in range(1, len(parents)):
        p = parents[i]
        if ok[p] and accepted[i]:
            ok[i], depth[i] = True, depth[p] + 1
            if depth[i] > depth[best]:
                best = i
    return path_to(best, parents)


def path_to(node: int, parents: list[int]) -> list[int]:
    """The block positions of a tree node's ancestors below the root, then the node (the root itself: [])."""
    path = []
    while node > 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def greedy_tree_accepts(parents: list[int], tokens: list[int], target_tokens: list[int]) -> list[bool]:
    """Greedy test of every tree node: its token equals the target's argmax (``target_tokens``) at its parent."""
    return [False] + [tokens[i] == target_tokens[parents[i]] for i in range(1, len(parents))]


def draw(sampler: "RejectionSampling | TypicalAcceptance | None", logits: torch.Tensor) -> int:
    """The token a decoder commits from ``logits`` [V] with no draft to verify: the argmax when greedy (no sampler),
    else a sample from the target's sampling distribution."""
    return int(logits.argmax(-1)) if sampler is None else sampler.sample(sampler.probs(logits))


class Sampling:
    """The target's sampling distribution, as transformers' warpers make it (temperature, then top-k, then top-p; 0 =
    greedy), and the seeded generator every draw of a decoder takes from."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 device: torch.device | str = "cpu"):
        self.temperature, self.top_p = check_sampling(temperature, top_p)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ConfigError(f"top_k={top_k!r}: an integer >= 0 (0: no top-k)")
        self.top_k = top_k
        self.generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(logits, self.temperature, self.top_p, self.top_k)

    def sample(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The token of every row of ``logits`` [..., V]: the argmax when greedy, else a draw."""
        if self.temperature == 0:
            return logits.argmax(-1)
        probs = self.probs(logits)
        return torch.multinomial(probs.reshape(-1, probs.size(-1)), 1, generator=self.generator).reshape(
            probs.shape[:-1])


class RejectionSampling(Sampling):
    """Lossless sampling over a verified token tree (a chain is a tree too) whose candidates were chosen, not sampled
    (top-k of a draft or heads, n-gram matches): each candidate is a point-mass draft. From the root, the children of
    the last accepted node are tried in order; child x is accepted with probability r(x), r starting as the target's
    distribution at the node (temperature, top-k, top-p), and on a rejection r loses x and is renormalised. When no
    child is accepted the next token is drawn from what r has left; after an accepted leaf, from the target at it.
    This is SpecInfer's multi-step speculative sampling (Miao et al. 2024, §4.2, Algorithm 2) with Q a point mass
    at each candidate (min(1, r(x)/1) = r(x); norm(max(0, r - δx)) = r without x), the rule vLLM applies to n-gram
    drafts: every committed token keeps the target's distribution exactly."""

    lossless = True

    def __init__(self, temperature: float, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 device: torch.device | str = "cpu"):
        super().__init__(temperature, top_p, top_k, seed, device)
        if self.temperature == 0:
            raise ConfigError("rejection sampling needs temperature > 0 (0 is greedy)")

    def choose(self, parents: list[int], tokens: list[int], logits: torch.Tensor) -> tuple[list[int], int]:
        """The accepted path (block positions, root excluded) and the token after it, for ``tokens`` [root + nodes]
        with their block ``parents`` and the target's ``logits`` [>= len(tokens), V] at each."""
        probs = self.probs(logits[: len(tokens)])
        uniforms = torch.rand(len(tokens), generator=self.generator, device=probs.device).tolist()
        # Copies of a node (the same token under the same prefix: lookahead's and Ouroboros's phrases share prefixes)
        # are one candidate, tried at its first copy, whose children are those of every copy.
        first, children = [0] * len(tokens), {}
        for i in range(1, len(tokens)):
            key = (first[parents[i]], tokens[i])
            first[i] = children.setdefault(key, i)
        tried: dict[int, list[int]] = {}
        for (parent, _), child in children.items():
            tried.setdefault(parent, []).append(child)
        node = 0
        while True:
            residual = probs[node]
            for child in tried.get(node, ()):
                x = tokens[child]
                if uniforms[child] < float(residual[x]):
                    node = child
                    break
                residual = residual.clone()
                residual[x] = 0.0
                residual = residual / residual.sum()
            else:
                # the path is the accepted node's own ancestors, whichever copies of them were tried
                return path_to(node, parents), self.sample(residual)


def rejection_sampler(temperature: float, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                      device: torch.device | str = "cpu") -> RejectionSampling | None:
    """How a drafting decoder verifies: greedily at temperature 0 (None), else by ``RejectionSampling``."""
    check_sampling(temperature, top_p)
    return RejectionSampling(temperature, top_p, top_k, seed, device) if temperature else None


class TypicalAcceptance:
    """Typical acceptance (Medusa, Cai et al. 2024, §2.3.1; Chimera §4.3 with T = 1): a candidate x is accepted
    where the target, at ``temperature``, gives it p(x) > min(epsilon, delta · exp(-H(p))) — confident target
    distributions (low entropy H) ask for the likely tokens, flat ones accept more. The token after the accepted path
    is sampled from the target at ``temperature``. Unlike rejection sampling this does not keep the target's
    distribution exactly; it trades that for longer accepted paths. Defaults are Medusa's (epsilon 0.09,
    delta = sqrt(epsilon) = 0.3)."""

    lossless = False

    def __init__(self, temperature: float, epsilon: float = 0.09, delta: float = 0.3, seed: int | None = None,
                 device: torch.device | str = "cpu"):
        for name, value in (("temperature", temperature), ("posterior_threshold", epsilon),
                            ("posterior_alpha", delta)):
            if not value > 0:
                raise ConfigError(f"{name}={value}: typical acceptance needs it > 0")
        self.temperature, self.epsilon, self.delta = float(temperature), float(epsilon), float(delta)
        self.generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(logits, self.temperature)

    def accepts(self, probs: torch.Tensor, parents: list[int], tokens: list[int]) -> list[bool]:
        """Every tree node's test under its parent's distribution (``probs`` [block, V])."""
        entropy = -(probs * probs.clamp_min(1e-10).log()).sum(-1)
        threshold = torch.minimum(torch.full_like(entropy, self.epsilon), self.delta * torch.exp(-entropy))
        parent = torch.tensor(parents[1:], dtype=torch.long, device=probs.device)
        p = probs[parent, torch.tensor(tokens[1:], dtype=torch.long, device=probs.device)]
        return [False] + (p > threshold[parent]).tolist()

    def sample(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def choose(self, parents: list[int], tokens: list[int], logits: torch.Tensor) -> tuple[list[int], int]:
        """The longest path whose nodes all pass the typical test, and a token sampled after it."""
        probs = self.probs(logits[: len(tokens)])
        path = tree_accept_path(parents, self.accepts(probs, parents, tokens))
        return path, self.sample(probs[path[-1] if path else 0])
