"""The lines experiments/gpu_check.sh prints: what the setup imports, and what each run measured, read from its run
directory. Each prints one line and never fails on a run's missing files: it says what is missing instead.

    python experiments/gpu_check.py imports SITE MODULE...   # versions, the device; exit 1 unless each loads from SITE
    python experiments/gpu_check.py train RUN_DIR            # step, τ and speedup before -> after, exact, the export
    python experiments/gpu_check.py bench RUN_DIR            # per decoder: τ, speedup, exact, tokens generated
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import sys
from pathlib import Path

EXPORT_MARK = "lit_spec_export.json"     # lit_spec.export.MARK, not imported: this runs without torch's import
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}   # nothing reaches a network


def imports(site: str, *names: str) -> int:
    """The device and the carried modules' versions; 1 when one loads from elsewhere than ``site`` (the wheels'
    target: the image's own copy, say, at another version than the one tested) or the environment is not offline."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    print("torch", torch.__version__, "cuda", torch.version.cuda, device)
    stray = []
    for name in names:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), module.__file__)
        stray += [] if str(module.__file__).startswith(site) else [name]
    online = [f"{k}={os.environ.get(k)}" for k, v in OFFLINE.items() if os.environ.get(k) != v]
    for problem, found in (("not loaded from " + site, stray), ("not offline", online)):
        if found:
            print(f"{problem}: {', '.join(found)}")
    return 1 if stray or online else 0


def train_line(run: Path) -> str:
    """The run's last step, per decoder its τ and speedup at the first measurement -> the last and its exact match,
    the speedup callback's seconds per measurement, and whether the export (and its vllm/ layout) was written."""
    m = json.loads((run / "metrics.json").read_text())
    rows = list(csv.DictReader(open(run / "csv" / "metrics.csv")))
    first = lambda k: next((float(r[k]) for r in rows if r.get(k)), float("nan"))   # noqa: E731
    line = f"step={m['global_step']}"
    for k in sorted(k for k in m if k.startswith("mean_accepted/")):
        d = k.split("/", 1)[1]
        line += (f" {d}: τ {first(k):.2f}->{m[k]:.2f} speedup {first('speedup/' + d):.2f}->"
                 f"{m['speedup/' + d]:.2f} exact {m['exact_match/' + d]:.2f}")
    line += f" callback={m.get('time/measure_s', float('nan')):.1f}s/measurement"
    export = run / "export"
    line += " export=" + ("yes" if (export / EXPORT_MARK).is_file() else "MISSING")
    return line + ("+vllm" if (export / "vllm" / "config.json").is_file() else "")


def bench_line(run: Path) -> str:
    """Per decoder of the run's bench.json: tokens/s, τ, speedup over our AR, exact match with AR, new tokens."""
    results = json.loads((run / "bench.json").read_text())
    parts = [f"{results['device']} {results['dtype']}"]
    for name, m in results["methods"].items():
        tau = f"τ {m['mean_accepted']:.2f} " if m.get("mean_accepted") is not None else ""
        exact = f" exact {m['exact_match']:.2f}" if m.get("exact_match") is not None else ""
        parts.append(f"{name}: {m['tokens_per_s']:.1f} tok/s {tau}{m['speedup']:.2f}×{exact} tokens {m['new_tokens']}")
    return " | ".join(parts)


def main(argv: list[str]) -> int:
    commands = {"train": train_line, "bench": bench_line}
    if len(argv) >= 2 and argv[0] == "imports":
        return imports(*argv[1:])
    if len(argv) != 2 or argv[0] not in commands:
        print(__doc__.split("\n\n", 1)[1].rstrip(), file=sys.stderr)
        return 2
    try:
        print(commands[argv[0]](Path(argv[1])))
    except Exception as e:      # a run that wrote nothing: say so on its line, don't hide it
        print(f"FAILED: {type(e).__name__}: {str(e)[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
