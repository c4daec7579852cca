#!/usr/bin/env bash
# The card's configuration on one real GPU (H100/H200), from the repository root, in <= 10 minutes with the stages
# cached (docs/distributed.md, "Check a GPU machine", says how to carry them to a machine without network):
# 1. CLLM, Chimera, Hidden Transfer and Jacobi Forcing quickstarts under ZeRO-3 in bf16-mixed (trainer=gpu);
# 2. CLLM under ZeRO-2, FSDP2 and ZeRO-3 offload;
# 3. frozen-base methods beside a bf16 base, the trained heads in fp32 (bf16-mixed): Chimera under DDP, Hidden
#    Transfer under FSDP2 (every ZeRO-3 run above exports after training, when Lightning's teardown has moved the
#    module to the CPU: the export must have run before it);
# 4. the decoding bench on CUDA (tiny target, fp32 and bf16).
# One summary line per run (exit code, wall time, steps, τ and speedup before -> after, exact, the speedup callback's
# seconds per measurement) in $OUT/summary.txt; each run's log beside it. STEPS (default 150) sets the training steps.
set -u
out=${OUT:-logs/gpu_check}
mkdir -p "$out"
export LIT_SPEC_CACHE=${LIT_SPEC_CACHE:-$HOME/.cache/lit_spec} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline
steps=${STEPS:-150}
runs=(
  "cllm_zero3 +experiment=cllm_quickstart strategy=deepspeed_zero3"
  "chimera_zero3 +experiment=chimera_quickstart strategy=deepspeed_zero3"
  "hidden_transfer_zero3 +experiment=hidden_transfer_quickstart strategy=deepspeed_zero3"
  "jacobi_forcing_zero3 +experiment=jacobi_forcing_quickstart strategy=deepspeed_zero3"
  "cllm_zero2 +experiment=cllm_quickstart strategy=deepspeed_zero2"
  "cllm_fsdp +experiment=cllm_quickstart strategy=fsdp"
  "cllm_zero3_offload +experiment=cllm_quickstart strategy=deepspeed_zero3_offload"
  "chimera_ddp_bf16_base +experiment=chimera_quickstart strategy=ddp model.dtype=bfloat16"
  "hidden_transfer_fsdp_bf16_base +experiment=hidden_transfer_quickstart strategy=fsdp model.dtype=bfloat16"
)
for entry in "${runs[@]}"; do
  read -r name overrides <<< "$entry"
  run=/tmp/gpu_check/$name
  rm -rf "$run"
  start=$(date +%s)
  # shellcheck disable=SC2086
  python -m lit_spec.train $overrides trainer=gpu trainer.max_steps=$steps trainer.val_check_interval=$((steps / 2)) \
    hydra.run.dir=$run > "$out/$name.log" 2>&1
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
done

for dtype in float32 bfloat16; do
  python -m lit_spec.bench bench.device=cuda model.dtype=$dtype hydra.run.dir=/tmp/gpu_check/bench_tiny_$dtype \
    > "$out/bench_tiny_$dtype.log" 2>&1
  echo "bench tiny target $dtype rc=$?" | tee -a "$out/summary.txt"
  cat /tmp/gpu_check/bench_tiny_$dtype/bench.md >> "$out/summary.txt" 2>/dev/null
done
