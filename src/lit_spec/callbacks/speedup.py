"""``callbacks=speedup``: decoding speed and quality of the model being trained, measured while it trains.

At train start and after every validation run the callback decodes the same held-out prompts, one at a time, with
greedy AR (the baseline) and with every other decoder, and logs per decoder NAME ``speedup/NAME`` (tokens/s over AR's
in the same call), ``tokens_per_s/NAME``, ``mean_accepted/NAME`` (τ), ``exact_match/NAME`` (share of prompts whose
output is token-identical to the current greedy AR output: the lossless check) and, where the decoder reports them,
``fast_forward/NAME`` / ``stationary/NAME`` (Jacobi's CLLM Table 3 counts); plus ``tokens_per_s/ar``.

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

Every rank decodes the same prompts; only rank zero writes to loggers. Where the weights are sharded (ZeRO-3, FSDP2)
the decoders run on a plain copy of the module, refreshed from the gathered weights at every measurement (one submodule
gathered at a time): through DeepSpeed's per-module hooks every one-token forward costs ~6-15x more. The copy costs
the whole model's weights once more per rank; where that does not fit (``decode_copy=auto``: 80% of the free device
memory, or of this rank's share of the free RAM on CPU) the decoders run on the sharded model, collectively, as before.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from lit_spec.data.execution import describe_isolation
from lit_spec.data.metrics import EXECUTION_METRICS, score_answers
from lit_spec.decoding import DECODERS, Decoder
from lit_spec.drift import HELDOUT, answer_nll, check_drift_data, compare_answers, drift_records
from lit_spec.errors import ConfigError
from lit_spec.measure import EXTRAS, Run, build_decoders, compare, decode_prompts, eval_mode
from lit_spec.strategies import copy_whole, weights_sharded, whole_numel, whole_parameters

log = logging.getLogger(__name__)

PLOT = "speedup.png"     # in the run directory, beside csv/metrics.csv
UNPLOTTED = {"quality/first_divergence"}   # tokens, off the scale of the quality panel's shares


def copy_bytes(module: torch.nn.Module) -> int:
    """The decoding copy's stated bound: every weight of ``module`` whole, in its live dtype (buffers are small)."""
    return sum(whole_numel(p) * p.element_size() for p in module.parameters())


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
            (``false``), or the copy where it fits in memory (``auto``).
    """

    def __init__(self, num_prompts: int = 8, max_new_tokens: int = 64, split: str = "validation",
                 at_train_start: bool = True, every_n_validations: int = 1, extra_decoders: dict | None = None,
                 drift_data: dict | None = None, decode_copy: bool | str = "auto"):
        self.num_prompts, self.max_new_tokens, self.split = num_prompts, max_new_tokens, split
        self.at_train_start, self.every_n_validations = at_train_start, every_n_validations
        if isinstance(extra_decoders, DictConfig):
            extra_decoders = OmegaConf.to_container(extra_decoders, resolve=True)
        self.extra_decoders = {name: dict(params or {}) for name, params in (extra_decoders or {}).items()}
        self.drift_data, self.decode_copy = drift_data, decode_copy
        self.copy: L.LightningModule | None = None   # the plain copy the decoders run on (sharded weights only)
        self.records: list[dict] | None = None
        self.answer_sets: dict[str, list[dict]] = {}    # set name -> records whose answers' NLL is logged
        self.tokenizer = None
        self.decoders: dict[str, Decoder] | None = None
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
        if self.decode_copy not in (True, False, "auto"):
            raise ConfigError(f"callbacks.speedup.decode_copy={self.decode_copy!r}: true, false or auto")

    def _copy_fits(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        """Whether a whole copy of the module's weights fits in 80% of this rank's free memory."""
        need = copy_bytes(pl_module)
        if pl_module.device.type == "cuda":
            free = torch.cuda.mem_get_info(pl_module.device)[0]
        else:   # the ranks of a node share its RAM
            import psutil

            free = psutil.virtual_memory().available // max(1, trainer.num_devices)
        return need <= 0.8 * free

    def _decoding_module(self, trainer: L.Trainer, pl_module: L.LightningModule) -> L.LightningModule:
        """The module the decoders run on, its weights those of ``pl_module`` now: a plain copy where the weights
        are sharded (built at first use, then only what trains is copied again), else ``pl_module`` itself."""
        if self.copy is None and weights_sharded(trainer.strategy) and (
                self.decode_copy is True or (self.decode_copy == "auto" and self._copy_fits(trainer, pl_module))):
            copy = type(pl_module)(**pl_module.hparams)     # as load_from_checkpoint builds it: no trainer, no hooks
            copy.policy = pl_module.policy                   # built in the live weights' dtypes
            copy.build_models()
            copy_whole(pl_module, copy.to(pl_module.device))
            self.copy = copy.eval()
            log.info("speedup callback: decoding a plain copy of the sharded model (decode_copy=%s)", self.decode_copy)
        elif self.copy is not None:
            copy_whole(pl_module, self.copy, only_trained=True)
        return self.copy or pl_module

    def _prepare(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """At first use (the model exists only after ``configure_model``): prompts, decoders, one warm-up decode."""
        if self.decoders is not None:
            return
        if weights_sharded(trainer.strategy) and self.copy is None:
            log.info("speedup callback: decoding the sharded model collectively (decode_copy=%s)", self.decode_copy)
        dm = trainer.datamodule
        for split in dict.fromkeys([self.split, "test", "train"]):
            self.records = dm.eval_records(split, self.num_prompts)
            if self.records:
                break
            log.info("speedup callback: split %r has no records, trying the next", split)
        if not self.records:
            raise ConfigError("callbacks.speedup: the datamodule has no records to decode")
        decoders = {"ar": DECODERS["ar"](pl_module.model), **getattr(pl_module, "decoders", dict)()}
        clash = sorted(set(decoders) & set(self.extra_decoders))
        if clash:
            raise ConfigError(f"callbacks.speedup.extra_decoders.{clash[0]}: the method already offers a decoder "
                              f"named {clash[0]!r}; name the entry otherwise, with `method: {clash[0]}`")
        self.decoders = decoders | build_decoders(pl_module.model, self.extra_decoders)
        self.answer_sets = {HELDOUT: self.records} | {
            name: drift_records(data, dm.tokenizer) for name, data in self.drift_data.items()}
        log.info("speedup callback: answer NLL of %s", ", ".join(f"{n} ({len(r)} records)"
                                                                for n, r in self.answer_sets.items()))
        if getattr(dm, "metric", None) in EXECUTION_METRICS:
            log.info("speedup callback: %s runs the answers isolated by %s", dm.metric, describe_isolation())
        self._decode({"ar": decoders["ar"]}, self.records[:1], pl_module.device)  # warm-up, untimed

    # ---- measuring --------------------------------------------------------------------------------------------
    def _decode(self, decoders: dict[str, Decoder], records: list[dict], device: torch.device) -> dict[str, Run]:
        prompts = [torch.tensor([r["prompt_ids"]], device=device) for r in records]
        return decode_prompts(decoders, prompts, self.max_new_tokens, self.tokenizer.eos_token_id)

    @torch.no_grad()
    def _evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule,
                  only_ar: bool = False) -> tuple[dict[str, Run], dict[str, float]]:
        """Decode the prompts with every decoder (AR only: ``only_ar``) and score every answer set's NLL, the
        module in eval mode (each submodule's mode restored after)."""
        self.tokenizer = trainer.datamodule.tokenizer
        module = self._decoding_module(trainer, pl_module)
        # the sharded model itself: every rank uses it whole, every forward collective
        with eval_mode(module), whole_parameters(module) if module is pl_module else nullcontext():
            self._prepare(trainer, module)
            decoders = {"ar": self.decoders["ar"]} if only_ar else self.decoders
            runs = self._decode(decoders, self.records, module.device)
            nll = {name: answer_nll(module.model, records, module.device) for name, records in self.answer_sets.items()}
        return runs, nll

    def measure(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """Decode, compute the metrics, keep them in ``last_metrics`` and ``history``; logging is the hooks' job."""
        started = time.perf_counter()
        runs, nll = self._evaluate(trainer, pl_module)
        self._keep_original(runs["ar"].outputs, nll)
        metrics = self._speed(runs) | self._quality(runs, trainer.datamodule) | self._drift(nll)
        metrics["time/measure_s"] = time.perf_counter() - started    # the whole measurement: copy, decodes, NLLs
        self.last_metrics = metrics
        self.history.append((trainer.global_step, metrics))
        if trainer.is_global_zero:
            plot_history(self.history, Path(trainer.default_root_dir) / PLOT)
        return metrics

    @staticmethod
    def _speed(runs: dict[str, Run]) -> dict[str, float]:
        """Logged per decoder NAME: speedup/NAME, tokens_per_s/NAME, mean_accepted/NAME, exact_match/NAME and the
        decoder's extras (fast_forward/NAME, ...); AR's tokens/s."""
        keys = ("speedup", "tokens_per_s", "mean_accepted", "exact_match", *EXTRAS.values())
        return {"tokens_per_s/ar": runs["ar"].stats.tokens_per_s} | {
            f"{key}/{name}": float(m[key] or 0.0) for name, m in compare(runs).items() if name != "ar"
            for key in keys if key in m}

    def _keep_original(self, outputs: list[list[int]], nll: dict[str, float]) -> None:
        """The first outputs and answer NLLs measured: the model as it was before training (kept in the state)."""
        if self.reference is None:
            self.reference = {"prompt_ids": [r["prompt_ids"] for r in self.records], "outputs": outputs, "nll": nll}

    def _quality(self, runs: dict[str, Run], dm) -> dict[str, float]:
        outputs, prompts = runs["ar"].outputs, [r["prompt_ids"] for r in self.records]
        original = {tuple(p): o for p, o in zip(self.reference["prompt_ids"], self.reference["outputs"])}
        pairs = [(o, original[tuple(p)]) for p, o in zip(prompts, outputs) if tuple(p) in original]
        metrics = {f"quality/{key}": value for key, value in
                   compare_answers([o for o, _ in pairs], [r for _, r in pairs]).items() if value is not None}
        name = getattr(dm, "metric", None)
        if name:   # AR's answers, and every other decoder's (a lossless one scores what AR scores)
            for decoder, run in runs.items():
                key = f"quality/{name}" + ("" if decoder == "ar" else f"/{decoder}")
                metrics[key] = score_answers(name, run.outputs, self.records, self.tokenizer)
        return metrics

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
                runs, nll = self._evaluate(trainer, pl_module, only_ar=True)
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
            # every rank measured the same prompts: τ and exact are equal, the times are averaged over the ranks
            pl_module.log(name, value, sync_dist=True)

    # ---- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"reference": self.reference, "validations": self.validations,
                "history": [[step, dict(m)] for step, m in self.history]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.reference = state_dict.get("reference")
        self.validations = state_dict.get("validations", 0)
        self.history = [(step, m) for step, m in state_dict.get("history", [])]
