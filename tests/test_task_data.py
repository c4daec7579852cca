"""The Ouroboros paper's tasks (§4.1): HumanEval as evaluation-only data, the eval-split rule on other datasets,
WMT16's nested fields and MBPP's test cases when a record is malformed, ROUGE-1, seeded evaluation samples, and the
bench experiments (ouroboros_*) with their model pairs, composed with bench.yaml, loading prompts from local files
and running on micro models."""

from __future__ import annotations

import pytest
from omegaconf import open_dict

from lit_spec.config import compose_config
from lit_spec.data import HFSource
from lit_spec.data.metrics import rouge1
from lit_spec.benchmark import load_records, run_benchmark
from lit_spec.errors import ConfigError, DataError
from lit_spec.models import train_bpe_tokenizer
from test_data import build_datamodule, decoded, gsm8k_rows, mbpp_rows, setup_datamodule, wmt16_rows, write_rows


# a tokenizer chat template of the [INST] kind (Llama-2-chat's shape): the experiments of chat models set chat=true
INST_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + "
                 "' [/INST]' }}{% endif %}{% endfor %}")
TASKS = ("gsm8k", "humaneval", "mbpp", "cnndm", "wmt16")


@pytest.fixture(scope="module")
def tok():
    texts = ["def add(a, b):\n    return a + b\n", "Die Brücke ist fertig. The bridge is finished.",
             "Question: how many apples? Answer: 3 #### 3", "[INST] Summarize the document [/INST]"] * 4
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    tokenizer.chat_template = INST_TEMPLATE
    return tokenizer


def setup_eval(tokenizer, *overrides: str):
    """A datamodule set up as the bench sets it up (stage "test")."""
    dm = build_datamodule(tokenizer, *overrides)
    dm.setup("test")
    return dm


def humaneval_rows(n=6):
    return [{"task_id": f"HumanEval/{i}", "entry_point": f"add_{i}",
             "prompt": f"def add_{i}(x: int) -> int:\n    \"\"\"Return x plus {i}.\"\"\"\n",
             "canonical_solution": f"    return x + {i}\n", "test": f"def check(f):\n    assert f(0) == {i}\n"}
            for i in range(n)]


def humaneval_expected(r):
    return ("Complete the following Python code. Write only the code, without tests or explanations.\n" + r["prompt"],
            r["canonical_solution"])


# ---- evaluation-only data ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fname", ["HumanEval.jsonl", "test.parquet", "openai_humaneval/test-00000-of-00001.parquet"])
def test_humaneval_is_evaluation_only(tok, tmp_path, fname):
    """HumanEval has only a test split: a local file (named after the split or not) becomes it whole, nothing is
    carved out of it, train and validation stay empty."""
    rows = humaneval_rows()
    path = write_rows(rows, tmp_path / fname)
    dm = setup_eval(tok, "data=humaneval", f"data.path={path.parent if '/' in fname else path}")
    assert {k: len(v) for k, v in dm.splits.items()} == {"train": 0, "validation": 0, "test": len(rows)}
    assert decoded(tok, dm)["test"] == [humaneval_expected(r) for r in rows]  # every record, in the file's order
    assert dm.eval_records("test", 2)[0]["prompt_ids"][0] == tok.bos_token_id


def test_evaluation_only_data_refuses_training(tok, tmp_path):
    path = write_rows(humaneval_rows(), tmp_path / "HumanEval.jsonl")
    dm = build_datamodule(tok, "data=humaneval", f"data.path={path}")
    with pytest.raises(DataError, match=r"evaluation-only data \(data.source.eval_split=test\) has no train split"):
        dm.setup("fit")
    dm.setup("test")  # the bench's stage is fine, and once set up, fit still refuses
    with pytest.raises(DataError, match="evaluation-only"):
        dm.setup("fit")


def test_eval_split_keeps_one_split_of_any_dataset(tok, tmp_path):
    """data.source.eval_split on a dataset with a train split (what the bench experiments set): only that split is
    kept and tokenized; the others are empty, and its file's records are not split up."""
    rows = mbpp_rows(30)
    write_rows(rows[:20], tmp_path / "mbpp" / "train.jsonl")
    write_rows(rows[20:], tmp_path / "mbpp" / "validation.jsonl")
    plain = setup_datamodule(tok, "data=mbpp", f"data.path={tmp_path / 'mbpp'}")
    assert {k: len(v) for k, v in plain.splits.items()} == {"train": 20, "validation": 10, "test": 0}
    only = setup_eval(tok, "data=mbpp", f"data.path={tmp_path / 'mbpp'}", "data.source.eval_split=validation")
    assert {k: len(v) for k, v in only.splits.items()} == {"train": 0, "validation": 10, "test": 0}
    assert decoded(tok, only)["validation"] == decoded(tok, plain)["validation"]

    with pytest.raises(DataError, match=r"dataset has no 'test' split \(it has \['train', 'validation'\]\)"):
        setup_eval(tok, "data=mbpp", f"data.path={tmp_path / 'mbpp'}", "data.source.eval_split=test")


def test_eval_split_errors(tok, tmp_path):
    with pytest.raises(ConfigError, match="eval_split='train': choose validation or test"):
        HFSource(hub_id="openai/openai_humaneval", eval_split="train")
    # a dataset without a train split and no eval_split: the message says how to read it
    write_rows(humaneval_rows(), tmp_path / "he" / "test.jsonl")
    with pytest.raises(DataError, match="no 'train' split.*data.source.eval_split=test"):
        setup_eval(tok, "data=humaneval", f"data.path={tmp_path / 'he'}", "data.source.eval_split=null")
    # an evaluation split whose every prompt is too long: named, like the train split's
    path = write_rows(humaneval_rows(), tmp_path / "HumanEval.jsonl")
    with pytest.raises(DataError, match="no test record fits data.max_prompt_tokens=4"):
        setup_eval(tok, "data=humaneval", f"data.path={path}", "data.max_prompt_tokens=4")


def test_humaneval_hub_dataset_fails_fast_offline(tok):
    with pytest.raises(DataError, match="no-such-org/humaneval.*data.path"):
        setup_eval(tok, "data=humaneval", "data.source.path=null", "data.source.hub_id=no-such-org/humaneval")


# ---- malformed records -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("translation, why", [
    ({"en": "Only English."}, "KeyError: 'de'"),
    ({"de": None, "en": "No German."}, "KeyError: 'translation\\[de\\] is null'"),  # null in the struct column
])
def test_wmt16_record_without_the_german_side(tok, tmp_path, translation, why):
    rows = wmt16_rows(5) + [{"translation": translation}]
    path = write_rows(rows, tmp_path / "wmt16.jsonl")
    with pytest.raises(DataError, match=f"data.template.prompt .*reads a field this record lacks \\({why}"):
        setup_datamodule(tok, "data=wmt16", f"data.path={path}")


def test_mbpp_without_test_cases(tok, tmp_path):
    rows = [{k: v for k, v in r.items() if k != "test_list"} for r in mbpp_rows(5)]
    path = write_rows(rows, tmp_path / "mbpp.jsonl")
    with pytest.raises(DataError, match="MBPP record 600: 'test_list' should be a list of assert statements, got "
                                        "NoneType"):
        setup_datamodule(tok, "data=mbpp", f"data.path={path}")


# ---- seeded evaluation samples -----------------------------------------------------------------------------------
def test_eval_shuffle_seed_draws_a_seeded_sample(tok, tmp_path):
    rows = gsm8k_rows(40)
    write_rows(gsm8k_rows(5), tmp_path / "gsm8k" / "train.jsonl")
    path = write_rows(rows, tmp_path / "gsm8k" / "test.jsonl")
    prompts = [f"Question: {r['question']}\nAnswer: Let's think step by step. " for r in rows]

    def first_prompts(*overrides):
        dm = setup_datamodule(tok, "data=gsm8k", f"data.path={path.parent}", "data.max_eval_samples=10", *overrides)
        assert len(dm.splits["test"]) == 10
        return [p for p, _ in decoded(tok, dm)["test"]]

    in_order = first_prompts()
    assert in_order == prompts[:10]
    sample = first_prompts("data.eval_shuffle_seed=0")
    assert sample == first_prompts("data.eval_shuffle_seed=0"), "the same seed draws the same sample"
    assert sample != in_order and sample != first_prompts("data.eval_shuffle_seed=1")
    assert len(set(sample)) == 10 and set(sample) <= set(prompts)


# ---- ROUGE-1 -----------------------------------------------------------------------------------------------------
def test_rouge1():
    assert rouge1("The cat sat.", "the cat sat") == 1.0  # lower-cased, punctuation is no token
    # prediction: the, cat; reference: the x2, cat, sat, on, mat -> overlap 2, P = 1, R = 2/6
    assert rouge1("the cat", "the cat sat on the mat") == pytest.approx(2 * (1 / 3) / (1 + 1 / 3))
    assert rouge1("the the the", "the") == pytest.approx(2 * (1 / 3) / (1 / 3 + 1))  # multisets: one 'the' matches
    assert rouge1("state-of-the-art", "state of the art") == 1.0  # hyphens split words
    assert rouge1("", "") == 0.0 and rouge1("x", "") == 0.0 and rouge1("a b", "c d") == 0.0


# ---- the bench experiments ---------------------------------------------------------------------------------------
PAIRS = {"gsm8k": ("meta-llama/Llama-2-70b-chat-hf", "meta-llama/Llama-2-7b-chat-hf"),
         "cnndm": ("meta-llama/Llama-2-70b-chat-hf", "meta-llama/Llama-2-7b-chat-hf"),
         "wmt16": ("meta-llama/Llama-2-70b-chat-hf", "meta-llama/Llama-2-7b-chat-hf"),
         "humaneval": ("deepseek-ai/deepseek-coder-33b-instruct", "deepseek-ai/deepseek-coder-6.7b-instruct"),
         "mbpp": ("deepseek-ai/deepseek-coder-33b-instruct", "deepseek-ai/deepseek-coder-6.7b-instruct")}
# Table 12 (speculative γ; lookahead W, β; Ouroboros γ, W, β, K), max generation length, prompts, split
PAPER = {"gsm8k": ((7,), (15, 6), (6, 17, 7, 3), 256, 100, "test"),
         "cnndm": ((4,), (16, 5), (4, 13, 6, 3), 128, 100, "test"),
         "wmt16": ((5,), (18, 7), (4, 13, 6, 3), 64, 100, "test"),
         "humaneval": ((3,), (16, 7), (11, 20, 8, 3), 512, 164, "test"),
         "mbpp": ((5,), (15, 7), (7, 15, 6, 3), 512, 90, "validation")}


@pytest.mark.parametrize("task", TASKS)
def test_experiment_names_the_papers_setup(task):
    cfg = compose_config([f"+experiment=ouroboros_{task}"], config_name="bench")
    assert (cfg.model.name_or_path, cfg.draft.name_or_path) == PAIRS[task]
    assert cfg.model._target_ == cfg.draft._target_ == "lit_spec.models.HFModelSpec"
    assert cfg.model.dtype == cfg.draft.dtype == "bfloat16"
    assert not cfg.model.gradient_checkpointing and not cfg.draft.gradient_checkpointing
    assert list(cfg.decoding) == ["speculative", "lookahead", "ouroboros", "ouroboros_cold"]
    spec, lookahead, ouro, max_new, n, split = PAPER[task]
    d = cfg.decoding
    assert (d.speculative.gamma,) == spec and cfg.bench.assistant_tokens == spec[0]
    assert (d.lookahead.window, d.lookahead.ngram) == lookahead and d.lookahead.guesses == d.lookahead.window
    for name in ("ouroboros", "ouroboros_cold"):
        o = d[name]
        assert o.method == "ouroboros" and o.needs_draft
        assert (o.gamma, o.window, o.ngram, o.phrases) == ouro and o.guesses == o.window
    assert d.ouroboros.reuse and not d.ouroboros_cold.reuse
    assert (cfg.bench.max_new_tokens, cfg.bench.num_prompts, cfg.bench.split) == (max_new, n, split)
    assert cfg.bench.device == "cuda" and list(cfg.bench.hf_peers) == ["generate", "assisted"]
    assert cfg.data.source.eval_split == split
    # the sampled tasks draw a seeded sample; the code tasks run their whole split in order
    assert (cfg.data.eval_shuffle_seed is not None) == (task in ("gsm8k", "cnndm", "wmt16"))


@pytest.mark.parametrize("task, rows, chat", [("humaneval", humaneval_rows(8), True), ("mbpp", mbpp_rows(12), True),
                                              ("wmt16", wmt16_rows(12), True), ("gsm8k", gsm8k_rows(12), False)])
def test_experiment_prompts_from_a_local_file(tok, tmp_path, task, rows, chat):
    """The bench's own prompt loader on each experiment's data config: the benchmarked split holds every record of
    a local file, rendered and (for the chat models' tasks) wrapped in the tokenizer's chat template."""
    path = write_rows(rows, tmp_path / f"{task}.jsonl")
    cfg = compose_config([f"+experiment=ouroboros_{task}", f"data.path={path}"], config_name="bench")
    records = load_records(cfg, tok)
    assert len(records) == len(rows)  # fewer records than bench.num_prompts: all of them
    prompts, references = [r["prompt_ids"] for r in records], [r["answer_ids"] for r in records]
    texts = [tok.decode(p, skip_special_tokens=True) for p in prompts]
    assert all(t.startswith("[INST] ") and t.endswith(" [/INST]") for t in texts) == chat
    assert all(p[0] == tok.bos_token_id for p in prompts)
    assert all(r[-1] == tok.eos_token_id for r in references)
    if task == "mbpp":
        assert all("Your code should pass these tests:\n\nassert add_" in t for t in texts)
    if task == "wmt16":
        assert sorted(texts) == sorted(f"[INST] Translate this German sentence to English and output nothing else.\n"
                                       f"German: {r['translation']['de']}\nEnglish: [/INST]" for r in rows)
    if task in ("humaneval", "mbpp"):  # whole split, in order
        first = rows[0]["prompt"] if task == "humaneval" else rows[0]["text"]
        assert first in texts[0]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["gsm8k", "humaneval"])
def test_experiment_runs_every_method_on_micro_models(micro_dirs, tmp_path, task):
    """The experiment as the bench runs it, its models swapped for micro ones and its data for a local file, on CPU:
    every decoder accepts the experiment's Table 12 parameters and decodes our AR's tokens (greedy, lossless)."""
    rows = humaneval_rows(4) if task == "humaneval" else gsm8k_rows(4)
    path = write_rows(rows, tmp_path / f"{task}.jsonl")
    overrides = [f"+experiment=ouroboros_{task}", f"model.name_or_path={micro_dirs[0]}", "model.dtype=float32",
                 f"draft.name_or_path={micro_dirs[1]}", f"data.path={path}", "bench.device=cpu", "bench.num_prompts=2",
                 "bench.max_new_tokens=16", "bench.warmup_prompts=0", "bench.engines=[eager]"]
    if task == "humaneval":
        overrides.append("data.template.chat=false")  # the micro tokenizer has no chat template
    cfg = compose_config(overrides, config_name="bench")
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "out")
    results = run_benchmark(cfg, tmp_path / "out")
    methods = results["methods"]
    assert set(methods) == {"ar", "speculative", "lookahead", "ouroboros", "ouroboros_cold", "hf_generate",
                            "hf_assisted"}
    assert results["num_prompts"] == 2 and results["max_new_tokens"] == 16
    assert all(m["exact_match"] == 1.0 and m["new_tokens"] > 0 for m in methods.values()), methods


@pytest.mark.slow
def test_gpu_bench_experiment_runs_on_micro_models(micro_dirs, tmp_path):
    """+experiment=bench_qwen2_5_1_5b (the decoding engine's ~1B GPU bench) as the bench runs it, on CPU with its
    models swapped for micro ones (fp32) and GSM8K for a local file: every method with the experiment's settings
    (lookahead W 15 N 5 G 15, the draft's tree and Ouroboros) decodes our AR's tokens."""
    cfg = compose_config(["+experiment=bench_qwen2_5_1_5b"], config_name="bench")
    assert (cfg.model.name_or_path, cfg.draft.name_or_path) == ("Qwen/Qwen2.5-1.5B-Instruct",
                                                                "Qwen/Qwen2.5-0.5B-Instruct")
    assert cfg.model.dtype == cfg.draft.dtype == "bfloat16" and cfg.bench.device == "cuda"
    path = write_rows(gsm8k_rows(4), tmp_path / "gsm8k.jsonl")
    cfg = compose_config(["+experiment=bench_qwen2_5_1_5b", f"model.name_or_path={micro_dirs[0]}", "model.dtype=float32",
                          f"draft.name_or_path={micro_dirs[1]}", f"data.path={path}", "bench.device=cpu",
                          "bench.num_prompts=2", "bench.max_new_tokens=16", "bench.warmup_prompts=0",
                          "bench.engines=[eager]"],   # nothing to compile in a unit test
                         config_name="bench")
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "out")
    results = run_benchmark(cfg, tmp_path / "out")
    methods = results["methods"]
    assert set(methods) == {"ar", "jacobi", "lookahead", "speculative", "tree", "ouroboros", "hf_generate",
                            "hf_assisted", "hf_prompt_lookup"}
    assert results["dtype"] == "float32" and "gsm8k_answer" in results["quality"]
    assert all(m["exact_match"] == 1.0 and m["new_tokens"] > 0 for m in methods.values()), methods
