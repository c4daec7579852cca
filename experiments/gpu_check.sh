#!/usr/bin/env bash
# The card's configuration on one real GPU (H100/H200), from the repository root, in <= 10 minutes with the stages
# cached (docs/distributed.md, "Check a GPU machine", says how to carry them to a machine without network):
# 1. CLLM, Chimera, Hidden Transfer and Jacobi Forcing quickstarts under ZeRO-3 in bf16-mixed (trainer=gpu), each
#    exporting after training, when Lightning's teardown has moved the module to the CPU (the export must run before);
# 2. the decoding bench on CUDA: the tiny target in fp32 and bf16 (every training-free decoder, the paper's lookahead
#    beside the CPU setting, transformers' peers), then the CLLM export of step 1 against the tiny target it came from;
# 3. CLLM under ZeRO-2 and FSDP2; frozen-base methods beside a bf16 base, the trained heads in fp32 (bf16-mixed):
#    Chimera under DDP, Hidden Transfer under FSDP2; last, CLLM under ZeRO-3 offload (it JIT-builds DeepSpeed's CPU Adam).
# One summary line per run (exit code, wall time, steps, τ and speedup before -> after, exact, the speedup callback's
# seconds per measurement) in $OUT/summary.txt, each run's log beside it, and everything in $OUT/gpu_check.tgz.
# STEPS (default 150) sets the training steps; RUN_TIMEOUT (default 240 s) bounds each run, and all of them end by
# DEADLINE seconds (default 540) after the start (a run with under 30 s left is listed as skipped), so that one
# device call always returns its summary.
set -uf   # -f: the decoder lists in brackets are not globs
out=${OUT:-logs/gpu_check}
mkdir -p "$out"
export LIT_SPEC_CACHE=${LIT_SPEC_CACHE:-$HOME/.cache/lit_spec} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline
steps=${STEPS:-150} run_timeout=${RUN_TIMEOUT:-240} deadline=$(( $(date +%s) + ${DEADLINE:-540} ))
decoders="[jacobi,multiblock,lookahead,lookahead_cpu,prompt_lookup,speculative,tree,ouroboros]"

train() {  # name, overrides...
  local name=$1 run=/tmp/gpu_check/$1 start rc; shift
  rm -rf "$run"; start=$(date +%s)
  timeout "$limit" python -m lit_spec.train "$@" trainer=gpu trainer.max_steps=$steps \
    trainer.val_check_interval=$((steps / 2)) hydra.run.dir=$run > "$out/$name.log" 2>&1
  rc=$?
  python - "$run" "$name" "$rc" "$(( $(date +%s) - start ))" <<'PY' | tee -a "$out/summary.txt"
import csv, json, pathlib, sys
run, name, rc, secs = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
line = f"{name:30s} rc={rc} wall={secs}s"
try:
    m = json.loads((run / "metrics.json").read_text())
    rows = list(csv.DictReader(open(run / "csv" / "metrics.csv")))
    first = lambda k: next(float(r[k]) for r in rows if r.get(k))                 # noqa: E731
    line += f" step={m['global_step']}"
    for k in sorted(k for k in m if k.startswith("mean_accepted/")):
        d = k.split("/", 1)[1]
        line += (f" {d}: τ {first(k):.2f}->{m[k]:.2f} speedup {first('speedup/' + d):.2f}->{m['speedup/' + d]:.2f}"
                 f" exact {m['exact_match/' + d]:.2f}")
    line += f" callback={m.get('time/measure_s', float('nan')):.1f}s/measurement"
    line += " export=" + ("yes" if (run / "export" / "lit_spec_export.json").is_file() else "MISSING")
except Exception as e:  # report, don't hide
    line += f" FAILED: {type(e).__name__}: {str(e)[:200]}"
print(line)
PY
}

bench() {  # name, overrides...
  local name=$1 run=/tmp/gpu_check/$1 start rc; shift
  rm -rf "$run"; start=$(date +%s)
  timeout "$limit" python -m lit_spec.bench bench.device=cuda "$@" hydra.run.dir=$run > "$out/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc wall=$(( $(date +%s) - start ))s" | tee -a "$out/summary.txt"
  cat "$run/bench.md" >> "$out/summary.txt" 2>/dev/null
}

runs=(
  "train cllm_zero3 +experiment=cllm_quickstart strategy=deepspeed_zero3"
  "train chimera_zero3 +experiment=chimera_quickstart strategy=deepspeed_zero3"
  "train hidden_transfer_zero3 +experiment=hidden_transfer_quickstart strategy=deepspeed_zero3"
  "train jacobi_forcing_zero3 +experiment=jacobi_forcing_quickstart strategy=deepspeed_zero3"
  "bench bench_tiny_float32 model.dtype=float32 decoding=$decoders"
  "bench bench_tiny_bfloat16 model.dtype=bfloat16 decoding=$decoders"
  "bench bench_cllm_export model=hf model.name_or_path=/tmp/gpu_check/cllm_zero3/export model.dtype=float32
   model@original=tiny_target decoding=[jacobi,multiblock,lookahead,lookahead_cpu]"
  "train cllm_zero2 +experiment=cllm_quickstart strategy=deepspeed_zero2"
  "train cllm_fsdp +experiment=cllm_quickstart strategy=fsdp"
  "train chimera_ddp_bf16_base +experiment=chimera_quickstart strategy=ddp model.dtype=bfloat16"
  "train hidden_transfer_fsdp_bf16_base +experiment=hidden_transfer_quickstart strategy=fsdp model.dtype=bfloat16"
  "train cllm_zero3_offload +experiment=cllm_quickstart strategy=deepspeed_zero3_offload"
)
for entry in "${runs[@]}"; do
  left=$(( deadline - $(date +%s) ))
  if (( left < 30 )); then
    echo "skipped (deadline): $entry" | tee -a "$out/summary.txt"; continue
  fi
  limit=$(( left < run_timeout ? left : run_timeout ))
  # shellcheck disable=SC2086
  $entry
done
tar czf "$out/gpu_check.tgz" -C "$out" --exclude=gpu_check.tgz . 2>/dev/null
