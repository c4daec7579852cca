"""Measuring decoders, the one place for it: the bench (``lit_spec.benchmark``) and the training speedup callback
(``lit_spec.callbacks.speedup``) both build decoders from ``{name: params}``, decode the same prompts one at a time,
sum the stats and compare every method with the AR baseline (speedup, τ, exact match).

A *runner* is anything with ``generate(ids, max_new_tokens, eos_token_id) -> DecodeOutput``: our decoders, and
``HFPeer`` (transformers' own ``generate`` in one of its modes, timed the same way). vLLM runs in its own environment,
all prompts in one call (``vllm_peer_runs``), and joins the comparison as runs.
"""

from __future__ import annotations

import platform
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from lit_spec.decoding import DECODERS, DecodeOutput, DecodeStats, Decoder, new_tokens
from lit_spec.decoding.fast import StaticRow
from lit_spec.decoding.masks import causal
from lit_spec.decoding.state import eos_ids, until_eos
from lit_spec.decoding.stats import sync_device
from lit_spec.errors import ConfigError
from lit_spec.serving.vllm_runner import run_vllm

VLLM_AR = "vllm"         # bench.vllm_peers' AR run, the one every method's tokens/s is divided by
HF_PEERS = {"generate": "hf_generate", "assisted": "hf_assisted", "prompt_lookup": "hf_prompt_lookup"}
# extras a decoder may return (key -> metric name), averaged over prompts
EXTRAS = {"fast_forward_count": "fast_forward", "stationary_count": "stationary"}


def build_decoders(model, specs: dict[str, dict], draft=None, **common) -> dict[str, Decoder]:
    """``{name: params}`` -> ``{name: DECODERS[method](model, **params, **common)}``. A ``method`` key in params picks
    the decoder under another name (``{jacobi32: {method: jacobi, n_tokens: 32}}``); ``needs_draft: true`` passes
    ``draft`` as its ``draft_model``."""
    decoders = {}
    for name, params in specs.items():
        params = dict(params or {})
        method = params.pop("method", name)
        if method not in DECODERS:
            raise ConfigError(f"decoder {name!r}: method {method!r} is not available (have {sorted(DECODERS)})")
        if params.pop("needs_draft", False):
            if draft is None:
                raise ConfigError(f"decoder {name!r} needs a draft model: choose one with model@draft=NAME (a model "
                                  "config, e.g. model@draft=tiny_draft)")
            params["draft_model"] = draft
        decoders[name] = DECODERS[method](model, **params, **common)
    return decoders


def fast_roles(runners: dict) -> dict:
    """The fast engines the runners use, the target's and the draft model's, by ``KIND/target`` or ``KIND/draft``."""
    out = {}
    for runner in runners.values():
        if getattr(runner, "fast", None):       # a lit_spec decoder on the fast path (not a peer)
            target, *drafts = runner.fast_engines()
            out[f"{target.kind}/target"] = target
            out |= {f"{draft.kind}/draft": draft for draft in drafts}
    return out


def fast_engines(runners: dict) -> list:
    """The fast engines the runners share, drafts' included: one per model and kind (every one, where two draft
    models would share a ``fast_roles`` name)."""
    return list({id(e): e for r in runners.values() if getattr(r, "fast", None) for e in r.fast_engines()}.values())


def reserve_fast_caches(runners: dict, prompt_lengths: list[int], max_new_tokens: int) -> list:
    """The runners' fast engines, each with its static cache sized for the longest prompt before any decode, so
    that no cache grows (and no width recompiles for its shapes) mid-run."""
    engines = fast_engines(runners)
    for engine in engines:
        engine.reserve(engine.positions(max(prompt_lengths), max_new_tokens))
    return engines


class HFPeer:
    """transformers' ``generate`` in one of its modes (``HF_PEERS``), timed like our decoders (tokens, wall time)."""

    def __init__(self, mode: str, model, draft=None, pad_token_id: int | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, assistant_tokens: int = 4, prompt_lookup_tokens: int = 10,
                 prompt_lookup_ngram: int = 2):
        if mode not in HF_PEERS:
            raise ConfigError(f"bench.hf_peers: unknown {mode!r}; choose from {sorted(HF_PEERS)}")
        self.name, self.model = HF_PEERS[mode], model
        self.kwargs = {"do_sample": temperature > 0, "pad_token_id": pad_token_id}
        if temperature > 0:
            self.kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
        if mode == "assisted":
            if draft is None:
                raise ConfigError("bench.hf_peers has 'assisted' but no draft model is configured (draft=null)")
            # a fixed number of draft tokens, like our speculative decoder's gamma (no adaptive schedule/threshold)
            draft.generation_config.num_assistant_tokens = assistant_tokens
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            draft.generation_config.assistant_confidence_threshold = 0.0
            self.kwargs["assistant_model"] = draft
        elif mode == "prompt_lookup":
            self.kwargs.update(prompt_lookup_num_tokens=prompt_lookup_tokens, max_matching_ngram_size=prompt_lookup_ngram)

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None) -> DecodeOutput:
        sync_device(ids.device)
        start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  eos_token_id=eos_token_id, **self.kwargs)
        sync_device(ids.device)
        stats = DecodeStats(wall_time=time.perf_counter() - start)
        stats.new_tokens = len(new_tokens(out, ids.size(1), eos_token_id))
        return DecodeOutput(out, stats)

    def reset(self) -> None:
        """Nothing carries over between calls."""


def vllm_peer_runs(peers: dict[str, dict | None], model: str, dtype: str, prompts: list[torch.Tensor],
                   max_new_tokens: int, eos, sampling: dict | None = None) -> dict[str, "Run"]:
    """vLLM (``lit_spec.serving.vllm_runner``) on the same prompt ids, one prompt at a time, greedy or ``sampling``
    (temperature, top_p, seed): ``{name:
    speculative_config or None}``, each a ``Run`` like our decoders'; eager, unless the config has ``compiled: true``
    (``{compiled: true}`` alone: AR, compiled). Its forwards are each prompt's prefill plus its decode steps (τ as
    ours). vLLM counts neither its steps nor, for a step that drafted nothing (``ngram``
    without a match), its drafts, so the steps are the larger of two lower bounds: the steps that drafted, and the
    new tokens less the accepted ones (vLLM also counts tokens accepted past a prompt's stop, at most K a prompt)."""
    ids = [p[0].tolist() for p in prompts]
    requests = {}
    for name, spec in peers.items():
        spec = dict(spec or {})
        requests[name] = {"model": model, "enforce_eager": not spec.pop("compiled", False),
                          **({"speculative_config": spec} if spec else {})}
    results = run_vllm(requests, ids, max_new_tokens, dtype=dtype, sampling=sampling)
    runs = {}
    for name, r in results.items():
        outputs = [until_eos(t, eos_ids(eos)) for t in r.tokens]
        new = sum(map(len, outputs))
        forwards = max(len(ids) + r.drafts, new - r.accepted_tokens)
        stats = DecodeStats(new_tokens=new, target_forwards=forwards, row_forwards=forwards,
                            drafted_tokens=r.draft_tokens, accepted_tokens=r.accepted_tokens,
                            wall_time=sum(r.seconds))
        runs[name] = Run(outputs=outputs, stats=stats, extras=[{} for _ in ids])
    return runs


@dataclass
class Run:
    """One runner over all prompts: the new tokens of each (up to and including EOS), summed stats, extras."""
    outputs: list[list[int]] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)
    extras: list[dict] = field(default_factory=list)


def concat_runs(parts: list[dict[str, Run]]) -> dict[str, Run]:
    """Runs over consecutive groups of prompts (the same runners) as one run each over all of them, in order."""
    runs = {name: Run() for name in (parts[0] if parts else {})}
    for part in parts:
        for name, run in part.items():
            runs[name].outputs += run.outputs
            runs[name].stats = runs[name].stats + run.stats
            runs[name].extras += run.extras
    return runs


def warm_up(runners: dict, prompts: list[torch.Tensor], max_new_tokens: int, eos) -> None:
    """Decode ``prompts`` with every runner (kernels, allocator, caches), then ``reset()`` what a runner learns
    across prompts, so warm-up prompts teach nothing."""
    for runner in runners.values():
        for ids in prompts:
            runner.generate(ids, max_new_tokens, eos)
        runner.reset()


def decode_prompts(runners: dict, prompts: list[torch.Tensor], max_new_tokens: int, eos,
                   on_decode: Callable[[str, DecodeStats], None] | None = None) -> dict[str, Run]:
    """Every prompt (batch size 1) by every runner, runners interleaved per prompt so that slow drifts of the machine
    hit all alike."""
    runs = {name: Run() for name in runners}
    for ids in prompts:
        for name, runner in runners.items():
            out = runner.generate(ids, max_new_tokens, eos)
            run = runs[name]
            run.outputs.append(new_tokens(out.sequences, ids.size(1), eos))
            run.stats = run.stats + out.stats
            run.extras.append(out.extras)
            if on_decode is not None:
                on_decode(name, out.stats)
    return runs


@contextmanager
def eval_mode(module: torch.nn.Module):
    """Inside, ``module`` is in eval mode (no dropout); after, every submodule is back in its own mode (a frozen base
    stays in eval mode inside a training module, so ``module.train()`` would not restore it)."""
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield module
    finally:
        for m, training in modes.items():
            m.training = training


def read_bandwidth(device: torch.device, nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes per second this device reads from memory: the best of ``repeats`` sums over ``nbytes`` of fp32, many
    times the CPU's last-level cache (every core summing: what a decode's weight reads get at best)."""
    data = torch.ones(nbytes // 4, device=device)
    best = float("inf")
    for _ in range(repeats):
        sync_device(device)
        start = time.perf_counter()
        data.sum()
        sync_device(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def describe_device(device: torch.device) -> str:
    """The hardware and torch a timing was taken on, as a report names it: the GPU's name, or the CPU's model and
    torch's threads."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        try:
            with open("/proc/cpuinfo") as f:
                name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "CPU")
        except OSError:     # not Linux
            name = platform.processor() or "CPU"
        threads = torch.get_num_threads()
        name += f", {threads} thread{'s' if threads > 1 else ''}"
    return f"{name}, torch {torch.__version__}"


def bytes_per_token(model, context: float) -> float:
    """What a one-token forward reads at ``context`` cached positions: every weight once (a tied LM head once; an
    untied input embedding not at all, since one row of it is read) and the keys and values of every layer."""
    skip = set()
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or embed.weight is not head.weight:
        skip.add(id(embed.weight))
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    element = next(model.parameters()).element_size()
    return weights + 2 * c.num_hidden_layers * kv_heads * head_dim * element * context


def bandwidth_limit(model, prompt_lengths: list[int], max_new_tokens: int) -> dict:
    """AR's physical limit here: the tokens per second a one-token-per-forward decode would reach if every forward
    only read its bytes (``bytes_per_token`` at the mean context: prompt + half the new tokens) at the measured read
    bandwidth. A decoder's share of it may pass 1: it reads the weights once for several tokens."""
    device = next(model.parameters()).device
    bandwidth = read_bandwidth(device)
    per_token = bytes_per_token(model, mean_context(prompt_lengths, max_new_tokens))
    return {"read_gb_per_s": bandwidth / 1e9, "bytes_per_token": per_token, "tokens_per_s": bandwidth / per_token}


def mean_context(prompt_lengths: list[int], max_new_tokens: int) -> float:
    """The positions a decode's forward sees on average: its prompt and half its new tokens."""
    return mean(prompt_lengths) + max_new_tokens / 2


def forward_ms(engine, context: int, repeats: int = 5) -> dict[str, float]:
    """The milliseconds a forward of each block width ``engine`` decoded at takes (``"4"``, ``"8+hidden"``: the
    median of ``repeats``, every row's logits read) after ``context`` cached positions: what a verification costs by
    its width, so what a draft length costs on this host (the widths are compiled already: nothing compiles here)."""
    if not engine.widths:
        return {}
    param = next(engine.model.parameters())
    widest = max(w for w, _ in engine.widths)
    context = max(1, min(context, engine.cache_length - widest))     # within the cache: a longer one recompiles
    out = {}
    with torch.no_grad(), engine.attention():
        row = StaticRow(engine, context + widest, param.dtype, param.device)
        prompt = torch.zeros(1, context, dtype=torch.long, device=param.device)
        row.run(prompt, causal(context, param.device), torch.arange(context, device=param.device)[None], False,
                slice(-1, None), eager=True)
        for width, hidden in sorted(engine.widths):
            block = torch.zeros(1, width, dtype=torch.long, device=param.device)
            positions = torch.arange(context, context + width, device=param.device)[None]
            times = []
            for _ in range(repeats + 1):        # the first, a warm-up, is dropped
                sync_device(param.device)
                start = time.perf_counter()
                row.run(block, causal(width, param.device), positions, hidden, slice(None))
                sync_device(param.device)
                times.append(time.perf_counter() - start)
                row.set_length(context)
            out[f"{width}{'+hidden' if hidden else ''}"] = 1e3 * sorted(times[1:])[repeats // 2]
    return out


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def compare(runs: dict[str, Run], baseline: str = "ar", exact: bool = True,
            reference: str | None = None) -> dict[str, dict]:
    """Per runner: tokens/s, speedup over ``baseline``'s tokens/s, τ (mean tokens accepted per target forward),
    forwards and times, exact match with ``baseline``'s outputs (share of prompts token-identical; ``exact=False``,
    e.g. when sampling: None) and, as ``speedup_reference`` / ``exact_match_reference``, against ``reference``
    (e.g. transformers' greedy ``generate``), what a target forward costs against the baseline's (the hardware's share of speedup / τ) and the
    engine overhead (the engine's share), and the decoder's averaged extras."""
    base = runs[baseline]

    def exact_match(run: Run, other: Run) -> float | None:
        return mean(o == a for o, a in zip(run.outputs, other.outputs)) if exact else None

    results = {}
    for name, run in runs.items():
        s = run.stats
        m = {"tokens_per_s": s.tokens_per_s,
             "speedup": s.tokens_per_s / base.stats.tokens_per_s if base.stats.tokens_per_s else 0.0,
             "mean_accepted": s.mean_accepted if s.row_forwards else None,
             "target_forwards": s.target_forwards or None, "draft_forwards": s.draft_forwards,
             "new_tokens": s.new_tokens, "wall_time": s.wall_time,
             "acceptance_rate": s.acceptance_rate if s.drafted_tokens else None,
             "fast_forwarded": s.fast_forwarded, "stationary": s.stationary,
             "exact_match": exact_match(run, base),
             "exact_match_reference": exact_match(run, runs[reference]) if reference in runs else None,
             "speedup_reference": (s.tokens_per_s / runs[reference].stats.tokens_per_s
                                   if reference in runs and runs[reference].stats.tokens_per_s else None),
             "speedup_vllm": (s.tokens_per_s / runs[VLLM_AR].stats.tokens_per_s
                              if VLLM_AR in runs and runs[VLLM_AR].stats.tokens_per_s else None),
             "forward_time": s.forward_time, "draft_time": s.draft_time, "compile_time": s.compile_time,
             "engine_overhead": s.engine_overhead if s.forward_time else None,
             "ms_per_forward": 1e3 * s.forward_time / s.target_forwards if s.forward_time else None}
        for key, metric in EXTRAS.items():
            values = [float(e[key]) for e in run.extras if key in e]
            if values:
                m[metric] = mean(values)
        results[name] = m
    base_ms = results[baseline]["ms_per_forward"]
    for m in results.values():
        m["forward_cost"] = m["ms_per_forward"] / base_ms if base_ms and m["ms_per_forward"] else None
    return results
