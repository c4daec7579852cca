"""What a run prints: each log line once, no tips for products lit_spec does not use, no warnings nobody can act on,
and a short ending for people (what ran, its headline figures, where its files are, what to run next). The
machine-readable files (metrics.json, csv/, bench.json, meta.json) stay as they are."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

from lit_spec.config import config_dir
from lit_spec.serving.vllm_runner import speculative_config

# Raised inside a library, about the library's own code: silenced where they are raised ("" for any module: Lightning's
# rank_zero_warn names its caller, not itself), each with why.
UNACTIONABLE_WARNINGS = [
    # Lightning's _pytree helper uses an API the installed torch deprecated; nothing here calls it
    (r".*isinstance\(treespec, LeafSpec\)` is deprecated", "lightning.pytorch.utilities._pytree"),
    # DeepSpeed's ZeRO calls collectives the installed torch renamed
    (r".*torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", "torch.distributed"),
    # a frozen base is in eval mode by design (FrozenBaseModule.train)
    (r"Found \d+ module\(s\) in eval mode at the start of training", ""),
    # the summary counts parameters; its MB estimate assumes 32 bits under any precision
    (r"Precision .* is not supported by the model summary", ""),
    # ThroughputMonitor reports tokens/s; no method counts FLOPs (MethodModule.flops_per_batch), so no MFU either
    (r"FLOPs not found for", ""),
    # Lightning's barrier() on NCCL, before a device is bound to the process group: harmless, nothing to set
    (r".*barrier\(\).*using the device under current context", "torch.distributed"),
    # the batches are tensors in memory (data.num_workers sets workers where a dataset needs them)
    (r"The '\w+_dataloader' does not have many workers", ""),
]


def _not_a_tip(record: logging.LogRecord) -> bool:
    # Lightning's ads for litlogger / litmodels, and its note that it skips its default model summary for ours
    # (callbacks=default's; turning enable_model_summary off instead would change every cached stage's key)
    # and its Tensor Cores hint, which float32_matmul_precision (train.yaml) answers: it shows for 'highest' too,
    # the default chosen on purpose (TF32 would make fp32 decoding inexact)
    message = record.getMessage()
    return not any(tip in message for tip in ("💡 Tip:", "Skipping setting a default `ModelSummary`",
                                              "that has Tensor Cores"))


def _not_cpu_fallback(record: logging.LogRecord) -> bool:
    # DeepSpeed (imported by transformers) announces its CPU accelerator on every machine without CUDA, where CPU is
    # the only accelerator there is; on a machine with CUDA the line still shows
    import torch

    return torch.cuda.is_available() or "Setting accelerator to CPU" not in record.getMessage()


def tidy_logging() -> None:
    """The ``lightning`` logger gets a console handler of its own when Lightning is imported, and also propagates to
    the root logger, which Hydra configures (console and the run's log file): every line came out twice. Where the
    root logger has handlers, Lightning's own is dropped."""
    import lightning  # noqa: F401  (imported first: its import adds the handler)

    lightning_logger = logging.getLogger("lightning")
    if logging.getLogger().handlers:
        for handler in [h for h in lightning_logger.handlers if type(h) is logging.StreamHandler]:
            lightning_logger.removeHandler(handler)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_not_a_tip)
    logging.getLogger("DeepSpeed").addFilter(_not_cpu_fallback)
    for message, module in UNACTIONABLE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)


def _share(value: float, total: int) -> str:
    """A share of prompts as a count: 0.75 of 16 -> 12/16."""
    return f"{round(value * total)}/{total}"


def _change(first: dict, last: dict, key: str, show) -> str:
    """``before → after`` of one figure (``after`` alone when there was no measurement before training)."""
    return f"{show(first[key])} → {show(last[key])}" if key in first else show(last[key])


def _figures(first: dict, last: dict, prompts: int) -> list[str]:
    """One line per decoder (τ, speedup over AR, exact match, before → after, and a verdict), one for quality, one
    for the answer NLL's drift."""
    lines = []
    for key in sorted(k for k in last if k.startswith("speedup/")):
        name = key.split("/", 1)[1]
        exact = last.get(f"exact_match/{name}")
        verdict = ("not faster than AR" if last[key] <= 1 else
                   "faster than AR, same output" if exact == 1.0 else "faster than AR")
        # sampled (NAME@T<t>): no exact match to show
        shown = "" if exact is None else \
            f", exact {_change(first, last, f'exact_match/{name}', lambda v: _share(v, prompts))}"
        lines.append(f"  {name}: τ {_change(first, last, f'mean_accepted/{name}', '{:.2f}'.format)}, speedup "
                     f"{_change(first, last, key, '{:.2f}×'.format)}{shown}: {verdict}")
    quality = sorted(k for k in last if k.startswith("quality/") and k.count("/") == 1)
    if quality:
        lines.append("  quality: " + ", ".join(f"{k.split('/', 1)[1]} {_change(first, last, k, '{:.2f}'.format)}"
                                               for k in quality))
    drift = sorted(k.removeprefix("drift/nll/") for k in last if k.startswith("drift/nll/"))
    if drift:
        lines.append("  answer NLL: " + ", ".join(_nll_drift(last, name) for name in drift))
    return lines


def _nll_drift(last: dict, name: str) -> str:
    """``original → now (change)`` of one answer set's NLL (``now`` alone when the original was not measured)."""
    now, change = last[f"drift/nll/{name}"], last.get(f"drift/nll_change/{name}")
    return f"{name} {now:.3f}" if change is None else f"{name} {now - change:.3f} → {now:.3f} ({change:+.3f})"


DRIFTED_NLL = 0.5   # nats per answer token: a larger rise of any answer set's NLL means another model


def verdict(last: dict, prompts: int) -> str | None:
    """The trade in plain words, from a measurement's figures: faster than AR or not (the best decoder's speedup),
    and whether the model is still the model (its greedy answers on the ``prompts`` held-out prompts, the largest
    answer-NLL change). None without a speedup figure."""
    speedups = [v for k, v in last.items() if k.startswith("speedup/")]
    if not speedups:
        return None
    head = "faster" if max(speedups) > 1 else "not faster than AR"
    agreement = last.get("quality/agreement")
    if agreement is None:
        return head
    changes = [v for k, v in last.items() if k.startswith("drift/nll_change/")]
    nll = f" (NLL {max(changes):+.1f})" if changes else ""
    unchanged = round(agreement * prompts)
    if agreement >= 0.5 and max(changes, default=0.0) <= DRIFTED_NLL:
        return f"{head}, answers unchanged on {unchanged}/{prompts}{nll}"
    return f"{head}, but answers changed on {prompts - unchanged}/{prompts}{nll}: the model drifted"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds // 60:.0f} min {seconds % 60:.0f} s"


def training_summary(cfg, metrics: dict, history: list, prompts: int, seconds: float) -> str:
    """The ending of ``python -m lit_spec.train``: what ran, the speedup callback's first and last figures, the files,
    the next commands."""
    run = Path(cfg.paths.output_dir)
    what = cfg.method._target_.rsplit(".", 1)[1]
    lines = [f"done: {cfg.get('task_name', 'train')} — {what} on {Path(str(cfg.model.name_or_path)).name}, "
             f"{metrics.get('global_step', 0)} steps in {_duration(seconds)}"]
    if history:
        (step0, first), (step1, last) = history[0], history[-1]
        lines.append(f"decoding {prompts} held-out prompts (speedup callback), step {step0} → step {step1}:")
        lines += _figures(first if step0 != step1 else {}, last, prompts)
    if metrics.get("verdict"):
        lines.append(f"verdict: {metrics['verdict']}")
    if "val/loss" in metrics:
        lines.append(f"  val/loss {metrics['val/loss']:.3f}")
    export = cfg.get("export_dir")
    heads = _heads_kind(export)
    files = [(export, f"the trained {heads} draft (heads.safetensors + heads.json)" if heads
              else "the trained model (save_pretrained)"),
             (Path(export) / "vllm" if export else None, "the draft in vLLM's layout (docs/serving.md)"),
             (run / "checkpoints", "last.ckpt and the best by val/loss (resume: ckpt_path=.../last.ckpt)"),
             (run / "csv" / "metrics.csv", "every logged figure"),
             (run / "speedup.png", "τ, speedup, quality and answer-NLL drift over the steps"),
             (run / "metrics.json", "the final figures")]
    lines.append(f"files in {run}:")
    for path, why in files:
        if path and Path(path).exists():
            name = str(Path(path).relative_to(run)) if Path(path).is_relative_to(run) else str(path)
            lines.append(f"  {name + ('/' if Path(path).is_dir() else ''):<16} {why}")
    lines.append("next:")
    if heads:       # decoded on the model it was trained on (the run's), by its decoder
        param = "transfer" if heads == "hidden_transfer" else "heads"
        lines.append(f"  python -m lit_spec.bench 'decoding=[{heads}]' decoding.{heads}.{param}={export} draft=null  "
                     "# bench the trained draft")
    elif export and Path(export).exists():
        lines.append(f"  python -m lit_spec.bench model=hf model.name_or_path={export} model.dtype=float32  "
                     "# bench the export")
    serve = _vllm_serve(cfg, export, heads)
    if serve:
        lines.append(f"  {serve}  # serve it (docs/serving.md)")
    lines.append(f"  python -m lit_spec.train -m {_sweep(cfg)}  # a sweep, one run each")
    return "\n".join(lines)


def _vllm_serve(cfg, export, heads: str | None) -> str | None:
    """The ``vllm serve`` command of a servable export: a draft beside the target it was trained on, or a trained
    model (CLLM, Jacobi Forcing, AR: vLLM has no Jacobi decoding, so prompt lookup)."""
    if not export or not Path(export).exists():
        return None
    target = cfg.model.name_or_path
    if heads:
        if not (Path(export) / "vllm").is_dir():
            return None
        # a DFlash block drafts all its mask slots at once: vLLM's query is the block it was trained on
        tokens = cfg.method.block_size - 1 if heads == "dflash" else 4
        draft = speculative_config(heads, Path(export) / "vllm", tokens)
    elif cfg.method._target_.endswith("DraftDistillModule"):
        draft = speculative_config("draft_model", export, 4)
    else:
        target, draft = export, speculative_config("ngram", None, 10)
    return f"vllm serve {target} --speculative-config '{json.dumps(draft)}'"


def _heads_kind(export) -> str | None:
    """The kind of draft heads an export holds (``heads.json``), or None for a model."""
    config = Path(export) / "heads.json" if export else None
    return json.loads(config.read_text())["kind"] if config is not None and config.is_file() else None


def _sweep(cfg) -> str:
    """This run's experiment at half and twice its lr."""
    task, lr = cfg.get("task_name", "train"), float(cfg.method.lr)
    experiment = f"+experiment={task} " if (config_dir() / "experiment" / f"{task}.yaml").is_file() else ""
    return f"{experiment}method.lr={lr / 2:g},{lr * 2:g}"


def bench_summary(results: dict, out_dir: Path) -> str:
    """The ending of ``python -m lit_spec.bench``: the fastest of our methods, whether its output is AR's, where the
    report is."""
    ours = {n: m for n, m in results["methods"].items() if not n.startswith("hf_") and n != "ar"}
    lines = [f"done: {results['num_prompts']} prompts × {len(results['methods'])} runners on {results['device']} "
             f"({results['dtype']})"]
    if ours:
        name, best = max(ours.items(), key=lambda item: item[1]["speedup"] or 0)
        exact = best.get("exact_match")
        lines.append(f"fastest of ours: {name}, {best['speedup']:.2f}× our AR"
                     + (f", {best['speedup_reference']:.2f}× transformers' generate" if best.get("speedup_reference")
                        else "")
                     + ("" if exact is None else f", exact on {_share(exact, results['num_prompts'])} prompts"))
    lines.append(f"files in {out_dir}: bench.md (the table), bench.json, bench.png")
    return "\n".join(lines)


def collection_summary(out: Path, meta: dict) -> str:
    """The ending of ``python -m lit_spec.collect``: what was collected, where, how to train on it."""
    stats = meta.get("stats", {})
    answers_only = (meta.get("config", {}).get("collect") or {}).get("decoder") == "ar"
    train = (f"data=self_distilled data.path={out} method=medusa   # a frozen-base method on the answers"
             if answers_only else f"data=trajectories data.path={out}   # CLLM on the trajectories")
    return (f"done: {stats.get('records', '?')} answers ({stats.get('kept', '?')} kept by the repetition filter, "
            f"{stats.get('dropped', '?')} dropped) in {out}\nnext:\n  python -m lit_spec.train {train}")
