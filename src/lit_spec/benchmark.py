"""The benchmark behind ``python -m lit_spec.bench``: the same prompts, decoded one at a time by our AR baseline, the
chosen methods and transformers' own ``generate`` peers, with warm-up; tokens/s, speedup vs our AR, τ, forwards and
exact match (token-identical to our greedy AR) per method, written as bench.json, bench.md and bench.png. At
``bench.temperature`` > 0 (and ``bench.top_p``) every runner samples (our AR, transformers' and vLLM's peers
included, so tokens/s compare like with like), exact match is not reported, and a decoder whose rule changes the
target's distribution (``acceptance=typical``) is marked lossy. With ``model@original=NAME`` (the model the
benchmarked one was trained from) a drift section (``lit_spec.drift``) says how far training moved it: the answer NLL
of the bench prompts' dataset answers and of the ``bench.drift_data`` sets under both models, and how many of the
original's greedy answers on the bench prompts are unchanged."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from lit_spec.config import build
from lit_spec.data.datamodule import split_records
from lit_spec.data.execution import describe_isolation
from lit_spec.data.metrics import EXECUTION_METRICS, get_metric, score_answers
from lit_spec.data.repetition import RepetitionFilter
from lit_spec.decoding import DECODERS
from lit_spec.decoding.fast import ENGINES
from lit_spec.decoding.verify import check_sampling
from lit_spec.drift import HELDOUT, check_drift_data, compare_answers, compare_nll, drift_records
from lit_spec.errors import ConfigError, check_count
from lit_spec.io import write_json, write_text
from lit_spec.measure import (HFPeer, bandwidth_limit, build_decoders, compare, decode_prompts, describe_device,
                              fast_roles, forward_ms, mean_context, reserve_fast_caches, vllm_peer_runs, warm_up)
from lit_spec.precision import export_dtype
from lit_spec.serving.vllm_runner import require_vllm
from lit_spec.stages import ensure_stages

log = logging.getLogger(__name__)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("bench.device=cuda but no CUDA GPU is visible: use bench.device=cpu")
    return torch.device(name)


def _load(spec_cfg: DictConfig, device: torch.device):
    spec = build(spec_cfg)
    spec.validate()
    model = spec.load_model().to(device).eval()
    return spec, model


# the model configs loaded beside the benchmarked one (package -> an example of model@PACKAGE=NAME)
COMPANIONS = {"draft": "tiny_draft", "original": "tiny_target"}


def _load_companion(cfg: DictConfig, key: str, model, device: torch.device):
    """The model config in package ``key`` (``COMPANIONS``) loaded, or None when unset. It must share the target's
    vocabulary: its token ids are read as the target's."""
    if cfg.get(key) is None:
        return None
    _, other = _load(cfg[key], device)
    if other.config.vocab_size != model.config.vocab_size:
        raise ConfigError(f"{key} vocabulary ({other.config.vocab_size}) differs from the target's "
                          f"({model.config.vocab_size}): the {key} model must share the target's tokenizer; choose "
                          f"another with model@{key}=NAME")
    if key == "original" and other.dtype != model.dtype:
        log.warning("original model in %s, the benchmarked one in %s: the drift section's NLL change includes the "
                    "rounding (original.dtype=... sets it)", other.dtype, model.dtype)
    return other


def load_records(cfg: DictConfig, tokenizer) -> list[dict]:
    """The first ``bench.num_prompts`` records of ``bench.split`` of the ``data`` config: ``prompt_ids``, the
    dataset's ``answer_ids`` and, when the data config keeps one, the ``problem`` an execution metric runs."""
    asked = cfg.bench.num_prompts
    records = split_records(build(cfg.data, tokenizer=tokenizer), cfg.bench.split, asked, "bench.split")
    if asked > len(records):
        log.warning("bench.num_prompts=%d, but the %s split has %d records: benchmarking %d prompts",
                    asked, cfg.bench.split, len(records), len(records))
    return records


def chosen_decoders(decoding: DictConfig | None) -> dict[str, dict]:
    """The ``decoding`` entries that name their ``method``: every option of the group does, so an entry without one
    holds only values an experiment set for a decoder that this run did not choose (``decoding=[...]``)."""
    specs = OmegaConf.to_container(decoding, resolve=True) if decoding else {}
    unchosen = sorted(name for name, params in specs.items() if "method" not in (params or {}))
    if unchosen:
        log.info("decoding: %s not chosen (only settings for them are configured): not run", ", ".join(unchosen))
    return {name: params for name, params in specs.items() if name not in unchosen}


def build_runners(cfg: DictConfig, model, draft, tokenizer) -> dict:
    """Name -> runner: our AR first, then the methods of the ``decoding`` group on their engines (``NAME@ENGINE``
    off eager), then transformers' peers."""
    bench, pad = cfg.bench, tokenizer.pad_token_id
    sampling = sampling_of(cfg)
    specs = {"ar": {}, **chosen_decoders(cfg.get("decoding"))}
    plan = engine_plan(bench.engines, specs, model.device)
    runners: dict = {}
    for engine in dict.fromkeys(e for engines in plan.values() for e in engines):
        chosen = {name: params for name, params in specs.items() if engine in plan[name]}
        built = build_decoders(model, chosen, draft, pad_token_id=pad, engine=engine, **sampling)
        runners |= {name if engine == "eager" else f"{name}@{engine}": decoder for name, decoder in built.items()}
    for mode in bench.hf_peers or []:
        if mode == "assisted" and draft is None:
            continue
        peer = HFPeer(mode, model, draft, pad, bench.temperature, bench.top_p, bench.assistant_tokens,
                      bench.prompt_lookup_tokens, bench.prompt_lookup_ngram)
        runners[peer.name] = peer
    return runners


# methods that decoded slower on frozen than on eager on a CPU, so auto leaves them on eager: multiblock, whose blocks
# of up to 512 tokens cost more compiled (0.92x eager on the tiny target: RESULTS, issue 61, ninth session)
SLOWER_ON_FROZEN = {"multiblock"}
# methods measured faster on graphs than on eager on a GPU, so auto runs them there: AR 2.79x, prompt lookup 2.27x,
# speculative 2.06x on an H200 (the tiny target, fp32: RESULTS, issue 61, eleventh session); the others stay eager
FASTER_ON_GRAPHS = {"ar", "prompt_lookup", "speculative"}


def engine_plan(engines, specs: dict[str, dict], device: torch.device) -> dict[str, list[str]]:
    """Each decoder's engines under ``bench.engines``: every engine of a list, or for ``auto`` the fast path where
    it measured faster than eager: ``frozen`` on a CPU (RESULTS, issue 61) but for ``not_frozen`` methods, ``graphs``
    on a GPU for ``FASTER_ON_GRAPHS`` alone. Eager AR, the baseline of every speedup, always runs."""
    if engines != "auto":
        plan = {name: list(engines) for name in specs}
    else:
        if device.type != "cpu":
            plan = {name: ["graphs"] if params.get("method", name) in FASTER_ON_GRAPHS else ["eager"]
                    for name, params in specs.items()}
        else:
            plan = {name: ["eager"] if not_frozen(params.get("method", name)) else ["frozen"]
                    for name, params in specs.items()}
        log.info("bench.engines=auto: %s", {name: engines[0] for name, engines in plan.items()})
    plan["ar"] = list(dict.fromkeys(["eager", *plan["ar"]]))
    return plan


def not_frozen(method: str) -> bool:
    """A method that ``auto`` leaves on eager on a CPU: measured slower on frozen, or refused there."""
    return method in SLOWER_ON_FROZEN or hooked(method)


def hooked(method: str) -> bool:
    """The method drafts through forward hooks, which ``frozen`` refuses (``Decoder.hooked_forward``)."""
    return getattr(DECODERS.get(method), "hooked_forward", False)


def sampling_of(cfg: DictConfig) -> dict:
    """The sampling settings every runner gets: none when greedy."""
    bench = cfg.bench
    return {"temperature": bench.temperature, "top_p": bench.top_p, "seed": cfg.seed} if bench.temperature > 0 else {}


def lossy(runner) -> bool:
    """A decoder whose sampling rule changes the target's distribution (``acceptance=typical``)."""
    return not getattr(getattr(runner, "sampler", None), "lossless", True)


def check_bench(cfg: DictConfig) -> dict[str, str]:
    """The bench's own settings, before any stage, model or decode; returns the drift sets to read (``{set name:
    data config name}``, none without an original model)."""
    bench = cfg.bench
    for key, example in COMPANIONS.items():
        value = cfg.get(key)
        if value is not None and not isinstance(value, DictConfig):
            raise ConfigError(f"{key}={value!r}: the {key} model is a model config, chosen with model@{key}=NAME "
                              f"(e.g. model@{key}={example}), or {key}=null for none")
    check_count("bench.num_prompts", bench.num_prompts)
    check_count("bench.max_new_tokens", bench.max_new_tokens)
    check_count("bench.warmup_prompts", bench.warmup_prompts, minimum=0)
    check_sampling(bench.get("temperature"), bench.get("top_p"), "bench.")
    engines = bench.get("engines")
    if engines != "auto" and (not engines or isinstance(engines, str) or any(e not in ENGINES for e in engines)):
        raise ConfigError(f"bench.engines={engines!r}: auto, or a list of decoding engines from {list(ENGINES)}, "
                          "e.g. 'bench.engines=[eager,compiled]'")
    if engines != "auto" and "frozen" in engines:     # auto keeps them on eager
        refused = [name for name, params in chosen_decoders(cfg.get("decoding")).items() if hooked(params["method"])]
        if refused:
            raise ConfigError(f"bench.engines={list(engines)}: {refused} cannot run on frozen, an exported graph that "
                              "does not run the forward hooks they draft through; drop frozen, or choose compiled")
    if bench.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"bench.device={bench.device!r}: choose auto, cpu or cuda")
    if bench.get("metric") is not None:
        get_metric(bench.metric)  # an unknown name fails here
    if bench.get("vllm_peers"):
        if bench.device == "cuda":
            raise ConfigError("bench.vllm_peers: vLLM's CPU build: set bench.device=cpu (or auto on a CPU machine), "
                              "or bench.vllm_peers=null")
        require_vllm()
    return {} if cfg.get("original") is None else check_drift_data(bench.get("drift_data"), "bench.drift_data")


def run_benchmark(cfg: DictConfig, out_dir: Path) -> dict:
    drift_data = check_bench(cfg)
    build(cfg.data)   # its settings are checked as it is built; without a tokenizer it reads nothing
    ensure_stages(cfg)  # the target's and the draft's stages: cached, or built now
    torch.manual_seed(cfg.seed)
    device = _device(cfg.bench.device)
    spec, model = _load(cfg.model, device)
    tokenizer = spec.load_tokenizer()
    draft, original = (_load_companion(cfg, key, model, device) for key in COMPANIONS)
    records = load_records(cfg, tokenizer)
    # read before any decode, so that their errors come first
    answer_sets = {HELDOUT: records} | {name: drift_records(data, tokenizer) for name, data in drift_data.items()}
    prompts = [torch.tensor([r["prompt_ids"]], device=device) for r in records]
    eos, max_new = tokenizer.eos_token_id, cfg.bench.max_new_tokens
    # vLLM first, in processes of its own: a run it cannot start fails the bench before our decodes, not after
    peer_runs = vllm_peer_runs(OmegaConf.to_container(cfg.bench.vllm_peers, resolve=True), spec.name_or_path,
                               str(export_dtype("auto", spec)).removeprefix("torch."), prompts, max_new,
                               eos, sampling_of(cfg)) if cfg.bench.vllm_peers else {}
    runners = build_runners(cfg, model, draft, tokenizer)
    lengths = [p.size(1) for p in prompts]
    reserve_fast_caches(runners, lengths, max_new)
    warm_up(runners, prompts[: cfg.bench.warmup_prompts], max_new, eos)
    with tqdm(total=len(prompts) * len(runners), desc="bench", unit="decode") as bar:
        def progress(name: str, stats) -> None:
            bar.set_postfix(method=name, tok_s=f"{stats.tokens_per_s:.0f}")
            bar.update()

        runs = decode_prompts(runners, prompts, max_new, eos, progress)
    runs |= peer_runs
    limit = bandwidth_limit(model, lengths, max_new)
    # sampled outputs differ by chance: token identity is a greedy (temperature 0) check only
    methods = compare(runs, "ar", exact=not cfg.bench.temperature, reference="hf_generate")
    for name, m in methods.items():
        m["bandwidth_share"] = m["tokens_per_s"] / limit["tokens_per_s"]
        m["lossless"] = not (cfg.bench.temperature and lossy(runners.get(name)))
    results = {"model": spec.name_or_path, "device": str(device), "hardware": describe_device(device),
               "dtype": str(model.dtype).removeprefix("torch."), "num_prompts": len(prompts),
               "num_prompts_asked": cfg.bench.num_prompts, "max_new_tokens": max_new,
               "temperature": cfg.bench.temperature, "methods": methods, "compile_seconds": compile_seconds(runners),
               "fast_memory": fast_memory(runners), "bandwidth_limit": limit,
               "forward_ms": {role: forward_ms(engine, round(mean_context(lengths, max_new)))
                              for role, engine in fast_roles(runners).items()}}
    metric = cfg.bench.get("metric")
    if metric is not None:      # every method's own answers: a lossless method scores what AR scores
        for name, run in runs.items():
            methods[name][metric] = score_answers(metric, run.outputs, records, tokenizer)
    results["metric"] = metric
    if metric in EXECUTION_METRICS:        # what protected this machine from the answers it ran
        results["execution_isolation"] = describe_isolation()
    results["quality"] = answer_quality(runs["ar"].outputs, records, tokenizer, metric)
    if original is not None:
        results["drift"] = drift_report(cfg, original, model, answer_sets, prompts, runs["ar"].outputs, tokenizer)
        log.info("drift from the original model:\n%s", drift_markdown(results))
    write_report(results, out_dir)
    return results


def compile_seconds(runners: dict) -> dict[str, float]:
    """The seconds each block width took to compile (``"frozen/target/8@768"``, ``"compiled/draft/1@768"``,
    ``"+hidden"`` where the hidden states are read: engine, model, width, cache length; a draft step's
    ``"frozen/eagle3_chain/root4/top1@768"``: engine, decoder, its label), warm-up included and kept out of every
    timing."""
    seconds = {f"{role}/{q}{'+hidden' if hidden else ''}@{length}": s for role, engine in fast_roles(runners).items()
               for (q, hidden, length, _, _), s in engine.compile_seconds.items()}     # the bench's batch: one row
    for name, runner in runners.items():
        for step in runner.draft_steps() if getattr(runner, "fast", None) else []:
            seconds |= {f"{step.kind}/{name.split('@')[0]}/{label}": s for label, s in step.compile_seconds.items()}
    return seconds


def fast_memory(runners: dict) -> dict[str, dict[str, int]]:
    """Per fast engine, ``KIND/target`` or ``KIND/draft``, the bytes it holds beside the weights: its static cache
    and its packed head (``FastForward.memory``)."""
    return {role: engine.memory() for role, engine in fast_roles(runners).items()}


def answer_quality(outputs: list[list[int]], records: list[dict], tokenizer, metric: str | None) -> dict:
    """How good the greedy answers are (the same for every lossless method): the share that the collection's
    repetition filter flags (``RepetitionFilter`` defaults), and ``metric``'s mean score (against the dataset's
    answers, or by execution) when one is named."""
    texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
    flag = RepetitionFilter()
    quality = {"repetitive": sum(flag.reason(o, t) is not None for o, t in zip(outputs, texts)) / len(outputs),
               "mean_new_tokens": sum(map(len, outputs)) / len(outputs)}
    if metric is not None:
        quality[metric] = score_answers(metric, outputs, records, tokenizer)
    return quality


def _fmt(v, spec: str, unit: str = "") -> str:
    return "–" if v is None else format(v, spec) + unit


COLUMNS = [  # (header, cell of a method's results)
    ("tokens/s", lambda m: f"{m['tokens_per_s']:.1f}"),
    ("speedup vs our AR", lambda m: _fmt(m["speedup"], ".2f", "×")),
    ("speedup vs HF generate", lambda m: _fmt(m["speedup_reference"], ".2f", "×")),
    ("÷ vLLM AR", lambda m: _fmt(m.get("speedup_vllm"), ".2f", "×")),
    ("τ (mean accepted)", lambda m: _fmt(m["mean_accepted"], ".2f")),
    ("target forwards", lambda m: _fmt(m["target_forwards"], "d")),
    ("new tokens", lambda m: str(m["new_tokens"])),
    ("exact match", lambda m: _fmt(m["exact_match"], ".2f")),
    ("exact vs HF generate", lambda m: _fmt(m["exact_match_reference"], ".2f")),
    ("time in target / draft forwards",
     lambda m: f"{m['forward_time']:.2f} s / {m['draft_time']:.2f} s" if m["engine_overhead"] is not None else "–"),
    ("compiling (kept out)", lambda m: _fmt(m.get("compile_time") or None, ".1f", " s")),
    ("target forward vs AR's", lambda m: _fmt(m["forward_cost"], ".2f", "×")),
    ("engine overhead", lambda m: _fmt(m["engine_overhead"], ".1%")),
    ("share of AR's bandwidth limit", lambda m: _fmt(m.get("bandwidth_share"), ".0%")),
]


def markdown_table(results: dict) -> str:
    metric = results.get("metric")
    columns = COLUMNS + ([(metric, lambda m: _fmt(m[metric], ".3f"))] if metric else [])
    head = "| method | " + " | ".join(h for h, _ in columns) + " |\n|" + "---|" * (len(columns) + 1) + "\n"
    rows = ["| " + " | ".join([name + ("" if m.get("lossless", True) else " (lossy)"),
                               *(cell(m) for _, cell in columns)]) + " |" for name, m in results["methods"].items()]
    return head + "\n".join(rows) + "\n"


def drift_report(cfg: DictConfig, original, model, answer_sets: dict[str, list[dict]], prompts: list[torch.Tensor],
                 outputs: list[list[int]], tokenizer) -> dict:
    """How far training moved ``model`` from ``original``: every answer set's NLL under both (``nll``) and, greedy
    only (sampled answers differ by chance), the original's greedy AR answers on the bench prompts against the
    model's AR ``outputs`` (``answers``: ``compare_answers``; None at a temperature)."""
    report = {"original": str(cfg.original.name_or_path), "answers": None,
              "nll": compare_nll(original, model, answer_sets, prompts[0].device)}
    if not cfg.bench.temperature:
        ar = build_decoders(original, {"ar": {}}, pad_token_id=tokenizer.pad_token_id)
        originals = decode_prompts(ar, prompts, cfg.bench.max_new_tokens, tokenizer.eos_token_id)["ar"].outputs
        report["answers"] = compare_answers(outputs, originals)
    return report


def drift_markdown(results: dict) -> str:
    """The drift section of bench.md: one row per answer set, then the greedy answers' line."""
    drift = results["drift"]
    rows = [f"| {name} | {m['records']} | {m['original']:.4f} | {m['trained']:.4f} | {m['change']:+.4f} |"
            for name, m in drift["nll"].items()]
    answers = drift["answers"]
    greedy = ("not compared (sampled answers differ by chance)" if answers is None else
              f"share unchanged {answers['agreement']:.3f} (of {results['num_prompts']} prompts), token agreement "
              f"{answers['token_agreement']:.3f}" + ("" if answers["first_divergence"] is None else
                                                      f", first divergence after {answers['first_divergence']:.1f} "
                                                      "tokens (mean over the changed answers)"))
    return (f"drift from the original model `{drift['original']}` (mean NLL per answer token; {HELDOUT}: the bench "
            "prompts' dataset answers)\n\n| answers | records | NLL original | NLL trained | change |\n"
            + "|---|---|---|---|---|\n" + "\n".join(rows) + f"\n\ngreedy AR answers against the original's: {greedy}\n")


def _limit_line(results: dict) -> str:
    limit = results.get("bandwidth_limit")
    return "" if limit is None else (
        f"AR's bandwidth limit: {limit['tokens_per_s']:.1f} tokens/s ({limit['bytes_per_token'] / 1e6:.0f} MB read "
        f"per token at {limit['read_gb_per_s']:.1f} GB/s, the read bandwidth measured here)\n\n")


def _memory_line(results: dict) -> str:
    memory = results.get("fast_memory")
    return "" if not memory else "memory of the fast path, beside the weights: " + "; ".join(
        f"{engine}: static cache {m['static_cache'] / 1e6:.1f} MB, packed head {m['packed_head'] / 1e6:.1f} MB"
        for engine, m in memory.items()) + "\n\n"


def _width_line(results: dict) -> str:
    costs = results.get("forward_ms")
    return "" if not costs else "a forward's milliseconds by block width (every row's logits read, at the mean " \
        "context): " + "; ".join(f"{engine}: " + ", ".join(f"{w} {ms:.1f}" for w, ms in widths.items())
                                 for engine, widths in costs.items()) + "\n\n"


def write_report(results: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "bench.json", results)
    asked = results.get("num_prompts_asked", results["num_prompts"])
    write_text(out_dir / "bench.md",
        f"{results['num_prompts']} prompts"
        + (f" (bench.num_prompts={asked}: the split has only {results['num_prompts']})"
           if asked != results["num_prompts"] else "")
        + f", max_new_tokens={results['max_new_tokens']}, "
        f"temperature={results['temperature']}, device {results['device']} ({results.get('hardware', '?')}), "
        f"{results['dtype']}, "
        f"model `{results['model']}`\n\n"
        + _limit_line(results) + _memory_line(results) + _width_line(results) + markdown_table(results)
        + ("\nsampled AR answers: " if results["temperature"] else "\ngreedy answers: ")
        + ", ".join(f"{k} {v:.3f}" for k, v in results["quality"].items()) + "\n"
        + (f"\nanswers executed with isolation: {results['execution_isolation']}\n"
           if results.get("execution_isolation") else "")
        + (f"\n{drift_markdown(results)}" if results.get("drift") else ""))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["methods"])
    speedups = [results["methods"][n]["speedup"] for n in names]
    fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2, 3.5))
    bars = ax.bar(names, speedups, color=["#888" if n.startswith("hf_") or n == "ar" else "#3a7" for n in names])
    ax.bar_label(bars, fmt="%.2f×")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("speedup vs our AR (tokens/s)")
    ax.set_title(f"{results['num_prompts']} prompts · {results['device']}")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(out_dir / "bench.png", dpi=120)
    plt.close(fig)
