"""The paper's reference algorithm (CLLM Algorithm 1, one prompt, no KV cache): the throughput baseline of
experiments/collect_throughput.py and the tests' independent check of the engine's trajectories."""

from __future__ import annotations

from typing import Callable

import torch

from lit_spec.decoding.state import eos_ids


@torch.no_grad()
def reference_trajectories(model, prompt_ids: list[int], n_tokens: int, max_new_tokens: int,
                           eos_token_id: int | list[int] | None,
                           initial_guess: Callable[[list[int], int], list[int]]) -> list[list[list[int]]]:
    """CLLM Algorithm 1 for one prompt, no KV cache: every Jacobi iteration is a full forward of prompt + answer so
    far + the block's current state, whose argmax at every block position is the next state (eq. 3), until a fixed
    point; it joins the answer and the next block starts, until EOS or ``max_new_tokens``.

    ``initial_guess(context, size)`` guesses ``size`` tokens after ``context`` (e.g. a reset ``GuessMaker``). As in
    ``JacobiDecoder``, the first block's first token is the target's greedy token after the prompt (what any Jacobi
    iteration puts there) and only the rest is guessed, so with the same guesses both give the same trajectories.
    Returns per block its states, initial guess to fixed point; blocks cut by EOS are cut to the tokens output.
    """
    eos = eos_ids(eos_token_id)
    device = next(model.parameters()).device

    def argmax(tokens: list[int]) -> list[int]:
        return model(input_ids=torch.tensor([tokens], device=device)).logits[0].argmax(-1).tolist()

    context, blocks = list(prompt_ids), []
    while len(context) - len(prompt_ids) < max_new_tokens and not (blocks and context[-1] in eos):
        size = min(n_tokens, max_new_tokens - (len(context) - len(prompt_ids)))
        if blocks:
            state = initial_guess(context, size)
        else:
            first = argmax(context)[-1]
            state = [first] + initial_guess(context + [first], size - 1)
        states = [state]
        while True:
            state = argmax(context + state)[len(context) - 1: len(context) - 1 + size]
            if state == states[-1]:
                break
            states.append(state)
        cut = next((i + 1 for i, t in enumerate(state) if t in eos), size)
        blocks.append([s[:cut] for k, s in enumerate(states) if k == 0 or s[:cut] != states[k - 1][:cut]])
        context += state[:cut]
    return blocks
