"""Task metrics: ``score(prediction_text, reference_text) -> float`` in [0, 1], by name (``data.metric``), and the
execution metric ``pass_at_1`` (``lit_spec.data.execution``), which runs each answer against its record's
``problem`` (kept by ``data.problem_columns``) in a separate, limited process.

A datamodule names its metric so that callbacks can check that faster decoding training keeps the task solved,
not only the tokens of the original model (the speedup callback logs ``quality/<metric>``).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Callable

from lit_spec.data.execution import pass_at_1
from lit_spec.errors import ConfigError

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
FINAL = re.compile(r"####\s*(" + NUMBER.pattern + ")")
WORD = re.compile(r"\w+|[^\w\s]")
ROUGE_TOKEN = re.compile(r"[a-z0-9]+")


def _number(text: str) -> float | None:
    """GSM8K's answer: the number after ``####``, else the last number in the text (commas are separators)."""
    final = FINAL.search(text)
    found = final.group(1) if final else (NUMBER.findall(text) or [None])[-1]
    return None if found is None else float(found.replace(",", ""))


def gsm8k_answer(prediction: str, reference: str) -> float:
    """1.0 when both texts give the same final number (``1,000`` == ``1000.0``), else 0.0."""
    pred, ref = _number(prediction), _number(reference)
    return float(pred is not None and ref is not None and pred == ref)


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the texts are equal up to whitespace."""
    return float(prediction.split() == reference.split())


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD's token F1 over words and single punctuation marks (``\\w+|[^\\w\\s]``), so it suits code too:
    2·P·R/(P+R) of the multisets' overlap; 1.0 for two empty texts."""
    pred, ref = Counter(WORD.findall(prediction)), Counter(WORD.findall(reference))
    if not pred or not ref:
        return float(pred == ref)
    return _f1(pred, ref)


def _f1(pred: Counter, ref: Counter) -> float:
    overlap = sum((pred & ref).values())
    if not overlap:
        return 0.0
    precision, recall = overlap / sum(pred.values()), overlap / sum(ref.values())
    return 2 * precision * recall / (precision + recall)


def rouge1(prediction: str, reference: str) -> float:
    """ROUGE-1 F-measure (the Ouroboros paper's CNN/DM score, Table 8) as Google's ``rouge_score`` computes it without
    stemming: unigrams of the lower-cased text's ``[a-z0-9]+`` runs, F1 of the multisets' overlap; 0.0 when either
    text has none. The mean over answers is the usual corpus figure (``rouge_score``'s aggregator bootstraps it)."""
    return _f1(Counter(ROUGE_TOKEN.findall(prediction.lower())), Counter(ROUGE_TOKEN.findall(reference.lower())))


METRICS: dict[str, Callable[[str, str], float]] = {"gsm8k_answer": gsm8k_answer, "exact_match": exact_match,
                                                    "token_f1": token_f1, "rouge1": rouge1}


EXECUTION_METRICS: dict[str, Callable[[list[str], list[dict]], float]] = {"pass_at_1": pass_at_1}


def get_metric(name: str) -> Callable:
    if name not in METRICS and name not in EXECUTION_METRICS:
        raise ConfigError(f"data.metric={name!r}: choose one of {sorted(METRICS | EXECUTION_METRICS)} "
                          "(or null for none)")
    return METRICS.get(name) or EXECUTION_METRICS[name]


def score_answers(name: str, outputs: list[list[int]], records: list[dict], tokenizer) -> float:
    """Mean of metric ``name`` over decoded answers (token ids) against their ``records``' answers (``answer_ids``),
    as texts; an execution metric runs them against the records' ``problem`` instead."""
    score = get_metric(name)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    if name in EXECUTION_METRICS:
        if any("problem" not in r for r in records):
            raise ConfigError(f"metric {name}: the data config keeps no problems to run the answers against "
                              "(data.problem_columns, e.g. data=humaneval)")
        return score([decode(o) for o in outputs], [r["problem"] for r in records])
    pairs = list(zip(outputs, records))
    return sum(score(decode(o), decode(r["answer_ids"])) for o, r in pairs) / len(pairs) if pairs else 0.0
