# Source this on a bare GPU machine without network, from the repository root, before experiments/gpu_check.sh:
#   source experiments/gpu_setup.sh && bash experiments/gpu_check.sh
# It installs the wheels the image lacks (.whl, filled here by ../shared/tools/gpu_wheels.sh) into /tmp/site, unpacks
# the cached stages (.gpu/stages.tgz, docs/distributed.md), and puts a `python` on PATH that runs the image's python3
# (a symlink would lose its virtual environment, and with it torch). Each step is bounded by STEP_TIMEOUT and prints
# its exit code and time at once: a device call once spent its whole budget in a setup step that printed nothing.
step() {  # name, command...
  local name=$1 t0 rc; shift; t0=$(date +%s)
  timeout "${STEP_TIMEOUT:-120}" "$@"; rc=$?
  echo "setup: $name rc=$rc $(( $(date +%s) - t0 ))s"
  return $rc
}
mkdir -p /tmp/bin ~/.cache/lit_spec
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /tmp/bin/python && chmod +x /tmp/bin/python
export PATH=/tmp/bin:$PATH PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  WANDB_MODE=offline
step wheels python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
  --target /tmp/site .whl/*.whl
step stages tar xzf .gpu/stages.tgz -C ~/.cache/lit_spec
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
step imports python -c "import torch, transformers, lightning, deepspeed, datasets, hydra
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__,
      'lightning', lightning.__version__, 'deepspeed', deepspeed.__version__, 'datasets', datasets.__version__)"
