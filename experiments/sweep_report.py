"""Gather a Hydra multirun directory into a table and a plot (the shape of CLLM's Table 6 / Figure 3), and the
τ–drift frontier: how fast each recipe made the model against how far it moved it.

    python experiments/sweep_report.py logs/train/multiruns/<date>            # writes sweep.md, sweep.png there
    python experiments/sweep_report.py SWEEP_DIR OTHER_SWEEP_DIR ...          # several sweeps as one (in the first)

Each job directory holds ``.hydra/overrides.yaml`` (what the sweep set), ``metrics.json`` (final metrics, written
when training ends) and ``csv/metrics.csv`` (every logged value, with its step). The swept parameters are the
overrides whose values differ between jobs; the table has one row per job with the speedup callback's final figures
(τ of every decoder measured, and the drift: answer-NLL changes, greedy answers unchanged, median first divergence).
The plot shows τ against the HumanEval answer-NLL change (the frontier: up and left is better), speedup and answers
unchanged against the first swept parameter, and τ against training steps.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import yaml

COLUMNS = {  # metric key -> table header
    "speedup/jacobi": "Jacobi speedup",
    "mean_accepted/jacobi": "τ (tokens/forward)",
    "mean_accepted/multiblock": "τ multiblock",
    "fast_forward/jacobi": "fast-forward",
    "stationary/jacobi": "stationary",
    "exact_match/jacobi": "Jacobi = AR",
    "drift/nll_change/humaneval": "HumanEval NLL change",
    "drift/nll_change/heldout": "held-out NLL change",
    "quality/agreement": "greedy answers unchanged",
    "quality/first_divergence": "first divergence (median, tokens)",
    "quality/token_agreement": "token agreement",
    "val/ar": "val AR loss",
    "val/loss": "val loss",
    "global_step": "steps",
}
FRONTIER = ("drift/nll_change/humaneval", "drift/nll_change/heldout")   # the drift axis: the first one logged


def load_jobs(sweep: Path) -> list[dict]:
    jobs = []
    for job in sorted((p for p in sweep.iterdir() if (p / ".hydra" / "overrides.yaml").is_file()),
                      key=lambda p: int(p.name) if p.name.isdigit() else p.name):
        overrides = dict(o.split("=", 1) for o in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
                         if "=" in o)
        metrics = json.loads((job / "metrics.json").read_text()) if (job / "metrics.json").is_file() else {}
        curve = []
        log = job / "csv" / "metrics.csv"
        if log.is_file():
            with log.open() as f:
                curve = [(int(r["step"]), float(r["mean_accepted/jacobi"])) for r in csv.DictReader(f)
                         if r.get("mean_accepted/jacobi")]
        config = job / ".hydra" / "config.yaml"
        jobs.append({"dir": job.name, "overrides": overrides, "metrics": metrics, "tau_curve": curve,
                     "config": yaml.safe_load(config.read_text()) if config.is_file() else {}})
    return jobs


def fill_overrides(jobs: list[dict]) -> None:
    """Jobs of several sweeps: a key one sweep set and another did not gets, where unset, the job's own value (its
    composed ``.hydra/config.yaml``; null where it has none)."""
    for key in {k for j in jobs for k in j["overrides"]}:
        for j in jobs:
            if key not in j["overrides"]:
                value = j["config"]
                for part in key.lstrip("+").split("."):
                    value = value.get(part) if isinstance(value, dict) else None
                j["overrides"][key] = "null" if value is None else str(value)   # Hydra's spelling


def swept_keys(jobs: list[dict]) -> list[str]:
    keys = sorted({k for j in jobs for k in j["overrides"]})
    return [k for k in keys if len({j["overrides"].get(k) for j in jobs}) > 1] or keys


def markdown(jobs: list[dict], keys: list[str]) -> str:
    present = [m for m in COLUMNS if any(m in j["metrics"] for j in jobs)]
    lines = ["| job | " + " | ".join(keys + [COLUMNS[m] for m in present]) + " |",
             "|---" * (1 + len(keys) + len(present)) + "|"]
    for j in jobs:
        values = [j["overrides"].get(k, "") for k in keys]
        prompts = ((j["config"].get("callbacks") or {}).get("speedup") or {}).get("num_prompts")
        for m in present:
            v = j["metrics"].get(m)
            if v is not None and m == "quality/agreement" and prompts:     # a count of the decoded prompts
                v = f"{round(v * prompts)}/{prompts}"
            values.append("–" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v))
        lines.append(f"| {j['dir']} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def plot(jobs: list[dict], keys: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key, rest = keys[0], keys[1:]
    groups: dict[tuple, list[dict]] = {}
    for j in jobs:
        groups.setdefault(tuple(j["overrides"].get(k) for k in rest), []).append(j)
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    frontier(jobs, keys, axes[0])
    for metric, ax in zip(["speedup/jacobi", "quality/agreement"], axes[1:3]):
        for label, members in groups.items():
            pts = sorted((_num(j["overrides"].get(x_key)), j["metrics"].get(metric)) for j in members
                         if j["metrics"].get(metric) is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=", ".join(f"{k}={v}" for k, v in zip(rest, label)) or None)
        ax.set_xlabel(x_key)
        ax.set_title(COLUMNS[metric])
    ax = axes[3]
    for j in jobs:
        if j["tau_curve"]:
            ax.plot(*zip(*j["tau_curve"]), marker=".", label=", ".join(f"{k}={j['overrides'].get(k)}" for k in keys))
    ax.set_xlabel("training step")
    ax.set_title("τ during training")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def frontier(jobs: list[dict], keys: list[str], ax) -> None:
    """τ of each decoder against the drift (the first of ``FRONTIER`` any job logged), one point per job, named."""
    drift = next((m for m in FRONTIER if any(m in j["metrics"] for j in jobs)), None)
    taus = sorted({m for j in jobs for m in j["metrics"] if m.startswith("mean_accepted/")})
    if drift is None:
        ax.set_title("no drift measured")
        return
    for tau in taus:
        pts = [(j["metrics"][drift], j["metrics"][tau], j) for j in jobs
               if drift in j["metrics"] and tau in j["metrics"]]
        ax.scatter([x for x, _, _ in pts], [y for _, y, _ in pts], label=tau.split("/", 1)[1])
        for x, y, j in pts:
            ax.annotate(", ".join(f"{k.rsplit('.', 1)[-1]}={j['overrides'].get(k)}" for k in keys), (x, y), fontsize=6)
    ax.set_xlabel(COLUMNS[drift])
    ax.set_ylabel("τ (tokens/forward)")
    ax.set_title("τ against drift (up and left is better)")


def _num(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sweep_dirs", type=Path, nargs="+", help="multirun directories; the report goes in the first")
    args = parser.parse_args(argv)
    jobs = []
    for sweep in args.sweep_dirs:
        found = load_jobs(sweep) if sweep.is_dir() else []
        if not found:
            print(f"error: {sweep}: no Hydra job directories (with .hydra/overrides.yaml) in it", file=sys.stderr)
            return 2
        if len(args.sweep_dirs) > 1:      # jobs named by their sweep too
            found = [dict(j, dir=f"{sweep.name}/{j['dir']}") for j in found]
        jobs += found
    fill_overrides(jobs)
    out = args.sweep_dirs[0]
    keys = swept_keys(jobs)
    table = markdown(jobs, keys)
    (out / "sweep.md").write_text(table)
    plot(jobs, keys, out / "sweep.png")
    print(table)
    print(f"wrote {out / 'sweep.md'} and {out / 'sweep.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
