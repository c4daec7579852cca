"""How brittle a model's greedy answers are: along the greedy answers to the speedup callback's held-out prompts (the
offline default's 16 × 64 tokens unless overridden), the gap between the top two next-token probabilities, and how
many answers change when every weight gets Gaussian noise of a relative size (a change far smaller than training's).
A model whose answers flip under a 1e-3 perturbation cannot keep "answers unchanged" through any training.

    python experiments/answer_margins.py [overrides of python -m lit_spec.train ...]
"""

from __future__ import annotations

import sys

import torch

from lit_spec.config import build, compose_config
from lit_spec.decoding import generate
from lit_spec.stages import ensure_stages


def greedy(model, records: list[dict], tokens: int) -> list[list[int]]:
    return [generate(model, torch.tensor([r["prompt_ids"]]), "ar", max_new_tokens=tokens).sequences[0,
            len(r["prompt_ids"]):].tolist() for r in records]


@torch.no_grad()
def main(overrides: list[str]) -> None:
    cfg = compose_config(overrides)
    ensure_stages(cfg)
    spec = build(cfg.model)
    model = spec.load_model().eval()
    datamodule = build(cfg.data, tokenizer=spec.load_tokenizer())
    datamodule.setup("fit")
    speedup = cfg.callbacks.speedup
    records = datamodule.eval_records(speedup.split, speedup.num_prompts)
    answers = greedy(model, records, speedup.max_new_tokens)
    gaps = []
    for record, answer in zip(records, answers):
        ids = torch.tensor([record["prompt_ids"] + answer])
        probs = model(ids).logits[0, len(record["prompt_ids"]) - 1:-1].softmax(-1)
        top = probs.topk(2, dim=-1).values
        gaps.append(top[:, 0] - top[:, 1])
    gaps = torch.cat(gaps)
    share = {t: (gaps < t).float().mean() for t in (0.01, 0.05)}
    print(f"{len(records)} answers, {gaps.numel()} tokens: top-2 probability gap median {gaps.median():.3f}; "
          f"under 0.01 at {share[0.01]:.1%} of tokens, under 0.05 at {share[0.05]:.1%}")
    clear = sum(int((g >= 0.01).all()) for g in gaps.split([len(a) for a in answers]))
    print(f"answers with no token under a gap of 0.01: {clear}/{len(records)}")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for scale in (1e-4, 1e-3, 1e-2):
        torch.manual_seed(0)
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                v.copy_(state[k] + scale * state[k].std() * torch.randn_like(v))
        unchanged = sum(a == b for a, b in zip(answers, greedy(model, records, speedup.max_new_tokens)))
        print(f"weights + N(0, ({scale:g} × each tensor's std)²): {unchanged}/{len(records)} answers unchanged")
    model.load_state_dict(state)


if __name__ == "__main__":
    main(sys.argv[1:])
