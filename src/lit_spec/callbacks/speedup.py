"""``callbacks=speedup``: decoding speed and quality of the model being trained, measured while it trains.

At train start and after every validation run the callback decodes the same held-out prompts, one at a time, with
greedy AR (the baseline) and with every other decoder, and logs per decoder NAME ``speedup/NAME`` (tokens/s over AR's
in the same call), ``tokens_per_s/NAME``, ``mean_accepted/NAME`` (τ), ``exact_match/NAME`` (share of prompts whose
output is token-identical to the current greedy AR output: the lossless check) and, where the decoder reports them,
``fast_forward/NAME`` / ``stationary/NAME`` (Jacobi's CLLM Table 3 counts); plus ``tokens_per_s/ar``.

Quality: ``quality/agreement`` (share of prompts whose greedy AR output still equals the original model's, decoded
before the first training step and kept in the callback's state, so a resumed run compares with the original) and
``quality/token_agreement`` (mean common-prefix length / original length); ``quality/<metric>`` when the datamodule
names a task metric (``data.metric``), scoring the AR outputs against the dataset's answers (or by execution:
``pass_at_1``), and ``quality/<metric>/NAME`` for every other decoder's outputs.

Design: the callback asks the method module for its decoders (``MethodModule.decoders()``), so a method that trains
for a decoder (CLLM: Jacobi; Chimera, Hidden Transfer: their tree decoders) plugs in without changing this file;
``extra_decoders`` adds any registered decoder over the same model. From the datamodule it uses only
``eval_records(split, n)``, ``tokenizer`` and ``metric``.

Every rank decodes the same prompts (under ZeRO-3 every forward is collective); only rank zero writes to loggers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from lit_spec.data.execution import describe_isolation
from lit_spec.data.metrics import EXECUTION_METRICS, score_answers
from lit_spec.decoding import DECODERS, Decoder
from lit_spec.decoding.verify import greedy_accept_length
from lit_spec.errors import ConfigError
from lit_spec.measure import EXTRAS, Run, build_decoders, compare, decode_prompts, mean
from lit_spec.strategies import whole_parameters

log = logging.getLogger(__name__)

PLOT = "speedup.png"     # in the run directory, beside csv/metrics.csv


def plot_history(history: list[tuple[int, dict[str, float]]], path: Path) -> None:
    """τ, speedup over AR and quality of every measurement, against the training step (written after each one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [step for step, _ in history]
    panels = [("mean_accepted/", "τ (tokens per forward)"), ("speedup/", "speedup over AR (tokens/s)"),
              ("quality/", "quality")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (prefix, title) in zip(axes, panels):
        names = sorted({k for _, m in history for k in m if k.startswith(prefix) and k.count("/") == 1})
        for name in names:
            ax.plot(steps, [m.get(name, float("nan")) for _, m in history], marker="o", label=name.split("/", 1)[1])
        if prefix == "speedup/":
            ax.axhline(1.0, color="k", lw=0.8)
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
    """

    def __init__(self, num_prompts: int = 8, max_new_tokens: int = 64, split: str = "validation",
                 at_train_start: bool = True, every_n_validations: int = 1, extra_decoders: dict | None = None):
        self.num_prompts, self.max_new_tokens, self.split = num_prompts, max_new_tokens, split
        self.at_train_start, self.every_n_validations = at_train_start, every_n_validations
        if isinstance(extra_decoders, DictConfig):
            extra_decoders = OmegaConf.to_container(extra_decoders, resolve=True)
        self.extra_decoders = {name: dict(params or {}) for name, params in (extra_decoders or {}).items()}
        self.records: list[dict] | None = None
        self.tokenizer = None
        self.decoders: dict[str, Decoder] | None = None
        self.reference: dict | None = None   # {"prompt_ids", "outputs"}: the original model's greedy AR outputs
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

    def _prepare(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """At first use (the model exists only after ``configure_model``): prompts, decoders, one warm-up decode."""
        if self.decoders is not None:
            return
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
        if getattr(dm, "metric", None) in EXECUTION_METRICS:
            log.info("speedup callback: %s runs the answers isolated by %s", dm.metric, describe_isolation())
        self._decode({"ar": decoders["ar"]}, self.records[:1], pl_module.device)  # warm-up, untimed

    # ---- measuring --------------------------------------------------------------------------------------------
    def _decode(self, decoders: dict[str, Decoder], records: list[dict], device: torch.device) -> dict[str, Run]:
        prompts = [torch.tensor([r["prompt_ids"]], device=device) for r in records]
        return decode_prompts(decoders, prompts, self.max_new_tokens, self.tokenizer.eos_token_id)

    @torch.no_grad()
    def _decode_all(self, trainer: L.Trainer, pl_module: L.LightningModule, only_ar: bool = False) -> dict:
        """Decode the prompts with every decoder, the module in eval mode (each submodule's mode restored after)."""
        self.tokenizer = trainer.datamodule.tokenizer
        modes = {m: m.training for m in pl_module.modules()}
        pl_module.eval()
        try:
            with whole_parameters(pl_module):   # ZeRO-3, FSDP: every rank decodes with the whole model
                self._prepare(trainer, pl_module)
                decoders = {"ar": self.decoders["ar"]} if only_ar else self.decoders
                return self._decode(decoders, self.records, pl_module.device)
        finally:
            for m, training in modes.items():
                m.training = training

    def measure(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """Decode, compute the metrics, keep them in ``last_metrics`` and ``history``; logging is the hooks' job."""
        runs = self._decode_all(trainer, pl_module)
        metrics = self._speed(runs) | self._quality(runs, trainer.datamodule)
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

    def _keep_original(self, outputs: list[list[int]]) -> None:
        """The first outputs decoded: the model as it was before training (kept in the callback's state)."""
        if self.reference is None:
            self.reference = {"prompt_ids": [r["prompt_ids"] for r in self.records], "outputs": outputs}

    def _quality(self, runs: dict[str, Run], dm) -> dict[str, float]:
        outputs, prompts = runs["ar"].outputs, [r["prompt_ids"] for r in self.records]
        self._keep_original(outputs)
        original = {tuple(p): o for p, o in zip(self.reference["prompt_ids"], self.reference["outputs"])}
        pairs = [(o, original[tuple(p)]) for p, o in zip(prompts, outputs) if tuple(p) in original]
        metrics = {}
        if pairs:
            metrics["quality/agreement"] = mean(o == r for o, r in pairs)
            metrics["quality/token_agreement"] = mean(greedy_accept_length(o, r) / max(len(r), 1) for o, r in pairs)
        name = getattr(dm, "metric", None)
        if name:   # AR's answers, and every other decoder's (a lossless one scores what AR scores)
            for decoder, run in runs.items():
                key = f"quality/{name}" + ("" if decoder == "ar" else f"/{decoder}")
                metrics[key] = score_answers(name, run.outputs, self.records, self.tokenizer)
        return metrics

    # ---- hooks ------------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.at_train_start:
            if self.reference is None:  # still take the original outputs before the first step
                self._keep_original(self._decode_all(trainer, pl_module, only_ar=True)["ar"].outputs)
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
            # every rank logs its own (identical) value: no collective sync, so monitors see it on every rank
            pl_module.log(name, value, sync_dist=False, rank_zero_only=True)

    # ---- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"reference": self.reference, "validations": self.validations,
                "history": [[step, dict(m)] for step, m in self.history]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.reference = state_dict.get("reference")
        self.validations = state_dict.get("validations", 0)
        self.history = [(step, m) for step, m in state_dict.get("history", [])]
