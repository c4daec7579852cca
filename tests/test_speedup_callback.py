"""``callbacks=speedup`` on the micro model: what it logs, where decoders come from, its state, its errors."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import MICRO_RUN, make_config

from lit_spec.callbacks import SpeedupCallback
from lit_spec.callbacks.decoding_copy import DecodingCopy
from lit_spec.data.metrics import METRICS, exact_match, gsm8k_answer, token_f1
from lit_spec.decoding.jacobi import JacobiDecoder
from lit_spec.drift import answer_nll
from lit_spec.errors import ConfigError
from lit_spec.methods import ARModule
from lit_spec.strategies import FSDPStrategy
from lit_spec.training import run_training

SPEEDUP = ["callbacks=speedup", "callbacks.speedup.num_prompts=2", "callbacks.speedup.max_new_tokens=8"]


class JacobiAR(ARModule):
    """An AR module that offers a Jacobi decoder, as CLLM's will (built from the config: ``method._target_=...``)."""

    def decoders(self, **sampling):
        return {} if sampling else {"jacobi": JacobiDecoder(self.model, n_tokens=4)}


class Grab(L.Callback):
    """Keeps the run's SpeedupCallback, whether the trained part was in train mode at every training step, and the
    answer sets' NLL measured here, apart from the callback: before the first step and after the last."""

    found: SpeedupCallback | None = None
    modes: list[bool] = []
    callback_metrics: set[str] = set()
    initial_nll: dict[str, float] = {}
    final_nll: dict[str, float] = {}

    @staticmethod
    def _nll(trainer, pl_module) -> dict[str, float]:
        Grab.found = next(c for c in trainer.callbacks if isinstance(c, SpeedupCallback))
        return {name: answer_nll(pl_module.model, records, pl_module.device)
                for name, records in Grab.found.answer_sets.items()}

    def on_train_start(self, trainer, pl_module):     # after the speedup callback's: its answer sets exist
        Grab.initial_nll = self._nll(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        Grab.modes.append(getattr(pl_module, pl_module.exported).training)

    def on_train_end(self, trainer, pl_module):
        Grab.callback_metrics = set(trainer.callback_metrics)
        Grab.final_nll = self._nll(trainer, pl_module)


def _run(output_dir: Path, *overrides: str) -> SpeedupCallback:
    Grab.found, Grab.modes = None, []
    run_training(make_config(output_dir, [*MICRO_RUN, *SPEEDUP, "+callbacks.grab._target_=test_speedup_callback.Grab",
                                          *overrides]))
    assert Grab.modes and all(Grab.modes), "the module is back in train mode after every measurement"
    return Grab.found


def _csv_rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """8 steps, validation every 4: measured at train start and after both validations."""
    run = tmp_path_factory.mktemp("speedup") / "run"
    callback = _run(run, "method._target_=test_speedup_callback.JacobiAR", "data.metric=exact_match",
                    "callbacks.model_checkpoint.monitor=speedup/jacobi", "callbacks.model_checkpoint.mode=max",
                    "callbacks.model_checkpoint.every_n_train_steps=null",   # kept at each validation
                    "callbacks.speedup.extra_decoders={lookahead: {window: 3, ngram: 3, guesses: 3}}")
    return run, callback, dict(Grab.initial_nll), dict(Grab.final_nll)


def test_metrics_at_train_start_and_after_each_validation(trained):
    run, callback, initial, final = trained
    assert [step for step, _ in callback.history] == [0, 4, 8]
    first = callback.history[0][1]
    for name in ("jacobi", "lookahead"):  # one from the method, one from extra_decoders
        for prefix in ("speedup", "tokens_per_s", "mean_accepted", "exact_match"):
            assert all(f"{prefix}/{name}" in m for _, m in callback.history), (prefix, name)
        assert all(m[f"exact_match/{name}"] == 1.0 for _, m in callback.history), "greedy decoders are lossless"
    assert all("fast_forward/jacobi" in m and "stationary/jacobi" in m for _, m in callback.history)
    assert "fast_forward/lookahead" not in first  # only decoders whose extras carry the counts
    assert first["mean_accepted/jacobi"] >= 1.0
    assert first["quality/agreement"] == 1.0 and first["quality/token_agreement"] == 1.0
    assert first["quality/exact_match/jacobi"] == first["quality/exact_match"]   # lossless: the same answers

    # drift: the answer NLL of the held-out records and of HumanEval (drift_data's default), against the original
    assert len(callback.answer_sets["humaneval"]) > 100 and callback.answer_sets["heldout"] == callback.records
    assert first["drift/nll_change/heldout"] == 0.0 and first["drift/nll_change/humaneval"] == 0.0
    assert callback.reference["nll"] == pytest.approx(initial)          # the original's, as the test measured it
    last = callback.history[-1][1]
    for name in ("heldout", "humaneval"):
        assert first[f"drift/nll/{name}"] == pytest.approx(initial[name])
        assert last[f"drift/nll/{name}"] == pytest.approx(final[name])   # the trained model's, measured
        assert last[f"drift/nll_change/{name}"] == pytest.approx(final[name] - initial[name])
    assert last["drift/nll_change/heldout"] < 0, "trained on the same kind of code, its held-out answers got likelier"
    for _, m in callback.history:   # the first divergence is logged once a greedy output changed
        assert ("quality/first_divergence" in m) == (m["quality/agreement"] < 1.0)
        if "quality/first_divergence" in m:
            assert 0 <= m["quality/first_divergence"] < 8     # max_new_tokens

    # written to the CSV logger: at train start (no pl_module.log there) and after each validation
    rows = [r for r in _csv_rows(run) if "speedup/jacobi" in r]
    assert len(rows) == 3 and rows[0]["step"] == 0
    assert rows[-1]["speedup/jacobi"] == pytest.approx(last["speedup/jacobi"], rel=1e-6)
    assert rows[0]["quality/agreement"] == 1.0 and rows[-1]["exact_match/jacobi"] == 1.0
    assert rows[0]["drift/nll_change/humaneval"] == 0.0
    assert rows[-1]["drift/nll/heldout"] == pytest.approx(last["drift/nll/heldout"])   # float32 in the CSV
    # pl_module.log made them callback metrics: a checkpoint can monitor speedup/jacobi
    assert {"speedup/jacobi", "quality/agreement"} <= Grab.callback_metrics
    # monitored at each validation (not at train start): the kept checkpoint is the step with the best speedup
    best_step = max(callback.history[1:], key=lambda h: h[1]["speedup/jacobi"])[0]
    assert [p.name for p in (run / "checkpoints").glob("step*.ckpt")] == [f"step{best_step:06d}.ckpt"]


def test_summary_shows_the_answer_nll_drift(trained):
    from lit_spec.console import _figures

    _, callback, *_ = trained
    (_, first), (_, last) = callback.history[0], callback.history[-1]
    lines = _figures(first, last, prompts=2)
    (drift,) = [line for line in lines if line.startswith("  answer NLL: ")]
    original, now = callback.reference["nll"]["humaneval"], last["drift/nll/humaneval"]
    assert f"humaneval {original:.3f} → {now:.3f} ({now - original:+.3f})" in drift and "heldout " in drift


def test_the_verdict_names_the_trade():
    from lit_spec.console import verdict

    kept = {"speedup/jacobi": 1.6, "quality/agreement": 0.75, "drift/nll_change/humaneval": 0.2}
    assert verdict(kept, 16) == "faster, answers unchanged on 12/16 (NLL +0.2)"
    drifted = dict(kept, **{"quality/agreement": 0.0, "drift/nll_change/heldout": 4.6})
    assert verdict(drifted, 16) == "faster, but answers changed on 16/16 (NLL +4.6): the model drifted"
    sharpened = dict(kept, **{"drift/nll_change/humaneval": 0.9})     # answers kept, but the model is another one
    assert verdict(sharpened, 16).endswith("the model drifted")
    assert verdict({"speedup/jacobi": 0.8}, 16) == "not faster than AR" and verdict({}, 16) is None


def test_state_round_trip_keeps_the_original_outputs(trained, tmp_path):
    _, callback, *_ = trained
    torch.save(callback.state_dict(), tmp_path / "state.pt")
    restored = SpeedupCallback()
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))  # as checkpoints are loaded
    assert restored.reference == callback.reference and restored.history == callback.history
    assert len(callback.reference["outputs"]) == 2 and all(callback.reference["outputs"])
    assert set(restored.reference["nll"]) == {"heldout", "humaneval"}      # the original model's answer NLLs


def test_resumed_run_compares_with_the_original_model(trained, tmp_path):
    run, first, initial, _ = trained
    last = run / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True, map_location="cpu")
    (saved,) = [s for k, s in ckpt["callbacks"].items() if "SpeedupCallback" in k]
    step = ckpt["global_step"]   # last.ckpt is the last checkpoint kept: the validation with the best speedup's
    assert step in (4, 8) and saved["reference"] == first.reference

    # plain AR method: its decoders come from extra_decoders; at_train_start=false decodes nothing new at start
    resumed = _run(tmp_path / "resumed", f"ckpt_path={last}", "trainer.max_steps=14", "trainer.val_check_interval=2",
                   "callbacks.speedup.at_train_start=false", "callbacks.speedup.every_n_validations=2",
                   "callbacks.speedup.extra_decoders={jacobi: {n_tokens: 4}}")
    assert resumed.reference == first.reference, "the reference is the original model's, not the resumed one's"
    # the validations after it (every 2 steps, to 14) continue the saved count; every second one is measured
    measured = [s for i, s in enumerate(range(step + 2, 15, 2)) if (saved["validations"] + i + 1) % 2 == 0]
    assert [s for s, _ in resumed.history] == [s for s, _ in saved["history"]] + measured
    assert resumed.last_metrics["exact_match/jacobi"] == 1.0 and "quality/agreement" in resumed.last_metrics
    # against the original model (the test measured it before the first run's first step), not the resumed one
    assert resumed.last_metrics["drift/nll_change/humaneval"] == pytest.approx(
        resumed.last_metrics["drift/nll/humaneval"] - initial["humaneval"])


@pytest.mark.parametrize("engine", ["static", pytest.param("compiled", marks=pytest.mark.slow)])
def test_the_fast_engine_measures_what_eager_measures_as_the_model_trains(trained, engine, tmp_path):
    """``callbacks.speedup.engine``: the same run on the fast path takes the same steps at every measurement, before
    and after the weights move (a compiled forward reads the trained weights, not those it was compiled with), and
    keeps every decoder lossless; compiling is timed apart."""
    _, eager, _, _ = trained
    callback = _run(tmp_path / "run", "method._target_=test_speedup_callback.JacobiAR",
                    "data.metric=exact_match", "callbacks.speedup.drift_data=null",
                    "callbacks.speedup.extra_decoders={lookahead: {window: 3, ngram: 3, guesses: 3}}",
                    f"callbacks.speedup.engine={engine}")
    same = ("mean_accepted/jacobi", "mean_accepted/lookahead", "exact_match/jacobi", "exact_match/lookahead",
            "quality/agreement", "quality/exact_match")
    assert [(step, {k: m[k] for k in same}) for step, m in callback.history] == [
        (step, {k: m[k] for k in same}) for step, m in eager.history]
    assert callback.history[1][1]["quality/agreement"] < 1.0, "the weights moved between measurements"
    compiled = [m.get("time/compile_s") for _, m in callback.history]
    assert compiled[0] > 0 and compiled[-1] == 0.0 if engine == "compiled" else compiled == [None] * 3


def test_sampled_measurements_beside_the_greedy_ones(trained, tmp_path):
    """``callbacks.speedup.temperatures=[0,1]``: AR and every decoder that samples decode again at T = 1 (lookahead,
    losslessly), logged as NAME@T1 against sampled AR, without exact match; the greedy-only Jacobi decoder is not;
    the greedy figures are those of a greedy-only run."""
    _, greedy, _, _ = trained
    callback = _run(tmp_path / "run", "method._target_=test_speedup_callback.JacobiAR", "data.metric=exact_match",
                    "callbacks.speedup.drift_data=null", "callbacks.speedup.temperatures=[0,1]",
                    "callbacks.speedup.extra_decoders={lookahead: {window: 3, ngram: 3, guesses: 3}}")
    same = ("mean_accepted/jacobi", "mean_accepted/lookahead", "exact_match/lookahead", "quality/agreement")
    for (step, m), (_, g) in zip(callback.history, greedy.history):
        assert {k: m[k] for k in same} == {k: g[k] for k in same}, step
        assert m["tokens_per_s/ar@T1"] > 0 and m["mean_accepted/lookahead@T1"] >= 1.0
        assert m["speedup/lookahead@T1"] == pytest.approx(m["tokens_per_s/lookahead@T1"] / m["tokens_per_s/ar@T1"])
        assert "quality/exact_match/lookahead@T1" in m
        assert not any(k.endswith("jacobi@T1") or k.startswith("exact_match/") and k.endswith("@T1") for k in m)


def test_original_nll_is_measured_before_the_first_step_without_a_measurement_there(tmp_path):
    """at_train_start=false still takes the original's outputs and NLL before the first step; drift_data=null: the
    held-out answers only."""
    callback = _run(tmp_path / "run", "callbacks.speedup.at_train_start=false", "callbacks.speedup.drift_data=null")
    assert [step for step, _ in callback.history] == [4, 8] and set(callback.reference["nll"]) == {"heldout"}
    last = callback.history[-1][1]
    assert {k for k in last if k.startswith("drift/")} == {"drift/nll/heldout", "drift/nll_change/heldout"}
    assert last["drift/nll_change/heldout"] == pytest.approx(Grab.final_nll["heldout"] - Grab.initial_nll["heldout"])
    assert last["drift/nll_change/heldout"] < 0


def test_unknown_extra_decoder_fails_before_training(tmp_path):
    cfg = make_config(tmp_path / "run", [*MICRO_RUN, *SPEEDUP, "callbacks.speedup.extra_decoders={nope: {}}"])
    with pytest.raises(ConfigError, match="unknown decoder 'nope'"):
        run_training(cfg)
    assert not (tmp_path / "run" / "export").exists()
    cfg = make_config(tmp_path / "run2", [*MICRO_RUN, *SPEEDUP, "callbacks.speedup.num_prompts=0"])
    with pytest.raises(ConfigError, match="num_prompts=0"):
        run_training(cfg)
    with pytest.raises(ConfigError, match="callbacks.speedup.engine='fast': choose one of"):
        run_training(make_config(tmp_path / "run4", [*MICRO_RUN, *SPEEDUP, "callbacks.speedup.engine=fast"]))
    # sharded weights: a new copy decoded at every measurement, so no fast path (refused before the process group)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=FSDPStrategy(), logger=False)
    with pytest.raises(ConfigError, match="engine=compiled: under FSDPStrategy .* use engine=eager"):
        SpeedupCallback(engine="compiled").setup(trainer, None, "fit")     # its checks read no module
    for temperatures in ([0.7], [0, -1], 0.7):
        with pytest.raises(ConfigError, match="callbacks.speedup.temperatures=.*includes 0"):
            SpeedupCallback(temperatures=temperatures).setup(trainer, None, "fit")
    cfg = make_config(tmp_path / "run3", [*MICRO_RUN, *SPEEDUP, "+callbacks.speedup.drift_data.code=humaneal"])
    with pytest.raises(ConfigError, match="callbacks.speedup.drift_data.code='humaneal': no data config of that "
                                          "name; choose one of .*'humaneval'"):
        run_training(cfg)
    assert not (tmp_path / "run3" / "export").exists()


def test_unknown_data_metric_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="data.metric='bleu'.*exact_match"):
        run_training(make_config(tmp_path / "run", [*MICRO_RUN, "data.metric=bleu"]))


def test_gsm8k_answer():
    assert gsm8k_answer("so she pays 1,000 dollars in all.", "... #### 1000") == 1.0
    assert gsm8k_answer("#### -3.50\nThe end: 7", "it drops 3.5 degrees #### -3.5") == 1.0  # '####' wins
    assert gsm8k_answer("first 2, then 12.", "#### 12") == 1.0  # else the last number
    assert gsm8k_answer("0.5", "#### 0.50") == 1.0  # compared as numbers
    assert gsm8k_answer("12", "#### 13") == 0.0
    assert gsm8k_answer("no number here", "#### 4") == 0.0
    assert gsm8k_answer("4", "no number either") == 0.0


def test_exact_match_and_registry():
    assert exact_match("  SELECT *\n FROM t ", "SELECT * FROM t") == 1.0
    assert exact_match("SELECT * FROM t", "select * from t") == 0.0
    assert set(METRICS) == {"gsm8k_answer", "exact_match", "token_f1", "rouge1"}


def test_token_f1():
    assert token_f1("return self.x", "return  self.x") == 1.0
    # prediction tokens: return, x, (, ) -> 2 shared with return, self, ., x: P = 2/4, R = 2/4
    assert token_f1("return x()", "return self.x") == pytest.approx(0.5)
    assert token_f1("a a b", "a") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))  # multiset: one 'a' matches
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0 and token_f1("x", "y") == 0.0


def test_a_bf16_base_beside_fp32_heads_is_measured_under_bf16_mixed(tmp_path):
    """bf16-mixed keeps the trained heads in fp32 beside a bf16 frozen base (a paper experiment's model.dtype):
    training runs under autocast, and so must the callback's decoding and NLLs, or fp32 heads meet bf16 states."""
    callback = _run(tmp_path / "run", "method=medusa", "model.dtype=bfloat16", "trainer.precision=bf16-mixed",
                    "callbacks.speedup.drift_data=null")
    assert [step for step, _ in callback.history] == [0, 4, 8]
    assert all(m["mean_accepted/medusa"] >= 1.0 for _, m in callback.history)


class _Part(L.LightningModule):
    exported, policy = "model", None

    def __init__(self, width: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.model = torch.nn.Linear(width, width)


def test_the_decoding_copy_is_on_the_device_its_module_is_on():
    """The copy is built and filled on the module's device; the callback puts the prompts on the copy's ``device``,
    which once said cpu beside a module on a GPU (an index_select across devices on the H200). The meta device stands
    in for the GPU here."""
    module = _Part().to("meta")
    clone = DecodingCopy(True).build(module)
    assert clone.device == module.device == torch.device("meta")
    assert next(clone.model.parameters()).device == clone.device
