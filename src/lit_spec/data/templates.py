"""Prompt templates: turn a dataset record into (prompt text or chat messages, answer text)."""

from __future__ import annotations

import string
from typing import Mapping

from lit_spec.errors import DataError


def _fields(fmt: str) -> set[str]:
    """Top-level record fields a format string reads (``{question}``, ``{conversations[0][value]}``)."""
    names = set()
    for _, field, _, _ in string.Formatter().parse(fmt):
        if field:
            names.add(field.split("[")[0].split(".")[0])
    return names


class _NoNulls(string.Formatter):
    """``str.format`` that refuses null fields: a column (or a key inside one) that a record lacks comes out of
    ``datasets`` as None, which plain ``format`` would render as the text 'None'."""

    def get_field(self, field_name, args, kwargs):
        value, used = super().get_field(field_name, args, kwargs)
        if value is None:
            raise KeyError(f"{field_name} is null")
        return value, used


def _format(fmt: str, record: Mapping, which: str) -> str:
    """``fmt.format(**record)``; a field inside a column (``{translation[de]}``: a dict's key, a list's index) that a
    record lacks, or a null one, is a DataError that names it, not a bare KeyError from deep inside ``datasets.map``."""
    try:
        return _NoNulls().vformat(fmt, (), record)
    except (KeyError, IndexError, AttributeError, TypeError) as e:
        raise DataError(f"data.template.{which} {fmt!r} reads a field this record lacks ({type(e).__name__}: {e}); "
                        f"the record has {sorted(record)}") from e


class PromptTemplate:
    """Format strings over a record's columns.

    Fields are ``str.format`` fields, so they can reach inside a column: ``{translation[de]}`` (a dict's key, e.g.
    WMT's ``translation`` column), ``{conversations[0][value]}`` (a list's index, then a key).

    Args:
        prompt: format string of the prompt, e.g. ``"Question: {question}\\nAnswer: "``.
        answer: format string of the target answer, e.g. ``"{answer}"``.
        chat: wrap the prompt as the user turn of the tokenizer's chat template (ShareGPT, chat models), after a
            record's ``history`` (JSON role/content turns: a conversation's earlier turns);
            ``fallback_chat_template`` is used when the tokenizer has none (e.g. Vicuna's v1.1 format).
        system: optional system message for chat prompts.
    """

    def __init__(self, prompt: str, answer: str, chat: bool = False, system: str | None = None,
                 fallback_chat_template: str | None = None):
        self.prompt, self.answer, self.chat, self.system = prompt, answer, chat, system
        self.fallback_chat_template = fallback_chat_template
        self.columns = _fields(prompt) | _fields(answer)

    def check_columns(self, column_names: list[str], where: str) -> None:
        missing = sorted(self.columns - set(column_names))
        if missing:
            raise DataError(f"{where} has no column(s) {missing} that the prompt template needs "
                            f"(it has {sorted(column_names)}); set data.template.prompt/answer to its columns")

    def render(self, record: Mapping) -> tuple[str, str]:
        return _format(self.prompt, record, "prompt"), _format(self.answer, record, "answer")

    def prompt_ids(self, tokenizer, prompt: str, history: list[dict] | None = None) -> list[int]:
        """The prompt's token ids; ``history``: the conversation's earlier turns (role/content), before it."""
        if not self.chat:
            if history:
                raise DataError("a record with earlier turns (a conversation's later turn) needs a chat template: "
                                "set data.template.chat=true")
            return tokenizer(prompt, add_special_tokens=True)["input_ids"]
        messages = ([{"role": "system", "content": self.system}] if self.system else [])
        messages += [*(history or []), {"role": "user", "content": prompt}]
        template = None if tokenizer.chat_template else self.fallback_chat_template
        if template is None and not tokenizer.chat_template:
            raise DataError("data.template.chat=true but the tokenizer has no chat template; "
                            "set data.template.fallback_chat_template")
        ids = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids)
