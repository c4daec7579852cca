"""Data: the stdlib-code corpus, the paper datasets' configs on local files, and clear errors for bad input."""

from __future__ import annotations

import ast
import json
import time
from pathlib import Path

import pandas as pd
import pytest
from hydra.utils import instantiate

from lit_spec.config import compose_config
from lit_spec.data import IGNORE_INDEX, HFSource, StdlibCodeSource
from lit_spec.data import stdlib_code
from lit_spec.errors import ConfigError, DataError
from lit_spec.models import train_bpe_tokenizer


VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
                 "detailed, and polite answers to the user's questions.")


@pytest.fixture(scope="module")
def tok():
    texts = ["def add(a, b):\n    return a + b\n", "SELECT name FROM singer WHERE age > 20",
             "Question: how many apples? Answer: 3 #### 3", "USER: hello ASSISTANT: hi there"] * 4
    return train_bpe_tokenizer(texts, vocab_size=300)


# ---- stdlib-code ------------------------------------------------------------------------------------------------
MODULE_A = '''\
import functools


def documented(x, y):
    """Add two numbers, the documented way."""
    z = x + y
    return z


def undocumented(x):
    y = x * 2
    z = y + 1
    return z


def only_docstring():
    """A function whose body is just this docstring."""


def short_doc(x):
    """Tiny."""
    y = x
    return y


class Shape:
    @functools.lru_cache(maxsize=None)
    def area(self, scale):
        """Area of the shape, scaled by a factor."""
        w = self.w * scale
        return w * self.h

    @property
    def name(self):
        """The shape's name, a read-only string."""
        n = type(self).__name__
        return n.lower()

    @name.setter
    def name(self, value):
        """Setting the name is refused loudly."""
        msg = f"cannot set {value}"
        raise AttributeError(msg)

    def page(self, title):
        """An HTML page whose template sits at column 0."""
        body = """\\
<html>
<title>%s</title>
</html>"""
        return body % title

    def commented(self, x):
        """A method with a comment at column 0 in its body."""
        y = x + 1
## a stray comment at column 0
        return y


async def fetch(url, session):
    """Fetch a url asynchronously and return its text."""
    async with session.get(url) as r:
        return await r.text()


def outer(n):
    """Outer function that builds a helper."""
    def helper(k):
        """Helper doubling its argument."""
        d = k * 2
        return d
    return helper(n)
\f

def after_form_feed(a):
    """A function that follows a form feed line."""
    b = a - 1
    return b
'''

MODULE_B = '''\
def double_it(v):
    """Return the value doubled, for testing."""
    w = v * 2
    return w
'''


@pytest.fixture
def code_root(tmp_path) -> Path:
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "a.py").write_text(MODULE_A)
    (root / "pkg" / "b.py").write_text(MODULE_B)
    (root / "tests" / "test_b.py").write_text(MODULE_B)  # test directories are skipped
    (root / "broken.py").write_text("def f(:\n    '''Not python at all.'''\n")  # unparsable files are skipped
    return root


def _assert_pairs_are_clean(rows):
    for r in rows:
        tree = ast.parse(r["code"])  # code parses on its own: dedented, nothing cut in half
        assert len(tree.body) == 1 and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)), r["id"]
        assert ast.get_docstring(tree.body[0]) is None, f"{r['id']}: docstring not removed"
        assert r["docstring"].strip(), r["id"]


def test_iter_pairs_extracts_docstring_function_pairs(code_root):
    rows = list(stdlib_code.iter_pairs(code_root))
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows), "ids are unique"
    assert set(by_id) == {
        "a:documented", "a:Shape.area", "a:Shape.name", "a:Shape.name#2", "a:Shape.page", "a:Shape.commented",
        "a:fetch", "a:outer", "a:outer.<locals>.helper", "a:after_form_feed", "pkg.b:double_it"}
    _assert_pairs_are_clean(rows)
    for r in rows:  # these docstrings are distinctive sentences: not a word of them may stay behind
        if r["id"] != "a:outer":
            assert r["docstring"] not in r["code"], r["id"]

    doc = by_id["a:documented"]
    assert doc["docstring"] == "Add two numbers, the documented way."
    assert doc["code"] == "def documented(x, y):\n    z = x + y\n    return z"
    # decorators are kept, the method is dedented to column 0
    assert by_id["a:Shape.area"]["code"].startswith("@functools.lru_cache(maxsize=None)\ndef area(self, scale):\n")
    assert by_id["a:Shape.name#2"]["code"].startswith("@name.setter\ndef name(self, value):")
    # a multi-line string at column 0 stays verbatim, and the method still parses
    assert '"""\\\n<html>\n<title>%s</title>\n</html>"""' in by_id["a:Shape.page"]["code"]
    assert by_id["a:Shape.commented"]["code"].startswith("def commented(self, x):\n    y = x + 1\n")
    assert by_id["a:fetch"]["code"].startswith("async def fetch(url, session):\n    async with")
    # a form feed does not shift the lines that are cut out
    assert by_id["a:after_form_feed"]["code"] == "def after_form_feed(a):\n    b = a - 1\n    return b"
    assert by_id["a:after_form_feed"]["docstring"] == "A function that follows a form feed line."
    # the nested helper keeps its docstring inside outer's code; its own pair has it removed
    assert "Helper doubling its argument." in by_id["a:outer"]["code"]
    assert by_id["a:outer.<locals>.helper"]["code"] == "def helper(k):\n    d = k * 2\n    return d"


def test_the_stdlib_source_parses_once_then_reads_its_pairs_back_until_a_file_changes(code_root, monkeypatch):
    from lit_spec.data import StdlibCodeSource

    parsed = []
    parse = stdlib_code.iter_pairs
    monkeypatch.setattr(stdlib_code, "iter_pairs", lambda *a, **k: parsed.append(1) or parse(*a, **k))
    ids = lambda dd: sorted(r["id"] for split in dd.values() for r in split)   # noqa: E731
    first = ids(StdlibCodeSource(root=str(code_root)).load())
    assert ids(StdlibCodeSource(root=str(code_root)).load()) == first and len(parsed) == 1, "read back, not parsed"
    (code_root / "pkg" / "b.py").write_text(MODULE_B + '\n\ndef added(x):\n    """A function added later."""\n'
                                            '    y = x * 3\n    return y\n')
    assert ids(StdlibCodeSource(root=str(code_root)).load()) == sorted([*first, "pkg.b:added"]) and len(parsed) == 2


def test_iter_pairs_split_is_deterministic_seeded_and_proportional(tmp_path):
    root = tmp_path / "many"
    root.mkdir()
    src = "\n\n".join(f'def f{i}(x):\n    """Function number {i} of many."""\n    y = x + {i}\n    return y'
                      for i in range(1000))
    (root / "many.py").write_text(src)

    first = list(stdlib_code.iter_pairs(root, seed=0, val_fraction=0.1, test_fraction=0.2))
    again = list(stdlib_code.iter_pairs(root, seed=0, val_fraction=0.1, test_fraction=0.2))
    other = list(stdlib_code.iter_pairs(root, seed=1, val_fraction=0.1, test_fraction=0.2))
    assert len(first) == 1000
    assert first == again, "same seed, same records and splits"
    assert [(r["id"], r["code"]) for r in other] == [(r["id"], r["code"]) for r in first]
    moved = sum(a["split"] != b["split"] for a, b in zip(first, other))
    assert 200 < moved < 800, f"another seed should move some records, moved {moved}"
    share = {s: sum(r["split"] == s for r in first) / len(first) for s in ("train", "validation", "test")}
    assert abs(share["test"] - 0.2) < 0.04 and abs(share["validation"] - 0.1) < 0.03, share
    # a record's split depends on its id only: other files do not move it
    (root / "zzz.py").write_text(MODULE_B)
    grown = {r["id"]: r["split"] for r in stdlib_code.iter_pairs(root, seed=0, val_fraction=0.1, test_fraction=0.2)}
    assert all(grown[r["id"]] == r["split"] for r in first) and "zzz:double_it" in grown


def test_stdlib_source_on_the_real_stdlib():
    dd = StdlibCodeSource().load()  # lru-cached: the tiny model's tokenizer reads the same records
    assert set(dd) == {"train", "validation", "test"}
    sizes = {k: len(v) for k, v in dd.items()}
    total = sum(sizes.values())
    assert total > 1000, sizes
    assert 0.03 < sizes["validation"] / total < 0.07 and 0.03 < sizes["test"] / total < 0.07, sizes
    ids = [i for split in dd.values() for i in split["id"]]
    assert len(set(ids)) == len(ids) == total
    for split, ds in dd.items():
        assert set(ds["split"]) == {split}
    _assert_pairs_are_clean([r for split in dd.values() for r in split])
    assert StdlibCodeSource().load()["test"]["id"] == dd["test"]["id"]


# ---- the paper datasets on local files --------------------------------------------------------------------------
def spider_rows(n=20):
    return [{"question": f"How many singers are older than {i}?", "db_id": f"concert_singer_{i % 3}",
             "query": f"SELECT count(*) FROM singer WHERE age > {i}"} for i in range(n)]


def gsm8k_rows(n=20):
    return [{"question": f"Tom has {i} apples and buys 2 more. How many apples does he have?",
             "answer": f"He has {i} + 2 = <<{i}+2={i + 2}>>{i + 2} apples.\n#### {i + 2}"} for i in range(n)]


def csn_rows(n=20):
    return [{"func_documentation_string": f"Return x plus {i}.",
             "func_code_string": f"def add_{i}(x):\n    \"\"\"Return x plus {i}.\"\"\"\n\treturn x + {i}\n"}
            for i in range(n)]


def sharegpt_rows(n=20):
    rows = [{"id": f"conv{i}", "conversations": [
        {"from": "human", "value": f"Write a haiku about the number {i}."},
        {"from": "gpt", "value": f"Number {i} stands tall,\nquiet in the morning light,\ncounting on its own."},
        {"from": "human", "value": "Another one?"},
        {"from": "gpt", "value": "No."}]} for i in range(n)]
    dropped = [  # first turn not human, or no assistant reply: not a prompt/answer pair
        {"id": "gpt_first", "conversations": [{"from": "gpt", "value": "I speak first."},
                                              {"from": "human", "value": "Fine."}]},
        {"id": "system_first", "conversations": [{"from": "system", "value": "Be terse."},
                                                 {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hi"}]},
        {"id": "lonely", "conversations": [{"from": "human", "value": "Anyone there?"}]},
    ]
    return rows + dropped


def mbpp_rows(n=20):
    return [{"task_id": 600 + i, "text": f"Write a function to add {i} to a number.",
             "code": f"def add_{i}(x):\r\n  return x + {i}", "test_setup_code": "",
             "test_list": [f"assert add_{i}(1) == {i + 1}", f"assert add_{i}(-{i}) == 0", f"assert add_{i}(0) == {i}"]}
            for i in range(n)]


def cnn_dailymail_rows(n=20):
    return [{"id": f"{i:040x}", "article": f"(CNN) -- The new bridge over the river opened in Town {i} on Monday, "
                                          f"after {i + 2} years of work.\n\nThe mayor said: \"It was worth it.\"",
             "highlights": f"A bridge opens in Town {i}\nIt took {i + 2} years to build"} for i in range(n)]


def wmt16_rows(n=20):
    return [{"translation": {"de": f"Die Brücke über den Fluss {i} ist fertig.",
                             "en": f"The bridge over river {i} is finished."}} for i in range(n)]


def spider_expected(r):
    return (f"Translate the question into SQL for the database `{r['db_id']}`.\nQuestion: {r['question']}\nSQL: ",
            r["query"])


def gsm8k_expected(r):
    return f"Question: {r['question']}\nAnswer: Let's think step by step. ", r["answer"]


def csn_expected(r):
    return f'"""{r["func_documentation_string"]}"""\n', r["func_code_string"]


def sharegpt_expected(r):
    turns = r["conversations"]
    if turns[0]["from"] != "human" or len(turns) < 2:
        return None
    return f"{VICUNA_SYSTEM} USER: {turns[0]['value']} ASSISTANT:", turns[1]["value"]


def mbpp_expected(r):
    tests = "\n".join(r["test_list"])
    return (f"You are an expert Python programmer, and here is your task: {r['text']} Your code should pass these "
            f"tests:\n\n{tests}\n", r["code"])


def cnn_dailymail_expected(r):
    return (f"Summarize the following document in one sentence and output nothing else.\nDocument: {r['article']}\n"
            "Summary:", r["highlights"])


def wmt16_expected(r):
    pair = r["translation"]
    return (f"Translate this German sentence to English and output nothing else.\nGerman: {pair['de']}\nEnglish:",
            pair["en"])


DATASETS = {  # config name: (rows, expected (prompt, answer) text of a row or None if dropped, chat)
    "spider": (spider_rows, spider_expected, False),
    "gsm8k": (gsm8k_rows, gsm8k_expected, False),
    "code_search_net": (csn_rows, csn_expected, False),
    "sharegpt": (sharegpt_rows, sharegpt_expected, True),
    # the Ouroboros paper's tasks (HumanEval, evaluation-only, is tested in test_task_data.py)
    "mbpp": (mbpp_rows, mbpp_expected, False),                       # test_list joined into the prompt
    "cnn_dailymail": (cnn_dailymail_rows, cnn_dailymail_expected, False),
    "wmt16": (wmt16_rows, wmt16_expected, False),                     # nested {translation[de]} / {translation[en]}
}


def write_rows(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(path)
    else:
        raise ValueError(path)
    return path


def build_datamodule(tokenizer, *overrides: str):
    cfg = compose_config(list(overrides))
    return instantiate(cfg.data, _partial_=True, _convert_="all")(tokenizer=tokenizer)


def setup_datamodule(tokenizer, *overrides: str):
    dm = build_datamodule(tokenizer, *overrides)
    dm.setup("fit")
    return dm


def decoded(tokenizer, dm) -> dict[str, list[tuple[str, str]]]:
    """(prompt, answer) text of every record of every split; checks BOS/EOS on the way."""
    out = {}
    for split, ds in dm.splits.items():
        pairs = []
        for r in ds:
            assert r["answer_ids"][-1] == tokenizer.eos_token_id, "a finished answer ends in EOS"
            pairs.append((tokenizer.decode(r["prompt_ids"], skip_special_tokens=True),
                          tokenizer.decode(r["answer_ids"][:-1])))
        out[split] = pairs
    return out


@pytest.mark.parametrize("fmt", [".json", ".jsonl", ".parquet"])
@pytest.mark.parametrize("name", list(DATASETS))
def test_paper_dataset_from_local_file(tok, tmp_path, name, fmt):
    make_rows, expected, chat = DATASETS[name]
    rows = make_rows()
    path = write_rows(rows, tmp_path / f"{name}{fmt}")
    dm = setup_datamodule(tok, f"data={name}", f"data.path={path}")

    assert dm.source.describe() == f"local file {path}"
    assert set(dm.splits) == {"train", "validation", "test"}
    for ds in dm.splits.values():
        assert ds.column_names == ["prompt_ids", "answer_ids"]
    assert len(dm.splits["train"]) > 0 and len(dm.splits["validation"]) > 0  # validation carved out of train
    texts = decoded(tok, dm)
    got = [p for pairs in texts.values() for p in pairs]
    want = [e for e in map(expected, rows) if e is not None]
    assert sorted(got) == sorted(want)  # every kept record, in exactly one split, rendered as the template says

    first = dm.splits["train"][0]
    if chat:  # this tokenizer has no chat template: the config's Vicuna fallback wraps the first turn
        assert tok.chat_template is None
        prompt = tok.decode(first["prompt_ids"])
        assert "USER:" in prompt and prompt.endswith("ASSISTANT:")
        assert len(got) == len(rows) - 3, "records whose first turn is not human (or that have no reply) are dropped"
    else:
        assert first["prompt_ids"][0] == tok.bos_token_id


def test_split_files_in_a_directory(tok, tmp_path):
    """train*/test*/dev* files of a directory become those splits; a missing validation is carved out of train."""
    rows = gsm8k_rows(30)
    write_rows(rows[:20], tmp_path / "gsm8k" / "train.jsonl")
    write_rows(rows[20:], tmp_path / "gsm8k" / "test.jsonl")
    dm = setup_datamodule(tok, "data=gsm8k", f"data.path={tmp_path / 'gsm8k'}")
    texts = decoded(tok, dm)
    assert sorted(texts["test"]) == sorted(map(gsm8k_expected, rows[20:]))
    assert len(texts["train"]) + len(texts["validation"]) == 20 and len(texts["validation"]) >= 1

    write_rows(spider_rows(12), tmp_path / "spider" / "train.json")
    write_rows(spider_rows(3), tmp_path / "spider" / "dev.json")
    dm = setup_datamodule(tok, "data=spider", f"data.path={tmp_path / 'spider'}")
    assert {k: len(v) for k, v in dm.splits.items()} == {"train": 12, "validation": 3, "test": 0}


def test_collate_masks_the_prompt_and_padding(tok, tmp_path):
    path = write_rows(gsm8k_rows(), tmp_path / "gsm8k.jsonl")
    dm = setup_datamodule(tok, "data=gsm8k", f"data.path={path}", "data.batch_size=4")
    records = [dm.splits["train"][i] for i in range(3)]
    records[1] = {**records[1], "answer_ids": records[1]["answer_ids"][:3]}  # lengths differ: padding is needed
    batch = dm.collate(records)
    width = max(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in records)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (3, width)
    for i, r in enumerate(records):
        n_prompt, n = len(r["prompt_ids"]), len(r["prompt_ids"]) + len(r["answer_ids"])
        assert batch["input_ids"][i, :n].tolist() == r["prompt_ids"] + r["answer_ids"]
        assert batch["input_ids"][i, n:].eq(tok.pad_token_id).all()
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (width - n)
        assert batch["labels"][i, :n_prompt].eq(IGNORE_INDEX).all(), "the prompt is not trained on"
        assert batch["labels"][i, n_prompt:n].tolist() == r["answer_ids"]
        assert batch["labels"][i, n:].eq(IGNORE_INDEX).all(), "padding is not trained on"

    train_batch = next(iter(dm.train_dataloader()))
    assert train_batch["input_ids"].shape[0] == 4
    assert (train_batch["labels"] != IGNORE_INDEX).sum() > 0


def test_length_limits_and_sample_limits(tok, tmp_path):
    rows = gsm8k_rows()
    rows[0] = {**rows[0], "question": "why " * 200}  # a prompt far beyond the limit: dropped
    path = write_rows(rows, tmp_path / "gsm8k.jsonl")
    dm = setup_datamodule(tok, "data=gsm8k", f"data.path={path}", "data.max_prompt_tokens=120",
                          "data.max_answer_tokens=5", "data.max_train_samples=8")
    assert len(dm.splits["train"]) <= 8
    prompts = [tok.decode(r["prompt_ids"]) for s in dm.splits.values() for r in s]
    assert not any("why why" in p for p in prompts)
    for split in dm.splits.values():
        for r in split:
            assert len(r["prompt_ids"]) <= 120
            assert len(r["answer_ids"]) == 5 and r["answer_ids"][-1] != tok.eos_token_id  # truncated: no EOS


def test_sharegpt_uses_the_tokenizers_own_chat_template(tmp_path):
    tok = train_bpe_tokenizer(["hello there", "general kenobi"] * 4, vocab_size=280)
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    path = write_rows(sharegpt_rows(), tmp_path / "sharegpt.json")
    dm = setup_datamodule(tok, "data=sharegpt", f"data.path={path}")
    prompt = tok.decode(dm.splits["train"][0]["prompt_ids"])
    assert prompt.startswith("<|user|>Write a haiku") and prompt.endswith("<|assistant|>")
    assert "USER:" not in prompt


def test_sharegpt_and_ultrachat_mix_every_assistant_turn_split_by_split(tmp_path):
    """data=sharegpt_ultrachat (EAGLE-3's prompts): both sources in one dataset, a record per assistant reply to a user
    turn, after the conversation's earlier turns in the chat template (a system turn too); a conversation without one
    gives none."""
    tok = train_bpe_tokenizer(["hello there", "general kenobi"] * 4, vocab_size=280)
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    ultrachat = [{"prompt_id": str(i), "messages": [{"role": "user", "content": f"Name a colour, {i}."},
                                                    {"role": "assistant", "content": "Blue."}]} for i in range(10)]
    ultrachat.append({"prompt_id": "x", "messages": [{"role": "assistant", "content": "I start."}]})
    sharegpt = write_rows(sharegpt_rows(), tmp_path / "sharegpt.json")
    ultrachat = write_rows(ultrachat, tmp_path / "ultra" / "train_sft.json")
    dm = setup_datamodule(tok, "data=sharegpt_ultrachat", f"data.source.sources.sharegpt.path={sharegpt}",
                          f"data.source.sources.ultrachat.path={ultrachat}")
    records = [(tok.decode(r["prompt_ids"]), tok.decode(r["answer_ids"][:-1])) for split in ("train", "validation")
               for r in dm.splits[split]]
    assert len(records) == 2 * 20 + 1 + 10
    assert sum(p.endswith("number 7.") for p, _ in records) == 1
    second = [(p, a) for p, a in records if p.endswith("<|user|>Another one?")]
    assert len(second) == 20 and all(a == "No." and "<|assistant|>Number" in p for p, a in second)
    assert [p for p, _ in records if p.startswith("<|system|>")] == ["<|system|>Be terse.<|user|>Hi"]
    assert sum("colour" in p for p, _ in records) == 10
    with pytest.raises(DataError, match="data.path is not supported by MixedSource"):
        setup_datamodule(tok, "data=sharegpt_ultrachat", f"data.path={sharegpt}")
    with pytest.raises(DataError, match="earlier turns .* set data.template.chat=true"):
        setup_datamodule(tok, "data=sharegpt_ultrachat", f"data.source.sources.sharegpt.path={sharegpt}",
                         f"data.source.sources.ultrachat.path={ultrachat}", "data.template.chat=false")


def test_chat_template_missing_everywhere(tok, tmp_path):
    path = write_rows(sharegpt_rows(), tmp_path / "sharegpt.json")
    with pytest.raises(DataError, match="fallback_chat_template"):
        setup_datamodule(tok, "data=sharegpt", f"data.path={path}", "data.template.fallback_chat_template=null")


# ---- bad input --------------------------------------------------------------------------------------------------
def test_missing_data_file(tok, tmp_path):
    missing = tmp_path / "nowhere" / "spider.jsonl"
    with pytest.raises(DataError, match="no such file or directory") as e:
        setup_datamodule(tok, "data=spider", f"data.path={missing}")
    assert str(missing) in str(e.value)


def test_directory_without_data_files(tok, tmp_path):
    (tmp_path / "README.md").write_text("not data")
    with pytest.raises(DataError, match=r"no \.json/\.jsonl/\.parquet/\.csv files") as e:
        setup_datamodule(tok, "data=gsm8k", f"data.path={tmp_path}")
    assert str(tmp_path) in str(e.value)


def test_unsupported_or_mixed_file_kinds(tok, tmp_path):
    txt = tmp_path / "gsm8k.txt"
    txt.write_text("Question: 1+1?")
    with pytest.raises(DataError, match=r"expected one of .*\.txt"):
        setup_datamodule(tok, "data=gsm8k", f"data.path={txt}")
    write_rows(gsm8k_rows(), tmp_path / "mixed" / "train.jsonl")
    write_rows(gsm8k_rows(), tmp_path / "mixed" / "test.parquet")
    with pytest.raises(DataError, match="all files of one kind"):
        setup_datamodule(tok, "data=gsm8k", f"data.path={tmp_path / 'mixed'}")


@pytest.mark.parametrize("name, drop", [("spider", "db_id"), ("gsm8k", "answer"),
                                        ("code_search_net", "func_code_string"), ("cnn_dailymail", "highlights")])
def test_file_missing_a_template_column(tok, tmp_path, name, drop):
    make_rows, _, _ = DATASETS[name]
    rows = [{k: v for k, v in r.items() if k != drop} for r in make_rows()]
    path = write_rows(rows, tmp_path / f"{name}.jsonl")
    with pytest.raises(DataError, match="prompt template needs") as e:
        setup_datamodule(tok, f"data={name}", f"data.path={path}")
    assert f"['{drop}']" in str(e.value) and str(path) in str(e.value)


def test_sharegpt_without_conversations(tok, tmp_path):
    path = write_rows([{"id": "1", "messages": [{"role": "user", "content": "hi"}]}] * 5, tmp_path / "chats.json")
    with pytest.raises(DataError, match="train split is empty"):
        setup_datamodule(tok, "data=sharegpt", f"data.path={path}")


@pytest.mark.parametrize("fname, content", [("gsm8k.jsonl", ""), ("gsm8k.jsonl", "\n"), ("gsm8k.json", "[]"),
                                           ("gsm8k.json", "[\n]\n"), ("gsm8k.csv", "question,answer\n"),
                                           ("gsm8k.parquet", None)])
def test_empty_data_file(tok, tmp_path, fname, content):
    path = tmp_path / fname
    if content is None:  # a parquet table with the columns and no rows
        pd.DataFrame({"question": ["q"], "answer": ["a"]}).iloc[:0].to_parquet(path)
    else:
        path.write_text(content)
    with pytest.raises(DataError, match="empty dataset") as e:
        setup_datamodule(tok, "data=gsm8k", f"data.path={path}")
    assert str(path) in str(e.value)


def test_all_records_dropped(tok, tmp_path):
    rows = [r for r in sharegpt_rows() if r["id"] in {"gpt_first", "system_first", "lonely"}]
    path = write_rows(rows, tmp_path / "sharegpt.json")
    with pytest.raises(DataError, match="train split is empty") as e:
        setup_datamodule(tok, "data=sharegpt", f"data.path={path}")
    assert str(path) in str(e.value)


@pytest.mark.parametrize("name", list(DATASETS))
def test_unreachable_hub_dataset_fails_fast(tok, name):
    start = time.monotonic()
    with pytest.raises(DataError, match="no-such-org/no-such-dataset") as e:
        setup_datamodule(tok, f"data={name}", "data.source.hub_id=no-such-org/no-such-dataset")
    assert "data.path" in str(e.value), "the message says how to use a local copy"
    assert time.monotonic() - start < 5, "offline, a hub dataset must fail at once, not wait on the network"


@pytest.mark.parametrize("fname, content", [
    ("spider.json", '[{"question": "q", "db_id": "d", "query": '),
    ("spider.jsonl", '{"question": "q", "db_id": "d", "query": "SELECT 1"}\n{"question": oops}\n'),
    ("spider.parquet", "PAR1 this is not parquet"),
])
def test_malformed_file(tok, tmp_path, fname, content):
    path = tmp_path / fname
    path.write_text(content)
    with pytest.raises(DataError, match="could not be read") as e:
        setup_datamodule(tok, "data=spider", f"data.path={path}")
    assert str(path) in str(e.value)
    assert "An error occurred while generating the dataset" not in str(e.value), "says what is wrong"


def test_source_config_errors(tok, tmp_path):
    with pytest.raises(ConfigError, match="hub id .* or a local file"):
        HFSource()
    with pytest.raises(DataError, match="data.path is not supported by StdlibCodeSource"):
        build_datamodule(tok, "data=stdlib_code", f"data.path={tmp_path}")
    with pytest.raises(DataError, match="needs a tokenizer"):
        build_datamodule(None, "data=gsm8k", f"data.path={tmp_path}").setup("fit")


def test_template_column_check_is_direct():
    from lit_spec.data import PromptTemplate

    t = PromptTemplate(prompt="{question} in {db_id}", answer="{query}")
    assert t.columns == {"question", "db_id", "query"}
    t.check_columns(["question", "db_id", "query", "extra"], "x")
    with pytest.raises(DataError, match=r"my data has no column\(s\) \['db_id', 'query'\]"):
        t.check_columns(["question"], "my data")
    assert t.render({"question": "Q", "db_id": "D", "query": "S"}) == ("Q in D", "S")
    nested = PromptTemplate("{conversations[0][value]}: {meta.lang}", "{answer}")
    assert nested.columns == {"conversations", "meta", "answer"}
