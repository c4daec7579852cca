"""``callbacks=speedup``: decoding speed and quality of the model being trained, measured while it trains.

At train start and after every validation run the callback decodes the same held-out prompts, one at a time, with
greedy AR (the baseline) and with every other decoder, and logs per decoder NAME ``speedup/NAME`` (tokens/s over AR's
in the same call), ``tokens_per_s/NAME``, ``mean_accepted/NAME`` (τ), ``exact_match/NAME`` (share of prompts whose
output is token-identical to the current greedy AR output: the lossless check) and, where the decoder reports them,
``fast_forward/NAME`` / ``stationary/NAME`` (Jacobi's CLLM Table 3 counts); plus ``tokens_per_s/ar``. At every
other temperature in ``temperatures``, AR and every decoder that samples decode again, sampling, logged as
``NAME@T<t>`` (speed and τ against AR sampled at t).

Quality: ``quality/agreement`` (share of prompts whose greedy AR output still equals the original model's, decoded
before the first training step and kept in the callback's state, so a resumed run compares with the original),
``quality/token_agreement`` (mean common-prefix length / original length) and ``quality/first_divergence`` (over the
changed outputs, the median number of tokens still equal before the first differing one; logged once one changed);
``quality/<metric>`` when the datamodule names a task metric (``data.metric``), scoring the AR outputs against the
dataset's answers (or by execution: ``pass_at_1``), and ``quality/<metric>/NAME`` for every other decoder's outputs.
``time/measure_s``: what the measurement cost.

Drift (``lit_spec.drift``), finer than any greedy output: ``drift/nll/heldout``, the mean NLL per token of the decoded
records' dataset answers, ``drift/nll/SET`` for every ``drift_data`` set (all records of a data config's evaluation
split, e.g. HumanEval's 164), and ``drift/nll_change/SET`` (trained − original, the original's values measured before
the first step and kept in the state with the original outputs).

Design: the callback asks the method module for its decoders (``MethodModule.decoders()``), so a method that trains
for a decoder (CLLM: Jacobi; Chimera, Hidden Transfer: their tree decoders) plugs in without changing this file;
``extra_decoders`` adds any registered decoder over the same model. From the datamodule it uses only
``eval_records(split, n)``, ``tokenizer`` and ``metric``.

On N ranks the work is split: rank r decodes, scores and measures the NLL of every N-th prompt and record from the r-th,
and one ``all_gather_object`` per measurement brings every rank the whole, from which each computes the same figures
(only rank zero writes to loggers). Decoding and scoring run under the precision plugin's forward context (autocast
under bf16-mixed), as the training step does. Where the weights are sharded (ZeRO-3, FSDP2) the decoders run on a
plain copy of the module for the measurement, or, where it does not fit, on the sharded model collectively: every rank
then runs every forward and keeps its share (``lit_spec.callbacks.decoding_copy``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from lit_spec.callbacks.decoding_copy import DecodingCopy
from lit_spec.data.execution import describe_isolation
from lit_spec.data.metrics import EXECUTION_METRICS, score_answers
from lit_spec.decoding import DECODERS, Decoder
from lit_spec.decoding.fast import ENGINES
from lit_spec.decoding.verify import check_sampling
from lit_spec.drift import HELDOUT, answer_nll_terms, check_drift_data, compare_answers, drift_records, nll_mean
from lit_spec.errors import ConfigError
from lit_spec.measure import (EXTRAS, Run, build_decoders, compare, concat_runs, decode_prompts, eval_mode,
                              reserve_fast_caches)
from lit_spec.strategies import all_gather_object, weights_sharded

log = logging.getLogger(__name__)

PLOT = "speedup.png"     # in the run directory, beside csv/metrics.csv
UNPLOTTED = {"quality/first_divergence"}   # tokens, off the scale of the quality panel's shares


def plot_history(history: list[tuple[int, dict[str, float]]], path: Path) -> None:
    """τ, speedup over AR, quality and answer-NLL drift of every measurement, against the training step (written
    after each one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [step for step, _ in history]
    panels = [("mean_accepted/", "τ (tokens per forward)", None), ("speedup/", "speedup over AR (tokens/s)", 1.0),
              ("quality/", "quality", None), ("drift/nll_change/", "answer NLL − original's", 0.0)]
    fig, axes = plt.subplots(1, len(panels), figsize=(17, 3.6))
    for ax, (prefix, title, level) in zip(axes, panels):
        # one level under the prefix: quality/agreement, not quality/exact_match/jacobi
        names = sorted({k for _, m in history for k in m
                        if k.startswith(prefix) and "/" not in k[len(prefix):] and k not in UNPLOTTED})
        for name in names:
            ax.plot(steps, [m.get(name, float("nan")) for _, m in history], marker="o", label=name[len(prefix):])
        if level is not None:   # no speedup, no change
            ax.axhline(level, color="k", lw=0.8)
        ax.set_title(title)
        ax.set_xlabel("step")
        if names:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tag(temperature: float) -> str:
    """The suffix of a decoder's name and metrics at ``temperature``: none when greedy, ``@T0.7`` otherwise."""
    return f"@T{temperature:g}" if temperature else ""


class SpeedupCallback(L.Callback):
    """Args:
        num_prompts: records of ``split`` decoded per measurement (batch size 1).
        max_new_tokens: per prompt; decoding stops earlier at the tokenizer's EOS.
        split: the datamodule split the prompts come from; an empty one falls back to test, then train.
        at_train_start: measure (and log) before the first training step as well.
        every_n_validations: measure after every n-th validation run.
        extra_decoders: ``{name: {params}}`` built as ``DECODERS[name](model, **params)``; a ``method`` key in
            params picks the decoder under another name (``{jacobi32: {method: jacobi, n_tokens: 32}}``).
        drift_data: ``{set name: data config name}``: answer sets whose NLL is logged as ``drift/nll/SET`` (all
            records of the data config's evaluation split), beside the held-out records' own.
        decode_copy: where the weights are sharded, decode a plain copy (``true``), the sharded model itself
            (``false``), or the copy where it fits in memory on every rank (``auto``; ``DecodingCopy``).
        engine: the decoders' engine, ``eager``, ``static`` or ``compiled`` (``lit_spec.decoding.fast``; not
            ``frozen``, which would not see the weights train); the seconds compiling takes are logged as
            ``time/compile_s``, kept out of tokens/s, in ``time/measure_s``.
        temperatures: the temperatures measured, 0 (greedy) among them: at each t > 0 AR and every decoder that
            samples decode again, sampling (lossless rules: their τ is the model's), logged as ``NAME@T<t>``.
        top_p, seed: the sampling's top-p and its generators' seed.
    """

    def __init__(self, num_prompts: int = 8, max_new_tokens: int = 64, split: str = "validation",
                 at_train_start: bool = True, every_n_validations: int = 1, extra_decoders: dict | None = None,
                 drift_data: dict | None = None, decode_copy: bool | str = "auto", engine: str = "eager",
                 temperatures=(0.0,), top_p: float = 1.0, seed: int = 0):
        self.num_prompts, self.max_new_tokens, self.split = num_prompts, max_new_tokens, split
        self.temperatures = list(temperatures) if isinstance(temperatures, (list, tuple, ListConfig)) else temperatures
        self.top_p, self.seed = top_p, seed
        self.at_train_start, self.every_n_validations = at_train_start, every_n_validations
        if isinstance(extra_decoders, DictConfig):
            extra_decoders = OmegaConf.to_container(extra_decoders, resolve=True)
        self.extra_decoders = {name: dict(params or {}) for name, params in (extra_decoders or {}).items()}
        self.drift_data, self.copy, self.engine = drift_data, DecodingCopy(decode_copy), engine
        self.records: list[dict] | None = None
        self.answer_sets: dict[str, list[dict]] = {}    # set name -> records whose answers' NLL is logged
        self.tokenizer = None
        self.warmed = False
        self.compile_seconds = 0.0     # the last measurement's, on this rank
        # the original model's: {"prompt_ids", "outputs" (greedy AR), "nll" ({set name: answer NLL})}
        self.reference: dict | None = None
        self.validations = 0
        self.last_metrics: dict[str, float] = {}
        self.history: list[tuple[int, dict[str, float]]] = []

    # ---- checks and building ----------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Bad options fail here, before training starts (Hydra would wrap an error raised in ``__init__``)."""
        for name, value in [("num_prompts", self.num_prompts), ("max_new_tokens", self.max_new_tokens),
                            ("every_n_validations", self.every_n_validations)]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"callbacks.speedup.{name}={value!r}: must be an integer >= 1")
        for name, params in self.extra_decoders.items():
            method = params.get("method", name)
            if method not in DECODERS:
                raise ConfigError(f"callbacks.speedup.extra_decoders.{name}: unknown decoder {method!r}; "
                                  f"available: {sorted(DECODERS)}")
            if name == "ar":
                raise ConfigError("callbacks.speedup.extra_decoders: 'ar' is the baseline, always measured; "
                                  "give the entry another name and `method: ar`")
        self.drift_data = check_drift_data(self.drift_data, "callbacks.speedup.drift_data")
        if (not isinstance(self.temperatures, list) or 0 not in self.temperatures
                or any(isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0 for t in self.temperatures)):
            raise ConfigError(f"callbacks.speedup.temperatures={self.temperatures!r}: a list of numbers >= 0 that "
                              "includes 0 (greedy: the lossless and quality checks), e.g. [0, 0.7, 1]")
        check_sampling(1.0, self.top_p, "callbacks.speedup.")
        if self.engine not in ENGINES:
            raise ConfigError(f"callbacks.speedup.engine={self.engine!r}: choose one of {ENGINES}")
        if self.engine == "frozen":
            raise ConfigError("callbacks.speedup.engine=frozen compiles the weights into its graphs, and the "
                              "callback decodes the model it trains: use engine=compiled (it reads them live)")
        if self.engine != "eager" and weights_sharded(trainer.strategy):
            # the copy decoded under sharded weights is new at every measurement: its cache and widths would be too
            raise ConfigError(f"callbacks.speedup.engine={self.engine}: under {type(trainer.strategy).__name__} the "
                              "callback decodes a new copy of the sharded model at every measurement, which the "
                              "fast path would rebuild and recompile each time; use engine=eager there")
        if self.copy.mode not in (True, False, "auto"):
            raise ConfigError(f"callbacks.speedup.decode_copy={self.copy.mode!r}: true, false or auto")

    def _prepare(self, trainer: L.Trainer) -> None:
        """At first use (the datamodule is set up by then): the prompts and the answer sets."""
        if self.records is not None:
            return
        dm = trainer.datamodule
        self.tokenizer = dm.tokenizer
        for split in dict.fromkeys([self.split, "test", "train"]):
            self.records = dm.eval_records(split, self.num_prompts)
            if self.records:
                break
            log.info("speedup callback: split %r has no records, trying the next", split)
        if not self.records:
            raise ConfigError("callbacks.speedup: the datamodule has no records to decode")
        self.answer_sets = {HELDOUT: self.records} | {
            name: drift_records(data, dm.tokenizer) for name, data in self.drift_data.items()}
        log.info("speedup callback: answer NLL of %s", ", ".join(f"{n} ({len(r)} records)"
                                                                for n, r in self.answer_sets.items()))
        if getattr(dm, "metric", None) in EXECUTION_METRICS:
            log.info("speedup callback: %s runs the answers isolated by %s", dm.metric, describe_isolation())

    def _decoders(self, module: L.LightningModule, only_ar: bool) -> dict[str, Decoder]:
        """AR, the method's decoders and ``extra_decoders``, over the module decoded this time: greedy under their
        names, and at every other temperature those that sample, under ``NAME@T<t>`` (only AR: greedy AR)."""
        decoders = {}
        for t in self.temperatures if not only_ar else [0]:
            sampling = {"temperature": t, "top_p": self.top_p, "seed": self.seed} if t else {}
            group = {"ar": DECODERS["ar"](module.model, **sampling)}
            if not only_ar:
                group |= getattr(module, "decoders", dict)(**sampling)
                clash = sorted(set(group) & set(self.extra_decoders))
                if clash:
                    raise ConfigError(f"callbacks.speedup.extra_decoders.{clash[0]}: the method already offers a "
                                      f"decoder named {clash[0]!r}; name the entry otherwise, with `method: "
                                      f"{clash[0]}`")
                extra = {n: p for n, p in self.extra_decoders.items()
                         if not (t and DECODERS[p.get("method", n)].greedy_only)}
                group |= build_decoders(module.model, extra, **sampling)
            decoders |= {name + tag(t): decoder for name, decoder in group.items()}
        for decoder in decoders.values():
            decoder.set_engine(self.engine)
        return decoders

    # ---- measuring --------------------------------------------------------------------------------------------
    def _decode(self, decoders: dict[str, Decoder], records: list[dict], device: torch.device) -> dict[str, Run]:
        prompts = [torch.tensor([r["prompt_ids"]], device=device) for r in records]
        return decode_prompts(decoders, prompts, self.max_new_tokens, self.tokenizer.eos_token_id)

    @torch.no_grad()
    def _evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule,
                  only_ar: bool = False) -> tuple[dict[str, Run], dict[str, float], dict[str, float]]:
        """Decode the prompts with every decoder (AR only: ``only_ar``), score the answers with the task metric and
        every answer set's NLL, in eval mode (each submodule's mode restored after) and the precision's forward
        context; each rank its share, gathered. Returns the runs, the NLL per set and the score per decoder."""
        self._prepare(trainer)
        rank, world = trainer.global_rank, trainer.world_size
        with self.copy.decoding(trainer, pl_module) as (module, local), eval_mode(module), \
                trainer.precision_plugin.forward_context():
            decoders = self._decoders(module, only_ar)
            engines = reserve_fast_caches(decoders, [len(r["prompt_ids"]) for r in self.records],
                                          self.max_new_tokens)
            compiled_before = sum(e.compile_time for e in engines)
            if not self.warmed:     # once per process, untimed; every rank the same prompt
                self._decode({"ar": decoders["ar"]}, self.records[:1], module.device)
                self.warmed = True
            # where every forward is collective every rank runs all of them, and keeps its share
            mine = {n: range(rank, len(r), world) for n, r in self.answer_sets.items()}
            todo = mine if local else {n: range(len(r)) for n, r in self.answer_sets.items()}
            runs = {i: self._decode(decoders, [self.records[i]], module.device) for i in todo[HELDOUT]}
            nll = {n: dict(zip(todo[n], answer_nll_terms(module.model, [r[i] for i in todo[n]], module.device)))
                   for n, r in self.answer_sets.items()}
        self.compile_seconds = sum(e.compile_time for e in engines) - compiled_before
        runs = {i: runs[i] for i in mine[HELDOUT]}
        nll = {n: {i: terms[i] for i in mine[n]} for n, terms in nll.items()}
        return self._gathered(all_gather_object((runs, nll, self._scores(trainer.datamodule, runs, decoders))))

    def _scores(self, dm, runs: dict[int, dict[str, Run]], decoders) -> dict[str, tuple[float, int]]:
        """Per decoder, the task metric summed over this rank's answers, and their count (no metric: none)."""
        metric, records = getattr(dm, "metric", None), [self.records[i] for i in runs]
        if not metric:
            return {}
        return {name: (score_answers(metric, [runs[i][name].outputs[0] for i in runs], records, self.tokenizer)
                       * len(records) if records else 0.0, len(records)) for name in decoders}

    def _gathered(self, parts: list[tuple]) -> tuple[dict[str, Run], dict[str, float], dict[str, float]]:
        """Every rank's share put together, in prompt and record order: the runs over all prompts, the NLL per set,
        the task metric's mean per decoder."""
        runs = {i: run for part, _, _ in parts for i, run in part.items()}
        terms = {n: {i: t for _, part, _ in parts for i, t in part[n].items()} for n in self.answer_sets}
        nll = {n: nll_mean([by_record[i] for i in sorted(by_record)]) for n, by_record in terms.items()}
        scores = {name: sum(p[name][0] for *_, p in parts) / max(1, sum(p[name][1] for *_, p in parts))
                  for name in parts[0][2]}
        return concat_runs([runs[i] for i in sorted(runs)]), nll, scores

    def measure(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """Decode, compute the metrics, keep them in ``last_metrics`` and ``history``; logging is the hooks' job."""
        started = time.perf_counter()
        runs, nll, scores = self._evaluate(trainer, pl_module)
        self._keep_original(runs["ar"].outputs, nll)
        metrics = self._speed(runs) | self._quality(runs, scores, trainer.datamodule) | self._drift(nll)
        metrics["time/measure_s"] = time.perf_counter() - started    # the whole measurement: copy, decodes, NLLs
        if self.engine == "compiled":
            metrics["time/compile_s"] = self.compile_seconds     # inside time/measure_s, outside tokens/s
        self.last_metrics = metrics
        self.history.append((trainer.global_step, metrics))
        if trainer.is_global_zero:
            plot_history(self.history, Path(trainer.default_root_dir) / PLOT)
        return metrics

    def _speed(self, runs: dict[str, Run]) -> dict[str, float]:
        """Logged per decoder NAME: speedup/NAME, tokens_per_s/NAME, mean_accepted/NAME, exact_match/NAME and the
        decoder's extras (fast_forward/NAME, ...); AR's tokens/s. At a temperature t > 0 the same under NAME@T<t>,
        against AR sampled at t, without exact match."""
        metrics = {}
        for t in self.temperatures:
            group = {name.removesuffix(tag(t)): run for name, run in runs.items()
                     if (name.endswith(tag(t)) if t else "@T" not in name)}
            keys = ("speedup", "tokens_per_s", "mean_accepted", *(() if t else ("exact_match",)), *EXTRAS.values())
            metrics[f"tokens_per_s/ar{tag(t)}"] = group["ar"].stats.tokens_per_s
            metrics |= {f"{key}/{name}{tag(t)}": float(m[key] or 0.0) for name, m in compare(group).items()
                        if name != "ar" for key in keys if key in m}
        return metrics

    def _keep_original(self, outputs: list[list[int]], nll: dict[str, float]) -> None:
        """The first outputs and answer NLLs measured: the model as it was before training (kept in the state)."""
        if self.reference is None:
            self.reference = {"prompt_ids": [r["prompt_ids"] for r in self.records], "outputs": outputs, "nll": nll}

    def _quality(self, runs: dict[str, Run], scores: dict[str, float], dm) -> dict[str, float]:
        outputs, prompts = runs["ar"].outputs, [r["prompt_ids"] for r in self.records]
        original = {tuple(p): o for p, o in zip(self.reference["prompt_ids"], self.reference["outputs"])}
        pairs = [(o, original[tuple(p)]) for p, o in zip(prompts, outputs) if tuple(p) in original]
        metrics = {f"quality/{key}": value for key, value in
                   compare_answers([o for o, _ in pairs], [r for _, r in pairs]).items() if value is not None}
        # AR's answers, and every other decoder's (a lossless one scores what AR scores)
        return metrics | {f"quality/{dm.metric}" + ("" if decoder == "ar" else f"/{decoder}"): score
                          for decoder, score in scores.items()}

    def _drift(self, nll: dict[str, float]) -> dict[str, float]:
        """drift/nll/SET and, for the sets the original was measured on (a checkpoint from before this option
        lacks them), drift/nll_change/SET."""
        original = self.reference.get("nll") or {}
        return {f"drift/nll/{name}": value for name, value in nll.items()} | {
            f"drift/nll_change/{name}": value - original[name] for name, value in nll.items() if name in original}

    # ---- hooks ------------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.at_train_start:
            if self.reference is None:  # still take the original outputs and NLLs before the first step
                runs, nll, _ = self._evaluate(trainer, pl_module, only_ar=True)
                self._keep_original(runs["ar"].outputs, nll)
            return
        metrics = self.measure(trainer, pl_module)
        if trainer.is_global_zero:  # pl_module.log is not allowed in on_train_start
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.validations += 1
        if self.validations % self.every_n_validations:
            return
        for name, value in self.measure(trainer, pl_module).items():
            # every rank computed the same figures from the gathered shares (the measurement's time: averaged)
            pl_module.log(name, value, sync_dist=True)

    # ---- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"reference": self.reference, "validations": self.validations,
                "history": [[step, dict(m)] for step, m in self.history]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.reference = state_dict.get("reference")
        self.validations = state_dict.get("validations", 0)
        self.history = [(step, m) for step, m in state_dict.get("history", [])]
