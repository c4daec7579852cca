"""Initial guesses of tokens not decoded yet: Jacobi's initial block (CLLM §3.1), lookahead's window and Ouroboros's
draft window all start from them."""

from __future__ import annotations

import torch

from lit_spec.errors import ConfigError

INITS = ("prefix", "random", "pad", "repeat_last")


def vocab_size(model) -> int:
    return int(model.get_output_embeddings().weight.size(0))


class GuessMaker:
    """Initial guesses of tokens not decoded yet (shared by ``jacobi``, ``lookahead`` and ``ouroboros``)."""

    def __init__(self, model, init: str, init_token: int | None, pad_token_id: int, seed: int | None):
        if init not in INITS:
            raise ConfigError(f"init={init!r}: choose one of {list(INITS)}")
        self.vocab = vocab_size(model)
        self.token = pad_token_id if init_token is None else init_token
        if isinstance(self.token, bool) or not isinstance(self.token, int) or not 0 <= self.token < self.vocab:
            raise ConfigError(f"init_token={init_token!r}: must be a token id in [0, {self.vocab})")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ConfigError(f"seed={seed!r}: must be an integer (or null for 0)")
        self.init, self.seed = init, 0 if seed is None else seed
        self.generator = torch.Generator()

    def reset(self) -> None:
        self.generator.manual_seed(self.seed)

    def __call__(self, context: list[int], size: int) -> list[int]:
        """``size`` guesses for the tokens after ``context`` (the row's prompt and output so far)."""
        if size <= 0:
            return []
        if self.init == "pad":
            return [self.token] * size
        if self.init == "repeat_last":
            return [context[-1]] * size
        if self.init == "random":
            return torch.randint(self.vocab, (size,), generator=self.generator).tolist()
        picks = torch.randint(len(context), (size,), generator=self.generator).tolist()
        return [context[i] for i in picks]
