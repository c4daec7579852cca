"""Hand-built models whose greedy decode is known in advance: real transformers models (so every cache, mask and
position path of the decoders runs) with weights set by hand."""

from __future__ import annotations

from typing import Callable

import torch
from random_models import random_model


def bigram_model(successor: Callable[[int], int], arch: str = "llama", vocab: int = 32):
    """A model whose greedy next token is ``successor(current token)``, whatever came before: attention and MLP
    outputs zeroed (the residual stream is the token's embedding), one-hot embeddings, and an LM head with a single
    1 per input token."""
    model = random_model(arch, layers=1, hidden=64, vocab=vocab)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        emb.zero_()
        emb[torch.arange(vocab), torch.arange(vocab)] = 1.0
        head.zero_()
        for t in range(vocab):
            head[successor(t), t] = 1.0
    return model
