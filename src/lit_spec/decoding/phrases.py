"""The phrase pool: short token sequences (n-grams, phrases) keyed by their first token, each key's phrases a bounded
LRU. Lookahead decoding collects its window's n-grams in one (one pool per decode); Ouroboros drafts, lengthens
drafts and harvests verification results with one that outlives a decode (warm start, §3.4) and can be saved.

A phrase is stored as its key token and its *continuation* (the tokens after the key): ``get(key)`` returns
continuations, most recently added or refreshed first. ``ngram_continuation`` finds phrases without a pool: what
followed the latest earlier occurrence of a sequence's own last n-gram (prompt lookup decoding's drafts).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

from lit_spec.errors import ConfigError, check_count
from lit_spec.io import write_json

FORMAT = "lit_spec.phrase_pool/1"


def ngram_continuation(tokens: list[int], max_ngram: int, num_tokens: int, min_ngram: int = 1) -> list[int]:
    """Prompt lookup (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding): the up to ``num_tokens`` tokens
    that followed the latest earlier occurrence of the last n tokens of ``tokens``, trying n from ``max_ngram`` down
    to ``min_ngram``; [] when no such n-gram occurs before the end. The reference implementation (and transformers'
    ``prompt_lookup_num_tokens``) takes the earliest occurrence instead; the latest one is the most recent context.
    An occurrence may overlap the final n-gram (a run ``a a a`` continues with ``a``)."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        last = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):   # the final n-gram itself (start len - n) has no sequel
            if tokens[start] == last[0] and tokens[start: start + n] == last:
                return tokens[start + n: start + n + num_tokens]
    return []


class PhrasePool:
    def __init__(self, capacity: int):
        self.capacity = check_count("phrase pool capacity", capacity)   # phrases per key token
        self.table: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, phrase) -> None:
        """Store ``phrase`` (key token + at least one more) as the key's most recent one, dropping the key's least
        recently used phrase beyond ``capacity``."""
        phrase = tuple(int(t) for t in phrase)
        if len(phrase) < 2:
            return
        entries = self.table.setdefault(phrase[0], OrderedDict())
        rest = phrase[1:]
        if rest in entries:
            entries.move_to_end(rest)
        else:
            entries[rest] = None
            if len(entries) > self.capacity:
                entries.popitem(last=False)

    def discard(self, key: int, continuation) -> None:
        entries = self.table.get(int(key))
        if entries is not None:
            entries.pop(tuple(continuation), None)

    def get(self, key: int, limit: int | None = None) -> list[tuple[int, ...]]:
        """The continuations of the phrases that start with ``key``, most recent first (at most ``limit``)."""
        entries = self.table.get(int(key))
        if not entries:
            return []
        out = list(reversed(entries))
        return out if limit is None else out[:limit]

    def clear(self) -> None:
        self.table.clear()

    def __len__(self) -> int:
        return sum(len(v) for v in self.table.values())

    # ---- persistence ----------------------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write the pool as JSON (atomically), keys and phrases in LRU order, so ``load`` restores it exactly."""
        write_json(path, {"format": FORMAT, "capacity": self.capacity,
                          "phrases": [[key, [list(rest) for rest in entries]]
                                      for key, entries in self.table.items() if entries]})

    @classmethod
    def load(cls, path, capacity: int | None = None) -> "PhrasePool":
        """A pool saved by ``save``; ``capacity`` (default: the saved one) bounds it again (oldest dropped)."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"phrase pool {path}: no such file (write one with PhrasePool.save, or set "
                              "pool_path=null to start empty)")
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT!r}")
            pool = cls(capacity if capacity is not None else data["capacity"])
            for key, continuations in data["phrases"]:
                for rest in continuations:
                    pool.add([key, *rest])
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"phrase pool {path} is not a saved PhrasePool: {e}") from None
        return pool
