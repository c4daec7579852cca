"""``python -m lit_spec.bench``'s pipeline on micro models: every runner decodes the same prompts, the report files
are written, and our greedy AR agrees with transformers' own greedy generate on real prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import open_dict

from lit_spec.config import compose_config
from lit_spec.benchmark import build_runners, chosen_decoders, engine_plan, run_benchmark
from lit_spec.measure import describe_device
from lit_spec.decoding import DecodeStats
from lit_spec.errors import ConfigError
from lit_spec.measure import Run, compare, concat_runs


def bench_config(tmp_path, target, draft, *overrides):
    draft_override = (["~draft", f"+draft={{_target_: lit_spec.models.HFModelSpec, name_or_path: '{draft}', "
                                  "dtype: float32}"] if draft else ["draft=null"])
    cfg = compose_config([
        "model=hf", f"model.name_or_path={target}", "model.dtype=float32", *draft_override, "decoding=[]",
        "bench.num_prompts=3", "bench.max_new_tokens=16", "bench.warmup_prompts=1", "data.max_prompt_tokens=48",
        "data.max_train_samples=8",     # a bench decodes held-out prompts; the train split is tokenized all the same
        "bench.engines=[eager]",        # auto is frozen on a CPU, tens of seconds of compiling a width: tests choose
        *overrides], config_name="bench")
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
    return cfg


def test_bench_runs_every_runner_and_writes_its_report(micro_dirs, tmp_path):
    results = run_benchmark(bench_config(tmp_path, *micro_dirs), tmp_path)
    methods = results["methods"]
    assert set(methods) == {"ar", "hf_generate", "hf_assisted", "hf_prompt_lookup"}
    assert methods["ar"]["speedup"] == pytest.approx(1.0) and methods["ar"]["mean_accepted"] == 1.0
    for name, m in methods.items():
        assert m["new_tokens"] > 0 and m["tokens_per_s"] > 0, name
        # greedy, same model: every peer must produce exactly our AR's tokens, and transformers' greedy generate's
        assert m["exact_match"] == 1.0 and m["exact_match_reference"] == 1.0, name
    assert methods["hf_generate"]["speedup_reference"] == pytest.approx(1.0)
    assert methods["ar"]["speedup_reference"] == pytest.approx(
        methods["ar"]["tokens_per_s"] / methods["hf_generate"]["tokens_per_s"])
    assert methods["ar"]["target_forwards"] == methods["ar"]["new_tokens"]
    ar = methods["ar"]
    assert ar["ms_per_forward"] == pytest.approx(1e3 * ar["forward_time"] / ar["target_forwards"])
    assert ar["forward_cost"] == pytest.approx(1.0)
    assert all(methods[peer]["forward_cost"] is None for peer in ("hf_generate", "hf_assisted", "hf_prompt_lookup"))
    on_disk = json.loads((tmp_path / "bench.json").read_text())
    assert on_disk["methods"].keys() == methods.keys()
    table = (tmp_path / "bench.md").read_text()
    assert all(f"| {name} |" in table for name in methods)
    assert f"device cpu ({describe_device(torch.device('cpu'))})" in table     # a timing names its host and torch
    ar_row = next(line for line in table.splitlines() if line.startswith("| ar |"))
    assert ar_row.split(" | ")[-3] == "1.00×"          # AR's target forward against its own
    limit = results["bandwidth_limit"]
    assert limit["read_gb_per_s"] > 0 and "AR's bandwidth limit" in table
    assert limit["tokens_per_s"] == pytest.approx(1e9 * limit["read_gb_per_s"] / limit["bytes_per_token"])
    for m in methods.values():
        assert m["bandwidth_share"] == pytest.approx(m["tokens_per_s"] / limit["tokens_per_s"])
    assert (tmp_path / "bench.png").stat().st_size > 1000
    quality = results["quality"]
    assert set(quality) == {"repetitive", "mean_new_tokens"} and "greedy answers: repetitive" in table
    assert quality["mean_new_tokens"] == methods["ar"]["new_tokens"] / results["num_prompts"]
    assert "drift" not in results and "drift from" not in table      # no original model: no drift section


def test_bench_runs_each_decoder_on_each_chosen_engine(micro_dirs, tmp_path):
    """``bench.engines``: every chosen decoder once per engine (NAME@ENGINE), all exact against eager AR, the
    baseline, which runs whatever the engines are."""
    from transformers import AutoConfig

    from lit_spec.decoding.fast import CACHE_STEP

    cfg = bench_config(tmp_path, *micro_dirs, "decoding=[jacobi,speculative]", "decoding.jacobi.n_tokens=4",
                       "bench.engines=[static]", "bench.hf_peers=[]")
    results = run_benchmark(cfg, tmp_path)
    methods = results["methods"]
    assert set(methods) == {"ar", "ar@static", "jacobi@static", "speculative@static"}
    assert all(m["exact_match"] == 1.0 and m["compile_time"] == 0.0 for m in methods.values())
    # what the fast path holds beside the weights, the target's and the draft's: keys and values of every layer at
    # every cache position, and the packed copy of a plain fp32 LM head
    for role, path in zip(("target", "draft"), micro_dirs):
        c = AutoConfig.from_pretrained(path)
        memory = results["fast_memory"][f"static/{role}"]
        head_dim = c.hidden_size // c.num_attention_heads
        per_position = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4
        positions, rest = divmod(memory["static_cache"], per_position)
        assert rest == 0 and positions > results["max_new_tokens"] and positions % CACHE_STEP == 0, role
        assert memory["packed_head"] == c.vocab_size * c.hidden_size * 4, role
    assert "memory of the fast path" in (tmp_path / "bench.md").read_text()
    # a forward's cost by the widths each engine decoded at: AR's one token, Jacobi's 4, the chain's γ + 1
    widths = results["forward_ms"]["static/target"]
    assert {"1", "4", "5"} <= set(widths) and all(ms > 0 for ms in widths.values())
    assert "1" in results["forward_ms"]["static/draft"]       # the draft's steps (and its catch-ups of 2)
    assert "a forward's milliseconds by block width" in (tmp_path / "bench.md").read_text()


def test_bench_engines_auto_is_the_fast_path_where_it_measured_faster():
    """``bench.engines=auto``, the default: on a CPU every decoder on ``frozen`` but multiblock, which measured slower
    there than on eager, and Hidden Transfer, refused there; on a GPU AR, prompt lookup and speculative on
    ``graphs``, measured faster there, and the others, not measured yet, on eager. A list runs every decoder on each
    engine. Eager AR, the baseline, always runs."""
    cfg = compose_config([], config_name="bench")
    assert cfg.bench.engines == "auto"
    specs = {"ar": {}, **chosen_decoders(cfg.decoding)}
    cpu = engine_plan("auto", specs, torch.device("cpu"))
    assert cpu.pop("ar") == ["eager", "frozen"] and cpu.pop("multiblock") == ["eager"]
    assert set(cpu) == {"jacobi", "lookahead", "prompt_lookup", "speculative", "tree", "ouroboros"}
    assert all(engines == ["frozen"] for engines in cpu.values())
    gpu = engine_plan("auto", specs, torch.device("cuda"))
    assert gpu == {"ar": ["eager", "graphs"], "prompt_lookup": ["graphs"], "speculative": ["graphs"]} | {
        name: ["eager"] for name in ("jacobi", "multiblock", "lookahead", "tree", "ouroboros")}
    given = compose_config(["bench.engines=[static]"], config_name="bench").bench.engines
    assert engine_plan(given, specs, torch.device("cpu")) == {"ar": ["eager", "static"]} | {
        name: ["static"] for name in specs if name != "ar"}
    # Hidden Transfer's maps are hooks, which a frozen package does not run: auto keeps it on eager
    assert engine_plan("auto", {"ar": {}, "ht": {"method": "hidden_transfer"}}, torch.device("cpu"))["ht"] == ["eager"]


def test_bench_auto_builds_each_decoder_on_its_engine(micro_dirs, tmp_path):
    """The runners of ``bench.engines=auto`` on a CPU, named by engine; nothing compiles before a decode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = bench_config(tmp_path, micro_dirs[0], None, "decoding=[jacobi,multiblock]", "bench.engines=auto",
                       "bench.hf_peers=[]")
    model = AutoModelForCausalLM.from_pretrained(micro_dirs[0], dtype=torch.float32).eval()
    runners = build_runners(cfg, model, None, AutoTokenizer.from_pretrained(micro_dirs[0]))
    assert list(runners) == ["ar", "multiblock", "ar@frozen", "jacobi@frozen"]
    assert [getattr(r.fast, "kind", "eager") for r in runners.values()] == ["eager", "eager", "frozen", "frozen"]


def test_bench_runs_in_the_model_configs_dtype(micro_dirs, tmp_path, monkeypatch):
    """``model.dtype`` sets the dtype of the bench (the draft follows it: ``draft.dtype: ${model.dtype}``)."""
    import lit_spec.benchmark as benchmark

    loaded = []
    load = benchmark._load
    monkeypatch.setattr(benchmark, "_load", lambda spec_cfg, device: loaded.append(load(spec_cfg, device)) or loaded[-1])
    cfg = bench_config(tmp_path, *micro_dirs, "model.dtype=bfloat16", "bench.hf_peers=[generate]", "decoding=[jacobi]")
    with open_dict(cfg):
        cfg.draft.dtype = "${model.dtype}"
    results = run_benchmark(cfg, tmp_path)
    assert results["dtype"] == "bfloat16" and ", bfloat16, model" in (tmp_path / "bench.md").read_text()
    assert [next(model.parameters()).dtype for _, model in loaded] == [torch.bfloat16, torch.bfloat16]
    assert results["methods"]["hf_generate"]["exact_match"] == 1.0


def test_bench_samples_every_runner_at_a_temperature(micro_dirs, tmp_path):
    """bench.temperature > 0: our AR, the tree decoder (rejection sampling) and transformers' generate all sample,
    so their tokens/s compare like with like; exact match (a greedy check) is not reported; typical acceptance is
    marked lossy (it refuses top_p: none here)."""
    cfg = bench_config(tmp_path, *micro_dirs, "decoding=[tree]", "bench.temperature=0.8",
                       "bench.hf_peers=[generate]", "+decoding.typical={method: tree, needs_draft: true, "
                       "acceptance: typical}")
    results = run_benchmark(cfg, tmp_path)
    methods = results["methods"]
    assert set(methods) == {"ar", "tree", "typical", "hf_generate"} and results["temperature"] == 0.8
    assert all(m["exact_match"] is None and m["new_tokens"] > 0 for m in methods.values())
    assert methods["tree"]["mean_accepted"] >= 1.0
    assert [name for name, m in methods.items() if not m["lossless"]] == ["typical"]
    table = (tmp_path / "bench.md").read_text()
    assert "| ar |" in table and "| typical (lossy) |" in table and "| tree |" in table
    assert "sampled AR answers" in table


def test_bench_scores_the_greedy_answers(micro_dirs, tmp_path):
    from lit_spec.config import build
    from lit_spec.data.metrics import token_f1
    from lit_spec.data.repetition import RepetitionFilter
    from lit_spec.benchmark import answer_quality

    results = run_benchmark(bench_config(tmp_path, micro_dirs[0], None, "bench.hf_peers=[]", "bench.metric=token_f1"),
                            tmp_path)
    assert 0.0 <= results["quality"]["token_f1"] <= 1.0 and 0.0 <= results["quality"]["repetitive"] <= 1.0
    assert results["methods"]["ar"]["token_f1"] == results["quality"]["token_f1"]     # every method scored
    tokenizer = build(bench_config(tmp_path, micro_dirs[0], None).model).load_tokenizer()
    # by hand: one answer flagged (a token 8 times in a row), one not; F1 against the references
    outputs, refs = [[7] * 8, [5, 6, 7]], [{"answer_ids": [5, 6, 7]}, {"answer_ids": [5, 6, 7]}]
    texts = [tokenizer.decode(o) for o in outputs]
    assert RepetitionFilter().reason(outputs[0], texts[0]) and not RepetitionFilter().reason(outputs[1], texts[1])
    quality = answer_quality(outputs, refs, tokenizer, "token_f1")
    assert quality["repetitive"] == 0.5 and quality["mean_new_tokens"] == 5.5
    assert quality["token_f1"] == pytest.approx((token_f1(texts[0], texts[1]) + 1.0) / 2)
    with pytest.raises(ConfigError, match="metric"):
        run_benchmark(bench_config(tmp_path, micro_dirs[0], None, "bench.metric=bleu"), tmp_path)


def test_bench_rejects_bad_settings_before_decoding(micro_dirs, tmp_path):
    target, draft = micro_dirs
    for override, message in [("bench.num_prompts=0", "bench.num_prompts=0: must be an integer >= 1"),
                              ("bench.max_new_tokens=-1", "bench.max_new_tokens=-1"),
                              ("bench.split=valdiation", "bench.split=valdiation: the data has no such split"),
                              ("bench.engines=[eager,fast]", "bench.engines=.*a list of decoding engines"),
                              ("bench.engines=frozen", "bench.engines='frozen': auto, or a list")]:
        with pytest.raises(ConfigError, match=message):
            run_benchmark(bench_config(tmp_path, target, None, override), tmp_path)
    with pytest.raises(ConfigError, match="unknown 'nope'"):
        run_benchmark(bench_config(tmp_path, target, draft, "bench.hf_peers=[nope]"), tmp_path)
    with pytest.raises(ConfigError, match="needs a draft model"):
        run_benchmark(bench_config(tmp_path, target, None, "+decoding.spec.method=ar",
                                   "+decoding.spec.needs_draft=true", "bench.hf_peers=[]"), tmp_path)
    peers = "bench.vllm_peers={vllm: null}"
    with pytest.raises(ConfigError, match="vLLM's CPU build"):
        run_benchmark(bench_config(tmp_path, target, None, peers, "bench.device=cuda"), tmp_path)
    with pytest.raises(ConfigError, match="bench.top_p=0"):
        run_benchmark(bench_config(tmp_path, target, None, "bench.temperature=0.7", "bench.top_p=0"), tmp_path)
    with pytest.raises(ConfigError, match=r"\['ht'\] cannot run on frozen.*choose compiled"):
        run_benchmark(bench_config(tmp_path, target, None, "bench.engines=[eager,frozen]",
                                   "+decoding.ht={method: hidden_transfer, transfer: none}"), tmp_path)


def test_a_vllm_peer_without_vllm_installed_says_how_to_install_it(micro_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_PYTHON", str(tmp_path / "no_such_python"))
    with pytest.raises(ConfigError, match="bash serving/install_vllm_cpu.sh"):
        run_benchmark(bench_config(tmp_path, micro_dirs[0], None, "bench.vllm_peers={vllm: null}"), tmp_path)


def original_overrides(path) -> list[str]:
    return ["model@original=hf", f"original.name_or_path={path}", "original.dtype=float32"]


def test_bench_reports_drift_from_the_original_model(micro_dirs, tmp_path):
    """model@original=NAME: every answer set's NLL under both models and the original's greedy answers; the target
    against itself has changed by exactly nothing."""
    target, draft = micro_dirs
    results = run_benchmark(bench_config(tmp_path, target, None, "bench.hf_peers=[]", *original_overrides(target)),
                            tmp_path)
    drift = results["drift"]
    assert drift["original"] == target and set(drift["nll"]) == {"heldout", "humaneval"}   # drift_data's default
    assert drift["nll"]["heldout"]["records"] == 3 and drift["nll"]["humaneval"]["records"] > 100
    for m in drift["nll"].values():
        assert m["change"] == 0.0 and m["original"] == m["trained"] > 0
    assert drift["answers"] == {"agreement": 1.0, "token_agreement": 1.0, "first_divergence": None}
    assert json.loads((tmp_path / "bench.json").read_text())["drift"] == drift
    table = (tmp_path / "bench.md").read_text()
    assert f"drift from the original model `{target}`" in table and "| humaneval |" in table
    assert "| heldout | 3 |" in table and "+0.0000 |" in table and "share unchanged 1.000 (of 3 prompts)" in table

    # another model as the original (same tokenizer, other weights): its NLLs differ, trained − original
    results = run_benchmark(bench_config(tmp_path / "other", target, None, "bench.hf_peers=[]", "bench.drift_data=null",
                                         *original_overrides(draft)), tmp_path / "other")
    (name, m), = results["drift"]["nll"].items()
    assert name == "heldout" and m["original"] != m["trained"] and m["change"] == m["trained"] - m["original"]
    answers = results["drift"]["answers"]    # untrained micro models may well answer alike
    assert (answers["agreement"] < 1.0) == (answers["first_divergence"] is not None)


def test_bench_refuses_an_original_of_another_vocabulary(micro_dirs, tmp_path):
    import shutil

    from random_models import random_model

    target, _ = micro_dirs
    other = tmp_path / "other_vocab"
    random_model("llama", vocab=1024).save_pretrained(other)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):   # the target's tokenizer
        if (Path(target) / name).is_file():
            shutil.copy(Path(target) / name, other / name)
    with pytest.raises(ConfigError, match=r"original vocabulary \(1024\) differs from the target's \(512\)"):
        run_benchmark(bench_config(tmp_path, target, None, *original_overrides(other)), tmp_path)
    assert not (tmp_path / "bench.json").exists()
    with pytest.raises(ConfigError, match="original='tiny_target': the original model is a model config"):
        run_benchmark(bench_config(tmp_path, target, None, "original=tiny_target"), tmp_path)
    with pytest.raises(ConfigError, match="bench.drift_data.code='humaneal': no data config of that name"):
        run_benchmark(bench_config(tmp_path, target, None, *original_overrides(target),
                                   "+bench.drift_data.code=humaneal"), tmp_path)


def test_compare_gives_speedup_tau_exactness_and_forward_cost_from_the_counts():
    """``measure.compare`` on hand-made runs (the bench and the speedup callback both report through it), with the
    figures worked out by hand; and ``concat_runs`` joins runs over groups of prompts (the callback's ranks)."""
    def run(outputs, tokens, forwards, wall, forward_time):
        return Run(outputs, DecodeStats(new_tokens=tokens, target_forwards=forwards, row_forwards=forwards,
                                        wall_time=wall, forward_time=forward_time))

    ar = run([[1, 2, 3], [4, 5, 6]], tokens=6, forwards=6, wall=3.0, forward_time=2.4)      # 2 tok/s, 400 ms/forward
    fast = run([[1, 2, 3], [4, 5, 9]], tokens=6, forwards=2, wall=1.0, forward_time=0.8)    # 6 tok/s, τ 3
    m = compare({"ar": ar, "fast": fast})["fast"]
    assert (m["tokens_per_s"], m["speedup"], m["mean_accepted"], m["exact_match"]) == (6.0, 3.0, 3.0, 0.5)
    assert m["ms_per_forward"] == pytest.approx(400.0) and m["forward_cost"] == pytest.approx(1.0)
    assert m["engine_overhead"] == pytest.approx(0.2)
    halves = concat_runs([{"ar": run([[1, 2, 3]], 3, 3, 1.0, 0.8)}, {"ar": run([[4, 5, 6]], 3, 3, 2.0, 1.6)}])
    assert halves["ar"].outputs == ar.outputs and halves["ar"].stats.tokens_per_s == ar.stats.tokens_per_s


def test_a_token_reads_every_weight_once_and_the_cache_at_its_context():
    """The bandwidth limit's bytes: a 2-layer Llama (hidden 64, 2 of 4 heads for keys/values, head dim 16) reads its
    weights without the untied input embedding's, or with the tied head once, and 2 layers x keys and values x 2
    heads x 16 x 4 bytes per cached position."""
    from random_models import VOCAB, random_model

    from lit_spec.measure import bytes_per_token

    model = random_model("llama")
    all_weights = 4 * sum(p.numel() for p in model.parameters())
    kv = 2 * 2 * 2 * 16 * 4
    assert bytes_per_token(model, 10) == all_weights - 4 * VOCAB * 64 + 10 * kv
    model.lm_head.weight = model.model.embed_tokens.weight          # tied: one matrix, read once as the head
    assert bytes_per_token(model, 0) == all_weights - 4 * VOCAB * 64
