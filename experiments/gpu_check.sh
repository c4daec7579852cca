#!/usr/bin/env bash
# GPU checks (run on a CUDA machine from the repository root):
# 1. the training stack: the tiny AR run under every DeepSpeed ZeRO strategy and FSDP, bf16-mixed, one GPU, then the
#    export is loaded back with plain transformers;
# 2. the decoding bench on the GPU: the tiny target (fp32 and bf16), and the ~1B bench (+experiment=bench_qwen2_5_1_5b)
#    when its weights are in the local Hugging Face cache (the bench loads from the hub otherwise).
# Prints one summary line per run; logs go to ${OUT:-logs/gpu_check}.
set -u
out=${OUT:-logs/gpu_check}
mkdir -p "$out"
export LIT_SPEC_CACHE=${LIT_SPEC_CACHE:-/tmp/lit_spec_cache} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
common="model=tiny trainer=gpu logger=csv trainer.max_steps=${STEPS:-200} trainer.val_check_interval=100
        data.max_eval_samples=64 trainer.enable_progress_bar=false method.lr=2e-3 method.mask_prompt=false"
for strategy in auto deepspeed_zero2 deepspeed_zero3 deepspeed_zero3_offload fsdp; do
  run=/tmp/gpu_check/$strategy
  start=$(date +%s)
  python -m lit_spec.train $common strategy=$strategy hydra.run.dir=$run > "$out/$strategy.log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  python - "$run" "$strategy" "$rc" "$secs" <<'PY' | tee -a "$out/summary.txt"
import json, sys, pathlib, torch
run, strategy, rc, secs = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
line = f"{strategy:24s} rc={rc} wall={secs}s"
try:
    m = json.loads((run / "metrics.json").read_text())
    import csv
    rows = list(csv.DictReader(open(run / "csv" / "metrics.csv")))
    tps = [float(r["train/device/items_per_sec"]) for r in rows if r.get("train/device/items_per_sec")]
    line += f" tokens/s={tps[-1]:.0f}" if tps else ""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(run / "export").cuda()
    tok = AutoTokenizer.from_pretrained(run / "export")
    ids = tok('"""Return the sum of a and b."""\n', return_tensors="pt").input_ids.cuda()
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    line += (f" step={m['global_step']} train/loss={m.get('train/loss', float('nan')):.3f} "
             f"val/loss={m.get('val/loss', float('nan')):.3f} export_loads=yes sample={tok.decode(out[0, ids.shape[1]:])!r}")
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
python -m lit_spec.bench +experiment=bench_qwen2_5_1_5b hydra.run.dir=/tmp/gpu_check/bench_qwen > "$out/bench_qwen.log" 2>&1
echo "bench Qwen2.5-1.5B rc=$?" | tee -a "$out/summary.txt"
cat /tmp/gpu_check/bench_qwen/bench.md >> "$out/summary.txt" 2>/dev/null
