"""Data hygiene: a detector of repetitive answers (CLLM §3.2.1 post-processing). The collection marks the answers it
flags (``keep: false``); the bench reports the share of flagged greedy answers as a quality signal."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass
class RepetitionFilter:
    """CLLM §3.2.1 post-processing: a rule-based detector of token- and sentence-level repetition.

    A target answer is dropped when a token repeats ``max_token_run`` times in a row, an n-gram of
    ``ngram_size`` tokens occurs ``max_ngram_count`` times, or a line (stripped, at least ``min_line_chars``
    characters) occurs ``max_line_count`` times. ``null`` switches a rule off.
    """

    max_token_run: int | None = 8
    ngram_size: int = 6
    max_ngram_count: int | None = 4
    max_line_count: int | None = 3
    min_line_chars: int = 8

    def reason(self, answer_ids: list[int], text: str) -> str | None:
        """Why ``answer_ids`` (decoded: ``text``) is dropped, or None to keep it."""
        if self.max_token_run:
            run = 1
            for a, b in zip(answer_ids, answer_ids[1:]):
                run = run + 1 if a == b else 1
                if run >= self.max_token_run:
                    return f"token {a} repeated {run} times in a row"
        if self.max_ngram_count:
            counts: dict[tuple, int] = {}
            n = self.ngram_size
            for i in range(len(answer_ids) - n + 1):
                gram = tuple(answer_ids[i: i + n])
                counts[gram] = counts.get(gram, 0) + 1
                if counts[gram] >= self.max_ngram_count:
                    return f"{n}-gram {list(gram)} occurs {counts[gram]} times"
        if self.max_line_count:
            counts = {}
            for line in (x.strip() for x in re.split(r"[\r\n]+", text)):
                if len(line) >= self.min_line_chars:
                    counts[line] = counts.get(line, 0) + 1
                    if counts[line] >= self.max_line_count:
                        return f"line {line[:40]!r} occurs {counts[line]} times"
        return None
