#!/usr/bin/env bash
# The one device call of a lent GPU (H100/H200), from the repository root; docs/distributed.md, "Check a GPU machine",
# gives the call and how to prepare what it carries. After the setup (experiments/gpu_setup.sh: the wheels, the
# stages, a python that keeps the image's environment, offline), most valuable first:
# 1. the bench of the fast path on the tiny target, fp32: AR, prompt lookup and speculative on eager and on graphs
#    (CUDA graphs);
# 2. the CLLM (trainer=a100x8 with one device), Chimera and Hidden Transfer quickstarts under ZeRO-3 in bf16-mixed and
#    EAGLE-3 under ZeRO-2 (its export with the vllm/ layout), each exporting after training;
# 3. the benches of those exports, eager and graphs: EAGLE-3's chain and dynamic tree, Chimera's, Hidden Transfer's;
#    Jacobi and lookahead on the CLLM export against its tiny target;
# 4. Jacobi Forcing under ZeRO-3, Chimera under DDP and Hidden Transfer under FSDP2 each beside a bf16 base;
# 5. the Jacobi Forcing export's bench and the training-free decoders in bf16, eager.
# Every run is a step (gpu_setup.sh): bounded, its line printed the moment it ends (exit code, seconds, what it
# measured: experiments/gpu_check.py), its log, bench.md and metrics in $OUT (default logs/gpu_check). A bench runs
# alone (its timings share the GPU with no other run); the trainings go JOBS at a time (default 4: the tiny models
# leave a GPU mostly idle). STEPS (default 150) sets the training steps, RUN_TIMEOUT (default 300 s) bounds each run,
# and every run ends by DEADLINE seconds (default 450) after the start (a run with under 30 s left is listed as
# skipped), so that the call always returns its summary, printed last. GROUPS_RUN (default "fast trainings exports
# more_trainings last", the five above) names the groups a rerun repeats.
# --rehearse: the same steps on this machine's CPU, JOBS (default 2) at a time (tests/test_gpu_check.py, the slow
# tier). The file $GPU_CHECK_OVERRIDES, if set, adds overrides to runs: each line a glob on kind/name
# (train/cllm_zero3, bench/*), then the overrides (the rehearsal's sizes).
# Exit code 0 when every step ended with 0 and none was skipped.
set -u
case ${1:-} in
  "") rehearse=0 ;;
  --rehearse) rehearse=1 ;;
  *) echo "usage: bash experiments/gpu_check.sh [--rehearse]" >&2; exit 2 ;;
esac
for knob in STEPS RUN_TIMEOUT DEADLINE JOBS; do
  [[ ${!knob:-1} =~ ^[1-9][0-9]*$ ]] || { echo "$knob=${!knob}: a whole number of at least 1" >&2; exit 2; }
done
if [[ -n ${GPU_CHECK_OVERRIDES:-} && ! -f $GPU_CHECK_OVERRIDES ]]; then
  echo "GPU_CHECK_OVERRIDES=$GPU_CHECK_OVERRIDES: no such file" >&2; exit 2
fi
all_groups="fast trainings exports more_trainings last"      # the lists below, in their order
groups=${GROUPS_RUN:-$all_groups}                            # a rerun names the groups it repeats
for group in $groups; do
  [[ " $all_groups " == *" $group "* ]] || { echo "GROUPS_RUN: no group $group ($all_groups)" >&2; exit 2; }
done
deadline=$(( SECONDS + ${DEADLINE:-450} ))
# shellcheck source=experiments/gpu_setup.sh
source experiments/gpu_setup.sh
set -f   # the decoder lists in brackets are not globs
# each run finds a free port of its own: one inherited MASTER_PORT makes the runs that share the machine collide
# (EADDRINUSE; seen in the rehearsal when pytest's own in-process trainings had exported one)
unset MASTER_PORT MASTER_ADDR
steps=${STEPS:-150} run_timeout=${RUN_TIMEOUT:-300} runs=$root/runs
if ((rehearse)); then   # two runs at a time on 2 cores, a torch thread each: the GPU's pool of JOBS rehearsed
  accelerator=cpu device=cpu jobs=${JOBS:-2}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  accelerator=gpu device=cuda jobs=${JOBS:-4}
  export TORCH_LOGS=${TORCH_LOGS-perf_hints}     # inductor's reasons for skipping CUDA graphs, in the benches' logs
fi

extra() {  # kind/name: the overrides of $GPU_CHECK_OVERRIDES's lines whose glob matches it
  local glob overrides
  [[ -n ${GPU_CHECK_OVERRIDES:-} ]] || return 0
  while read -r glob overrides; do
    # shellcheck disable=SC2053
    [[ $glob != \#* && $1 == $glob ]] && printf ' %s' "$overrides"
  done < "$GPU_CHECK_OVERRIDES"
}

train() {  # name, overrides...: trains, then exports into $runs/name/export
  local name=$1 run=$runs/$1; shift
  rm -rf "$run"
  # shellcheck disable=SC2046
  DETAIL="python experiments/gpu_check.py train $run" step "$name" "$limit" python -m lit_spec.train "$@" \
    trainer.accelerator=$accelerator trainer.max_steps="$steps" trainer.max_epochs=-1 \
    trainer.check_val_every_n_epoch=null trainer.val_check_interval=$(( steps > 1 ? steps / 2 : 1 )) \
    hydra.run.dir="$run" $(extra "train/$name")
  cp "$run/metrics.json" "$out/$name.metrics.json" 2>/dev/null    # into the tarball that comes back
}

bench() {  # name, overrides...
  local name=$1 run=$runs/$1; shift
  rm -rf "$run"
  # shellcheck disable=SC2046
  DETAIL="python experiments/gpu_check.py bench $run" step "$name" "$limit" python -m lit_spec.bench "$@" \
    bench.device=$device hydra.run.dir="$run" $(extra "bench/$name")
  cp "$run/bench.md" "$out/$name.md" 2>/dev/null; cp "$run/bench.json" "$out/$name.json" 2>/dev/null
  # a graphs engine that inductor could not capture runs compiled without CUDA graphs: said, not hidden (perf_hints)
  local skips; skips=$(grep -c "skipping cudagraphs" "$out/$name.log")
  ((skips)) && report "$name: $skips cudagraph skips: $(grep -m1 -o 'skipping cudagraphs.*' "$out/$name.log")"
  return 0
}

launch() {  # jobs kind name overrides...: in the background once fewer than `jobs` run, bounded by what DEADLINE leaves
  local most=$1; shift
  while (( $(jobs -rp | wc -l) >= most )); do wait -n; done
  local left=$(( deadline - SECONDS ))
  if (( left < 30 )); then report "$2 skipped: ${left}s left before DEADLINE"; return; fi
  limit=$(( left < run_timeout ? left : run_timeout ))
  "$@" &
}

stage() {  # jobs, entries ("kind name overrides"): each launched as `launch` allows; returns when all have ended
  local most=$1 entry; shift
  # shellcheck disable=SC2086
  for entry in "$@"; do launch "$most" $entry; done
  wait
}

# "kind name overrides", most valuable first. A bench runs alone, so that its timings share the GPU with no other run;
# the trainings go $jobs at a time. The fast path's engines (graphs: CUDA graphs) run beside eager where the bench says.
fast=(
  "bench bench_fast_path decoding=[prompt_lookup,speculative] bench.engines=[eager,graphs] bench.hf_peers=[generate]
   bench.num_prompts=10"
)
trainings=(
  "train cllm_zero3 +experiment=cllm_quickstart trainer=a100x8 trainer.devices=1 strategy=deepspeed_zero3"
  "train eagle3_zero2 +experiment=eagle3_quickstart trainer=gpu strategy=deepspeed_zero2"
  "train chimera_zero3 +experiment=chimera_quickstart trainer=gpu strategy=deepspeed_zero3"
  "train hidden_transfer_zero3 +experiment=hidden_transfer_quickstart trainer=gpu strategy=deepspeed_zero3"
)
e3=$runs/eagle3_zero2/export
exports=(
  "bench bench_heads decoding=[eagle3_chain,eagle3,chimera,hidden_transfer] decoding.eagle3.heads=$e3
   decoding.eagle3_chain.heads=$e3 decoding.chimera.heads=$runs/chimera_zero3/export
   decoding.hidden_transfer.transfer=$runs/hidden_transfer_zero3/export draft=null bench.hf_peers=[generate]
   bench.engines=[eager,graphs] bench.num_prompts=10"
  "bench bench_cllm_export model=hf model.name_or_path=$runs/cllm_zero3/export model.dtype=float32
   model@original=tiny_target decoding=[jacobi,lookahead_tiny] bench.engines=[eager,graphs] bench.num_prompts=10"
)
more_trainings=(
  "train jacobi_forcing_zero3 +experiment=jacobi_forcing_quickstart trainer=gpu strategy=deepspeed_zero3"
  "train chimera_ddp_bf16_base +experiment=chimera_quickstart trainer=gpu strategy=ddp model.dtype=bfloat16"
  "train hidden_transfer_fsdp_bf16_base +experiment=hidden_transfer_quickstart trainer=gpu strategy=fsdp
   model.dtype=bfloat16"
)
last=(
  "bench bench_jacobi_forcing_export model=hf model.name_or_path=$runs/jacobi_forcing_zero3/export
   model.dtype=float32 decoding=[jacobi,multiblock] draft=null bench.hf_peers=[generate] bench.engines=[eager]"
  "bench bench_training_free_bf16 model.dtype=bfloat16 bench.engines=[eager]
   decoding=[jacobi,multiblock,lookahead,lookahead_cpu,prompt_lookup,speculative,tree,ouroboros]"
)
if ! grep -q 'rc=[1-9]' "$out/summary.txt"; then     # a failed setup fails every run: its lines say why
  for group in $groups; do
    declare -n entries=$group
    if [[ " fast exports last " == *" $group "* ]]; then stage 1 "${entries[@]}"; else stage "$jobs" "${entries[@]}"; fi
  done
fi
echo "== summary ($out/summary.txt; logs in $out/gpu_check.tgz)"
cat "$out/summary.txt"
tar czf "$out/gpu_check.tgz" -C "$out" --exclude=gpu_check.tgz . 2>/dev/null
# the device tool brings back 8 files of $OUT at most: there, the tarball and the summary alone
[[ -n ${OUT:-} ]] && find "$out" -type f ! -name gpu_check.tgz ! -name summary.txt -delete
! grep -q 'rc=[1-9]\|skipped' "$out/summary.txt"
