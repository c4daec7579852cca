"""The decoding engine: every method's speedup is measured with the same cache handling, masks, verification,
counters and clock. ``generate(model, input_ids, method=NAME, **params)`` runs any registered decoder."""

from lit_spec.decoding import ar  # noqa: F401  (registers "ar")
from lit_spec.decoding import jacobi  # noqa: F401  (registers "jacobi")
from lit_spec.decoding import lookahead  # noqa: F401  (registers "lookahead")
from lit_spec.decoding import speculative  # noqa: F401  (registers "speculative")
from lit_spec.decoding import tree  # noqa: F401  (registers "tree")
from lit_spec.decoding import draft_heads  # noqa: F401  (registers "medusa", "chimera")
from lit_spec.decoding import hidden_transfer  # noqa: F401  (registers "hidden_transfer")
from lit_spec.decoding import eagle3  # noqa: F401  (registers "eagle3")
from lit_spec.decoding import dflash  # noqa: F401  (registers "dflash")
from lit_spec.decoding import ouroboros  # noqa: F401  (registers "ouroboros")
from lit_spec.decoding import prompt_lookup  # noqa: F401  (registers "prompt_lookup")
from lit_spec.decoding import multiblock  # noqa: F401  (registers "multiblock")
from lit_spec.decoding.base import DECODERS, DecodeOutput, Decoder, generate, new_tokens
from lit_spec.decoding.stats import DecodeStats

__all__ = ["DECODERS", "DecodeOutput", "DecodeStats", "Decoder", "generate", "new_tokens"]
