"""The benchmark behind ``python -m lit_spec.bench``: the same prompts, decoded one at a time by our AR baseline, the
chosen methods and transformers' own ``generate`` peers, with warm-up; tokens/s, speedup vs our AR, τ, forwards and
exact match (token-identical to our greedy AR) per method, written as bench.json, bench.md and bench.png. At
``bench.temperature`` > 0 every runner samples at that temperature (our AR and transformers' peers included, so
tokens/s compare like with like) and exact match is not reported."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from lit_spec.config import build
from lit_spec.data.metrics import get_metric, score_answers
from lit_spec.data.trajectories import RepetitionFilter
from lit_spec.decoding.base import DECODERS, Decoder, new_tokens
from lit_spec.decoding.stats import DecodeStats, sync_device
from lit_spec.errors import ConfigError
from lit_spec.io import write_json

log = logging.getLogger(__name__)

HF_PEERS = {"generate": "hf_generate", "assisted": "hf_assisted", "prompt_lookup": "hf_prompt_lookup"}


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("bench.device=cuda but no CUDA GPU is visible: use bench.device=cpu")
    return torch.device(name)


def _load(spec_cfg: DictConfig, device: torch.device):
    spec = build(spec_cfg)
    spec.prepare()
    spec.validate()
    model = spec.load_model().to(device).eval()
    return spec, model


def load_prompts(cfg: DictConfig, tokenizer) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The first ``bench.num_prompts`` prompts (token ids) of ``bench.split`` of the ``data`` config, and their
    dataset answers."""
    datamodule = build(cfg.data, tokenizer=tokenizer)
    datamodule.setup("test")
    split = datamodule.splits[cfg.bench.split]
    if len(split) == 0:
        raise ConfigError(f"bench.split={cfg.bench.split}: that split of the data is empty")
    n = min(cfg.bench.num_prompts, len(split))
    return [torch.tensor(split[i]["prompt_ids"])[None] for i in range(n)], [split[i]["answer_ids"] for i in range(n)]


class HFPeer:
    """transformers' ``generate`` in one of its modes, timed like our decoders (stats: tokens and wall time)."""

    def __init__(self, mode: str, model, draft, tokenizer, bench: DictConfig):
        self.name, self.model = HF_PEERS[mode], model
        self.kwargs = {"do_sample": bench.temperature > 0, "pad_token_id": tokenizer.pad_token_id}
        if bench.temperature > 0:
            self.kwargs.update(temperature=bench.temperature, top_p=1.0, top_k=0)
        if mode == "assisted":
            if draft is None:
                raise ConfigError("bench.hf_peers has 'assisted' but no draft model is configured (draft=null)")
            # a fixed number of draft tokens, like our speculative decoder's gamma (no adaptive schedule/threshold)
            draft.generation_config.num_assistant_tokens = bench.assistant_tokens
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            draft.generation_config.assistant_confidence_threshold = 0.0
            self.kwargs["assistant_model"] = draft
        elif mode == "prompt_lookup":
            self.kwargs["prompt_lookup_num_tokens"] = bench.prompt_lookup_tokens

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None):
        sync_device(ids.device)
        start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  eos_token_id=eos_token_id, **self.kwargs)
        sync_device(ids.device)
        stats = DecodeStats(wall_time=time.perf_counter() - start)
        stats.new_tokens = len(new_tokens(out, ids.size(1), eos_token_id))
        return out, stats


def build_runners(cfg: DictConfig, model, draft, tokenizer) -> dict:
    """Name -> object with ``generate(ids, max_new_tokens, eos_token_id)``: our AR first, then the methods, then
    transformers' peers."""
    sampling = {"temperature": cfg.bench.temperature, "seed": cfg.seed} if cfg.bench.temperature > 0 else {}
    runners: dict = {"ar": DECODERS["ar"](model, pad_token_id=tokenizer.pad_token_id, **sampling)}
    for name, params in (cfg.get("decoding") or {}).items():
        params = OmegaConf.to_container(params, resolve=True)
        method = params.pop("method", name)
        needs_draft = params.pop("needs_draft", False)
        if method not in DECODERS:
            raise ConfigError(f"decoding.{name}: method {method!r} is not available (have {sorted(DECODERS)})")
        if needs_draft:
            if draft is None:
                raise ConfigError(f"decoding.{name} needs a draft model; set draft=... (a model config)")
            params["draft_model"] = draft
        params.update(sampling)
        runners[name] = DECODERS[method](model, pad_token_id=tokenizer.pad_token_id, **params)
    for mode in cfg.bench.hf_peers or []:
        if mode not in HF_PEERS:
            raise ConfigError(f"bench.hf_peers: unknown {mode!r}; choose from {sorted(HF_PEERS)}")
        if mode == "assisted" and draft is None:
            continue
        runners[HF_PEERS[mode]] = HFPeer(mode, model, draft, tokenizer, cfg.bench)
    return runners


def _decode(runner, ids, max_new_tokens, eos):
    if isinstance(runner, Decoder):
        out = runner.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=eos)
        return out.sequences, out.stats
    return runner.generate(ids, max_new_tokens, eos)


def run_benchmark(cfg: DictConfig, out_dir: Path) -> dict:
    torch.manual_seed(cfg.seed)
    device = _device(cfg.bench.device)
    if cfg.bench.get("metric") is not None:
        get_metric(cfg.bench.metric)  # an unknown name fails here, before any work
    spec, model = _load(cfg.model, device)
    tokenizer = spec.load_tokenizer()
    draft = None
    if cfg.get("draft") is not None:
        _, draft = _load(cfg.draft, device)
        if draft.config.vocab_size != model.config.vocab_size:
            raise ConfigError(f"draft vocabulary ({draft.config.vocab_size}) differs from the target's "
                              f"({model.config.vocab_size}): pick a draft that shares the target's tokenizer")
    prompts, references = load_prompts(cfg, tokenizer)
    prompts = [p.to(device) for p in prompts]
    eos, max_new = tokenizer.eos_token_id, cfg.bench.max_new_tokens
    runners = build_runners(cfg, model, draft, tokenizer)

    for name, runner in runners.items():  # warm-up: kernels, allocator, caches
        for ids in prompts[: cfg.bench.warmup_prompts]:
            _decode(runner, ids, max_new, eos)
        if isinstance(runner, Decoder):
            runner.reset()                    # what a decoder learns across prompts starts with the timed ones

    totals = {name: DecodeStats() for name in runners}
    outputs: dict[str, list[list[int]]] = {name: [] for name in runners}
    with tqdm(total=len(prompts) * len(runners), desc="bench", unit="decode") as bar:
        for ids in prompts:  # methods interleaved per prompt: slow drifts of the machine hit all alike
            for name, runner in runners.items():
                seq, stats = _decode(runner, ids, max_new, eos)
                totals[name] = totals[name] + stats
                outputs[name].append(new_tokens(seq, ids.size(1), eos))
                bar.set_postfix(method=name, tok_s=f"{stats.tokens_per_s:.0f}")
                bar.update()

    base = totals["ar"].tokens_per_s
    results = {"model": spec.name_or_path, "device": str(device), "dtype": str(model.dtype).removeprefix("torch."),
               "num_prompts": len(prompts), "max_new_tokens": max_new, "temperature": cfg.bench.temperature,
               "methods": {}}
    for name, stats in totals.items():
        # sampled outputs differ by chance: token identity is a greedy (temperature 0) check only
        exact = (sum(o == a for o, a in zip(outputs[name], outputs["ar"])) / len(prompts)
                 if not cfg.bench.temperature else None)
        results["methods"][name] = {
            "tokens_per_s": stats.tokens_per_s, "speedup": stats.tokens_per_s / base if base else 0.0,
            "mean_accepted": stats.mean_accepted if stats.row_forwards else None,
            "target_forwards": stats.target_forwards if stats.target_forwards else None,
            "draft_forwards": stats.draft_forwards, "new_tokens": stats.new_tokens, "wall_time": stats.wall_time,
            "acceptance_rate": stats.acceptance_rate if stats.drafted_tokens else None,
            "fast_forwarded": stats.fast_forwarded, "stationary": stats.stationary, "exact_match": exact,
            "forward_time": stats.forward_time, "draft_time": stats.draft_time,
            "engine_overhead": stats.engine_overhead if stats.forward_time else None,
            "ms_per_forward": 1e3 * stats.forward_time / stats.target_forwards if stats.forward_time else None,
        }
    # what a method's target forward (its block of tokens) costs against AR's one-token forward: the hardware's share
    # of speedup / τ, next to the engine's (engine_overhead)
    ar_ms = results["methods"]["ar"]["ms_per_forward"]
    for m in results["methods"].values():
        m["forward_cost"] = m["ms_per_forward"] / ar_ms if ar_ms and m["ms_per_forward"] else None
    results["quality"] = answer_quality(outputs["ar"], references, tokenizer, cfg.bench.get("metric"))
    write_report(results, out_dir)
    return results


def answer_quality(outputs: list[list[int]], references: list[list[int]], tokenizer, metric: str | None) -> dict:
    """How good the greedy answers are (the same for every lossless method): the share that the collection's
    repetition filter flags (``RepetitionFilter`` defaults), and ``metric``'s mean score against the dataset's
    answers when one is named."""
    texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
    flag = RepetitionFilter()
    quality = {"repetitive": sum(flag.reason(o, t) is not None for o, t in zip(outputs, texts)) / len(outputs),
               "mean_new_tokens": sum(map(len, outputs)) / len(outputs)}
    if metric is not None:
        quality[metric] = score_answers(metric, outputs, references, tokenizer)
    return quality


def markdown_table(results: dict) -> str:
    head = ("| method | tokens/s | speedup vs our AR | τ (mean accepted) | target forwards | new tokens | "
            "exact match | time in target / draft forwards | target forward vs AR's | engine overhead |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")

    def fmt(v, spec, unit=""):
        return "–" if v is None else format(v, spec) + unit

    rows = [f"| {name} | {m['tokens_per_s']:.1f} | {m['speedup']:.2f}× | {fmt(m['mean_accepted'], '.2f')} | "
            f"{fmt(m['target_forwards'], 'd')} | {m['new_tokens']} | {fmt(m['exact_match'], '.2f')} | "
            + (f"{m['forward_time']:.2f} s / {m['draft_time']:.2f} s" if m["engine_overhead"] is not None else "–")
            + f" | {fmt(m['forward_cost'], '.2f', '×')}"
            + f" | {fmt(m['engine_overhead'], '.1%')} |"
            for name, m in results["methods"].items()]
    return head + "\n".join(rows) + "\n"


def write_report(results: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "bench.json", results)
    (out_dir / "bench.md").write_text(
        f"{results['num_prompts']} prompts, max_new_tokens={results['max_new_tokens']}, "
        f"temperature={results['temperature']}, device {results['device']}, {results['dtype']}, "
        f"model `{results['model']}`\n\n"
        + markdown_table(results) + ("\nsampled AR answers: " if results["temperature"] else "\ngreedy answers: ")
        + ", ".join(f"{k} {v:.3f}" for k, v in results["quality"].items()) + "\n")
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
