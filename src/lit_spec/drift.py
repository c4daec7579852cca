"""Quality drift, the one place for it: how far a method that changes the model (CLLM, Jacobi Forcing) moved it from
the model it was trained from. Two measures that resolve a small change: ``answer_nll``, the mean negative
log-likelihood per token of a dataset's answers (a change of a few hundredths shows before any greedy answer
flips), and ``compare_answers``, how many greedy answers are unchanged and, where one changed, after how many tokens.
The speedup callback (``lit_spec.callbacks.speedup``) logs both against the model as it was before the first step;
the bench (``lit_spec.benchmark``, ``model@original=NAME``) against a second model config. Answer sets beyond the
held-out prompts are data configs (``conf/data/<name>.yaml``) read whole by ``drift_records``, e.g. HumanEval's 164
problems with their canonical solutions."""

from __future__ import annotations

import statistics

import torch
from omegaconf import DictConfig, OmegaConf

from lit_spec.config import build, compose_config, config_dir
from lit_spec.data.datamodule import IGNORE_INDEX, collate_answers, split_records
from lit_spec.decoding.verify import greedy_accept_length
from lit_spec.errors import ConfigError
from lit_spec.measure import eval_mode, mean

HELDOUT = "heldout"     # the answer set of the decoded prompts themselves, beside the drift_data sets


@torch.no_grad()
def answer_nll_terms(model, records: list[dict], device: torch.device) -> list[tuple[float, int]]:
    """Per record (``prompt_ids``, ``answer_ids``): the summed negative log-likelihood of its answer tokens under
    ``model`` and their count; (0.0, 0) for an empty answer. One forward per record (no padding), the prompt masked
    out of the labels, transformers' own shifted loss; eval mode, every submodule's mode restored after."""
    terms = []
    with eval_mode(model):
        for record in records:
            if not record["answer_ids"]:
                terms.append((0.0, 0))
                continue
            batch = collate_answers([(record["prompt_ids"], record["answer_ids"])], pad_token_id=0)
            batch = {k: v.to(device) for k, v in batch.items()}
            tokens = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())   # the labels the shifted loss scores
            terms.append((model(**batch, use_cache=False).loss.item() * tokens, tokens))
    return terms


def nll_mean(terms: list[tuple[float, int]]) -> float:
    """The mean NLL per answer token of ``answer_nll_terms`` (a long answer weighs by its tokens); NaN for none."""
    count = sum(n for _, n in terms)
    return sum(total for total, _ in terms) / count if count else float("nan")


def answer_nll(model, records: list[dict], device: torch.device) -> float:
    """Mean negative log-likelihood per answer token of ``records`` under ``model``: summed over every answer token of
    every record, over their count. Records with an empty answer are skipped; NaN when none is left."""
    return nll_mean(answer_nll_terms(model, records, device))


def compare_answers(outputs: list[list[int]], originals: list[list[int]]) -> dict[str, float | None]:
    """Greedy answers against the original model's for the same prompts (pairwise): ``agreement``, the share
    unchanged; ``token_agreement``, the mean common-prefix length over the original's length; ``first_divergence``,
    over the changed ones the median position of the first differing token (the tokens still equal before it),
    None when none changed. No pairs: {}."""
    pairs = list(zip(outputs, originals))
    if not pairs:
        return {}
    common = [greedy_accept_length(o, r) for o, r in pairs]
    changed = [n for n, (o, r) in zip(common, pairs) if o != r]
    return {"agreement": mean(o == r for o, r in pairs),
            "token_agreement": mean(n / max(len(r), 1) for n, (_, r) in zip(common, pairs)),
            "first_divergence": statistics.median(changed) if changed else None}


def compare_nll(original, model, sets: dict[str, list[dict]], device: torch.device) -> dict[str, dict]:
    """Per answer set: its record count, ``answer_nll`` under the original and the trained model, and the change
    (trained − original: > 0, the trained model finds the answers less likely)."""
    out = {}
    for name, records in sets.items():
        before, after = answer_nll(original, records, device), answer_nll(model, records, device)
        out[name] = {"records": len(records), "original": before, "trained": after, "change": after - before}
    return out


def data_configs() -> list[str]:
    """The names ``data=NAME`` takes (the shared ``_prompt`` base is none)."""
    return sorted(p.stem for p in (config_dir() / "data").glob("*.yaml") if not p.stem.startswith("_"))


def drift_config(name, setting: str) -> DictConfig:
    """``conf/data/<name>.yaml`` composed (inside the bench config, whose other groups it does not use). No such
    config, or one without a ``source`` (a collection of model outputs, not a dataset), is a ConfigError naming
    ``setting``."""
    if name not in data_configs():
        raise ConfigError(f"{setting}={name!r}: no data config of that name; choose one of {data_configs()}")
    data = compose_config([f"data={name}"], config_name="bench").data
    if data.get("source") is None:
        raise ConfigError(f"{setting}={name}: a collection of model outputs, not a dataset with its own answers; "
                          "name a dataset config such as humaneval")
    return data


def check_drift_data(drift_data, setting: str) -> dict[str, str]:
    """``{set name: data config name}`` (None: no sets) checked before any work; returned as a plain dict."""
    if isinstance(drift_data, DictConfig):
        drift_data = OmegaConf.to_container(drift_data, resolve=True)
    if drift_data is None:
        return {}
    if not isinstance(drift_data, dict):
        raise ConfigError(f"{setting}={drift_data!r}: a mapping {{set name: data config name}}, e.g. "
                          "{humaneval: humaneval}, or null for none")
    if HELDOUT in drift_data:
        raise ConfigError(f"{setting}.{HELDOUT}: that set is always measured (the decoded prompts' answers); "
                          "name the entry otherwise")
    for set_name, name in drift_data.items():
        drift_config(name, f"{setting}.{set_name}")
    return dict(drift_data)


def drift_records(name: str, tokenizer, split: str | None = None, n: int | None = None) -> list[dict]:
    """The first ``n`` records (None: all) of ``split`` of the data config ``name`` (None: its evaluation split,
    ``data.source.eval_split``, else test), tokenized by ``tokenizer``: ``prompt_ids`` and the dataset's
    ``answer_ids``. ``drift_records("humaneval", tok)``: HumanEval's 164 problems."""
    datamodule = build(drift_config(name, "data"), tokenizer=tokenizer)
    split = split or getattr(datamodule, "eval_split", None) or "test"
    return split_records(datamodule, split, n, f"data={name}: split")
