#!/usr/bin/env bash
# The one device call of a lent GPU (H100/H200), from the repository root; docs/distributed.md, "Check a GPU machine",
# gives the call and how to prepare what it carries. After the setup (experiments/gpu_setup.sh: the wheels, the
# stages, a python that keeps the image's environment, offline), most valuable first:
# 1. the CLLM (trainer=a100x8 with one device), Chimera, Hidden Transfer and Jacobi Forcing quickstarts under ZeRO-3
#    in bf16-mixed, each exporting after training;
# 2. EAGLE-3 under ZeRO-2, its export with the vllm/ layout;
# 3. Chimera under DDP and Hidden Transfer under FSDP2, each beside a bf16 base;
# 4. the bench on the device, which loads the exports and generates with them: the EAGLE-3 draft (dynamic tree and
#    chain), Chimera's and Hidden Transfer's against AR and `generate`; the CLLM export against its tiny target; the
#    Jacobi Forcing export; the training-free decoders in bf16; the fast path's engines against eager in fp32.
# Every run is a step (gpu_setup.sh): bounded, its line printed the moment it ends (exit code, seconds, what it
# measured: experiments/gpu_check.py), its log in $OUT (default logs/gpu_check). The runs go JOBS at a time (default
# 4: the tiny models leave a GPU mostly idle), the benches of the exports once every training has ended. STEPS (default 150) sets the training steps,
# RUN_TIMEOUT (default 300 s) bounds each run, and every run ends by DEADLINE seconds (default 450) after the start (a
# run with under 30 s left is listed as skipped), so that the call always returns its summary, printed last.
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
}

bench() {  # name, overrides...
  local name=$1 run=$runs/$1; shift
  rm -rf "$run"
  # shellcheck disable=SC2046
  DETAIL="python experiments/gpu_check.py bench $run" step "$name" "$limit" python -m lit_spec.bench "$@" \
    bench.device=$device hydra.run.dir="$run" $(extra "bench/$name")
}

launch() {  # kind name overrides...: in the background once fewer than $jobs run, bounded by what DEADLINE leaves
  while (( $(jobs -rp | wc -l) >= jobs )); do wait -n; done
  local left=$(( deadline - SECONDS ))
  if (( left < 30 )); then report "$2 skipped: ${left}s left before DEADLINE"; return; fi
  limit=$(( left < run_timeout ? left : run_timeout ))
  "$@" &
}

# "kind name overrides": first what reads nothing of another run, then the benches of the exports
first=(
  "train cllm_zero3 +experiment=cllm_quickstart trainer=a100x8 trainer.devices=1 strategy=deepspeed_zero3"
  "train chimera_zero3 +experiment=chimera_quickstart trainer=gpu strategy=deepspeed_zero3"
  "train hidden_transfer_zero3 +experiment=hidden_transfer_quickstart trainer=gpu strategy=deepspeed_zero3"
  "train jacobi_forcing_zero3 +experiment=jacobi_forcing_quickstart trainer=gpu strategy=deepspeed_zero3"
  "train eagle3_zero2 +experiment=eagle3_quickstart trainer=gpu strategy=deepspeed_zero2"
  "train chimera_ddp_bf16_base +experiment=chimera_quickstart trainer=gpu strategy=ddp model.dtype=bfloat16"
  "train hidden_transfer_fsdp_bf16_base +experiment=hidden_transfer_quickstart trainer=gpu strategy=fsdp
   model.dtype=bfloat16"
  # every bench on eager but bench_fast_path, which runs the fast path's engines beside it
  "bench bench_training_free_bf16 model.dtype=bfloat16 bench.engines=[eager]
   decoding=[jacobi,multiblock,lookahead,lookahead_cpu,prompt_lookup,speculative,tree,ouroboros]"
  "bench bench_fast_path decoding=[prompt_lookup,speculative] bench.engines=[eager,graphs,frozen]
   bench.hf_peers=[generate]"
)
e3=$runs/eagle3_zero2/export
after=(
  "bench bench_heads decoding=[eagle3,eagle3_chain,chimera,hidden_transfer] decoding.eagle3.heads=$e3
   decoding.eagle3_chain.heads=$e3 decoding.chimera.heads=$runs/chimera_zero3/export
   decoding.hidden_transfer.transfer=$runs/hidden_transfer_zero3/export draft=null bench.hf_peers=[generate]
   bench.engines=[eager]"
  "bench bench_cllm_export model=hf model.name_or_path=$runs/cllm_zero3/export model.dtype=float32
   model@original=tiny_target decoding=[jacobi,multiblock,lookahead,lookahead_cpu] bench.engines=[eager]"
  "bench bench_jacobi_forcing_export model=hf model.name_or_path=$runs/jacobi_forcing_zero3/export
   model.dtype=float32 decoding=[jacobi,multiblock] draft=null bench.hf_peers=[generate] bench.engines=[eager]"
)
if ! grep -q 'rc=[1-9]' "$out/summary.txt"; then     # a failed setup fails every run: its lines say why
  # shellcheck disable=SC2086
  for entry in "${first[@]}"; do launch $entry; done
  wait
  # shellcheck disable=SC2086
  for entry in "${after[@]}"; do launch $entry; done
  wait
fi
echo "== summary ($out/summary.txt; logs in $out/gpu_check.tgz)"
cat "$out/summary.txt"
tar czf "$out/gpu_check.tgz" -C "$out" --exclude=gpu_check.tgz . 2>/dev/null
! grep -q 'rc=[1-9]\|skipped' "$out/summary.txt"
