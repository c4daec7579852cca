"""experiments/sweep_report.py on a hand-made multirun directory: the table holds each job's swept values and final
figures, the plot is written, a directory without jobs is a clear error."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import yaml

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "sweep_report.py"


def _script():
    spec = importlib.util.spec_from_file_location("sweep_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _job(root: Path, name: str, overrides: list[str], metrics: dict, curve: list[tuple[int, float]]) -> None:
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job / "metrics.json").write_text(json.dumps(metrics))
    (job / "csv").mkdir()
    rows = ["step,mean_accepted/jacobi,train/loss"] + [f"{s},{t}," for s, t in curve] + ["5,,1.5"]
    (job / "csv" / "metrics.csv").write_text("\n".join(rows) + "\n")


def test_table_and_plot_of_a_sweep(tmp_path, capsys):
    for i, (n, w, tau) in enumerate([(8, 1, 1.5), (16, 1, 2.25), (8, 10, 1.25)]):
        _job(tmp_path, str(i), [f"method.n_tokens={n}", f"method.ar_weight={w}", "trainer.max_steps=10"],
             {"speedup/jacobi": tau / 1.25, "mean_accepted/jacobi": tau, "quality/agreement": 0.5, "global_step": 10,
              "drift/nll_change/humaneval": 0.25 * i, "quality/first_divergence": 7.0},
             [(0, 1.0), (10, tau)])
    report = _script()
    jobs = report.load_jobs(tmp_path)
    assert [j["tau_curve"] for j in jobs][1] == [(0, 1.0), (10, 2.25)]
    assert report.swept_keys(jobs) == ["method.ar_weight", "method.n_tokens"]  # max_steps is the same everywhere
    assert report.main([str(tmp_path)]) == 0
    table = (tmp_path / "sweep.md").read_text().splitlines()
    assert table[0].startswith("| job | method.ar_weight | method.n_tokens | Jacobi speedup | τ (tokens/forward) | "
                               "HumanEval NLL change | greedy answers unchanged | first divergence (median, tokens)")
    assert table[3] == "| 1 | 1 | 16 | 1.8 | 2.25 | 0.25 | 0.5 | 7 | 10 |"
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    assert "sweep.md" in capsys.readouterr().out


def test_a_directory_without_jobs_is_an_error(tmp_path, capsys):
    assert _script().main([str(tmp_path)]) == 2
    assert "no Hydra job directories" in capsys.readouterr().err
