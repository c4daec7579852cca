"""``callbacks=speedup``: decoding speed and quality of the model being trained, measured while it trains.

At train start and after every validation run the callback decodes the same held-out prompts, one at a time, with
greedy AR (the baseline) and with every other decoder, and logs per decoder NAME ``speedup/NAME`` (tokens/s over AR's
in the same call), ``tokens_per_s/NAME``, ``mean_accepted/NAME`` (τ), ``exact_match/NAME`` (share of prompts whose
output is token-identical to the current greedy AR output: the lossless check) and, where the decoder reports them,
``fast_forward/NAME`` / ``stationary/NAME`` (Jacobi's CLLM Table 3 counts); plus ``tokens_per_s/ar``.

Quality: ``quality/agreement`` (share of prompts whose greedy AR output still equals the original model's, decoded
before the first training step and kept in the callback's state, so a resumed run compares with the original) and
``quality/token_agreement`` (mean common-prefix length / original length); ``quality/<metric>`` when the datamodule
names a task metric (``data.metric``), scoring the AR outputs against the dataset's answers.

Design: the callback asks the method module for its decoders (``MethodModule.decoders()``), so a method that trains
for a decoder (CLLM: Jacobi; Chimera, Hidden Transfer: their tree decoders) plugs in without changing this file;
``extra_decoders`` adds any registered decoder over the same model. From the datamodule it uses only
``eval_records(split, n)``, ``tokenizer`` and ``metric``.

Every rank decodes the same prompts (under ZeRO-3 every forward is collective); only rank zero writes to loggers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from lit_spec.data.metrics import score_answers
from lit_spec.decoding import DECODERS, DecodeStats, Decoder, new_tokens
from lit_spec.decoding.verify import greedy_accept_length
from lit_spec.errors import ConfigError

log = logging.getLogger(__name__)

# extras a decoder may return (key -> metric prefix), averaged over prompts
EXTRAS = {"fast_forward_count": "fast_forward", "stationary_count": "stationary"}


@dataclass
class _Run:
    """One decoder over all prompts: the new tokens of each (up to and including EOS), summed stats, extras."""
    outputs: list[list[int]] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)
    extras: list[dict] = field(default_factory=list)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


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
        model = pl_module.model
        decoders = {"ar": DECODERS["ar"](model), **getattr(pl_module, "decoders", dict)()}
        for name, params in self.extra_decoders.items():
            if name in decoders:
                raise ConfigError(f"callbacks.speedup.extra_decoders.{name}: the method already offers a decoder "
                                  f"named {name!r}; name the entry otherwise, with `method: {name}`")
            params = dict(params)
            decoders[name] = DECODERS[params.pop("method", name)](model, **params)
        self.decoders = decoders
        self._decode(decoders["ar"], self.records[:1], pl_module.device)  # warm-up, untimed

    # ---- measuring --------------------------------------------------------------------------------------------
    def _decode(self, decoder: Decoder, records: list[dict], device: torch.device) -> _Run:
        eos = self.tokenizer.eos_token_id
        run = _Run()
        for record in records:
            ids = torch.tensor([record["prompt_ids"]], device=device)
            out = decoder.generate(ids, max_new_tokens=self.max_new_tokens, eos_token_id=eos)
            run.outputs.append(new_tokens(out.sequences, ids.size(1), eos))
            run.stats = run.stats + out.stats
            run.extras.append(out.extras)
        return run

    @torch.no_grad()
    def _decode_all(self, trainer: L.Trainer, pl_module: L.LightningModule, only_ar: bool = False) -> dict:
        """Decode the prompts with every decoder, the module in eval mode (each submodule's mode restored after)."""
        self.tokenizer = trainer.datamodule.tokenizer
        modes = {m: m.training for m in pl_module.modules()}
        pl_module.eval()
        try:
            self._prepare(trainer, pl_module)
            return {name: self._decode(d, self.records, pl_module.device) for name, d in self.decoders.items()
                    if name == "ar" or not only_ar}
        finally:
            for m, training in modes.items():
                m.training = training

    def measure(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """Decode, compute the metrics, keep them in ``last_metrics`` and ``history``; logging is the hooks' job."""
        runs = self._decode_all(trainer, pl_module)
        metrics = self._speed(runs) | self._quality(runs["ar"].outputs, trainer.datamodule)
        self.last_metrics = metrics
        self.history.append((trainer.global_step, metrics))
        return metrics

    @staticmethod
    def _speed(runs: dict[str, _Run]) -> dict[str, float]:
        ar = runs["ar"]
        metrics = {"tokens_per_s/ar": ar.stats.tokens_per_s}
        for name, run in runs.items():
            if name == "ar":
                continue
            tps = run.stats.tokens_per_s
            metrics[f"speedup/{name}"] = tps / ar.stats.tokens_per_s if ar.stats.tokens_per_s else 0.0
            metrics[f"tokens_per_s/{name}"] = tps
            metrics[f"mean_accepted/{name}"] = run.stats.mean_accepted
            metrics[f"exact_match/{name}"] = _mean(o == a for o, a in zip(run.outputs, ar.outputs))
            for key, prefix in EXTRAS.items():
                values = [float(e[key]) for e in run.extras if key in e]
                if values:
                    metrics[f"{prefix}/{name}"] = _mean(values)
        return metrics

    def _keep_original(self, outputs: list[list[int]]) -> None:
        """The first outputs decoded: the model as it was before training (kept in the callback's state)."""
        if self.reference is None:
            self.reference = {"prompt_ids": [r["prompt_ids"] for r in self.records], "outputs": outputs}

    def _quality(self, outputs: list[list[int]], dm) -> dict[str, float]:
        prompts = [r["prompt_ids"] for r in self.records]
        self._keep_original(outputs)
        original = {tuple(p): o for p, o in zip(self.reference["prompt_ids"], self.reference["outputs"])}
        pairs = [(o, original[tuple(p)]) for p, o in zip(prompts, outputs) if tuple(p) in original]
        metrics = {}
        if pairs:
            metrics["quality/agreement"] = _mean(o == r for o, r in pairs)
            metrics["quality/token_agreement"] = _mean(greedy_accept_length(o, r) / max(len(r), 1) for o, r in pairs)
        name = getattr(dm, "metric", None)
        if name:
            metrics[f"quality/{name}"] = score_answers(name, outputs, [r["answer_ids"] for r in self.records],
                                                       self.tokenizer)
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
