#!/usr/bin/env bash
# Run the GPU tests and benchmarks on a GPU node, stage by stage, each under its own time limit,
# writing logs and JSON results to OUT_DIR.
#
#   bash scripts/gpu_validation.sh [--out OUT_DIR] [--wheels WHEEL_DIR] STAGE...
#   bash scripts/gpu_validation.sh --out results --wheels wheels setup tests bench-sync
#
# --out defaults to ./gpu_out; --wheels (offline wheels for the setup stage) to none.
#
# Stages:
#   setup          scripts/gpu_node_setup.sh WHEEL_DIR (offline wheels, editable packages, CUDA native build)
#   tests          pytest tests/gpu (skips what the machine lacks); TESTS=... picks files
#   bench-sync     scripts/bench_weight_sync.py (2 GPUs)           SYNC_SHAPES (default "1.7b 7b")
#   bench-offload  miles-offload-bench on cuda:0, cpu and disk targets
#   bench-adam     scripts/bench_streamed_adam.py, ADAM_PARAMS_B (default "1 2"; empty skips) on
#                  1 GPU, then ADAM_PARAMS_B_2GPU (default "4"; empty skips) on 2 GPUs when there
#                  are 2; ADAM_DTYPES (default "fp32 bf16") the moment dtypes, ADAM_STEPS (default
#                  2) the timed steps, ADAM_EXTRA more flags (e.g. --skip-resident)
#   bench-fsdp     scripts/bench_fsdp_train.py on 1 GPU, then 2 GPUs     FSDP_ITERS (default 6)
#   bench-megatron scripts/bench_megatron_train.py at TP = each of MEGATRON_GPUS (default "1 2")
#   bench-moe      scripts/bench_fused_moe.py
#   train-e2e      scripts/gpu_train_e2e.py: miles train jobs, E2E_CASES (default by GPU count),
#                  E2E_ROLLOUTS (default 3); phase times, peak memory, engine = trainer weights
#
# A stage that fails or times out is reported and the next one runs; the exit status is the
# number of failed stages. STAGE_TIMEOUT_<NAME> (seconds) overrides a stage's limit.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=gpu_out
WHEELS=""
while [ $# -gt 0 ]; do
  case $1 in
    --out) OUT_DIR=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --) shift; break ;;
    -*) echo "gpu_validation: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [ $# -eq 0 ]; then
  echo "usage: scripts/gpu_validation.sh [--out OUT_DIR] [--wheels WHEEL_DIR] STAGE..." >&2
  exit 2
fi
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
start=$SECONDS
failed=0

say() { echo "gpu_validation [$((SECONDS - start))s]: $*"; }

stage_limit() {  # name default
  local var="STAGE_TIMEOUT_${1//-/_}"
  echo "${!var:-$2}"
}

run_stage() {  # name default_limit command...
  local name=$1 limit
  limit=$(stage_limit "$1" "$2")
  shift 2
  say "stage $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=15 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT_DIR/$name.log"
  if [ $rc -ne 0 ]; then
    failed=$((failed + 1))
    say "stage $name FAILED (rc $rc) after $((SECONDS - t0))s"
  else
    say "stage $name ok after $((SECONDS - t0))s"
  fi
  echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >>"$OUT_DIR/stages.jsonl"
}

for stage in "$@"; do
  case $stage in
    setup)
      run_stage setup 120 bash scripts/gpu_node_setup.sh "$WHEELS" ;;
    tests)
      run_stage tests 420 python3 -m pytest -o addopts="" -q -rs --timeout 300 \
        --junitxml "$OUT_DIR/tests.xml" ${TESTS:-tests/gpu} ;;
    bench-sync)
      run_stage bench-sync 300 python3 scripts/bench_weight_sync.py \
        --shapes ${SYNC_SHAPES:-1.7b 7b} ${SYNC_EXTRA:-} --json "$OUT_DIR/bench_weight_sync${SYNC_TAG:-}.json" ;;
    bench-offload)
      run_stage bench-offload 180 python3 -m miles_offload.bench --device cuda:0 \
        --size-gb "${OFFLOAD_GB:-8}" --cycles 4 --disk-dir /tmp/offload_bench --json "$OUT_DIR/bench_offload.json" ;;
    bench-adam)
      if [ -n "${ADAM_PARAMS_B-1 2}" ]; then
        run_stage bench-adam 240 python3 scripts/bench_streamed_adam.py \
          --params-b ${ADAM_PARAMS_B-1 2} --moment-dtype ${ADAM_DTYPES:-fp32 bf16} \
          --steps "${ADAM_STEPS:-2}" ${ADAM_EXTRA:-} --disk-dir /tmp/adam_bench \
          --json "$OUT_DIR/bench_streamed_adam_1gpu.json"
      fi
      if [ "$NGPU" -ge 2 ] && [ -n "${ADAM_PARAMS_B_2GPU-4}" ]; then
        run_stage bench-adam-2gpu 240 torchrun --nproc-per-node 2 scripts/bench_streamed_adam.py \
          --params-b ${ADAM_PARAMS_B_2GPU-4} --moment-dtype fp32 --steps "${ADAM_STEPS:-2}" \
          ${ADAM_EXTRA:-} --disk-dir /tmp/adam_bench --json "$OUT_DIR/bench_streamed_adam_2gpu.json"
      fi ;;
    bench-fsdp)
      run_stage bench-fsdp-1gpu 240 torchrun --nproc-per-node 1 scripts/bench_fsdp_train.py \
        --iters "${FSDP_ITERS:-6}" --out "$OUT_DIR/bench_fsdp_1gpu.json"
      if [ "$NGPU" -ge 2 ]; then
        run_stage bench-fsdp-2gpu 240 torchrun --nproc-per-node 2 scripts/bench_fsdp_train.py \
          --iters "${FSDP_ITERS:-6}" --out "$OUT_DIR/bench_fsdp_2gpu.json"
      fi ;;
    bench-megatron)
      for n in ${MEGATRON_GPUS:-1 2}; do
        [ "$n" -le "$NGPU" ] || continue
        run_stage "bench-megatron-${n}gpu" 240 torchrun --nproc-per-node "$n" \
          scripts/bench_megatron_train.py --stack-dump-s 45 --tp "$n" \
          --out "$OUT_DIR/bench_megatron_${n}gpu.json"
      done ;;
    train-e2e)
      # miles train end to end (Ray, trainer, built-in engines on the GPUs); needs Ray installed
      if [ "$NGPU" -ge 2 ]; then
        e2e_default=fsdp-0.6b-colocate-2gpu,fsdp-0.6b-disagg-broadcast,megatron-0.6b-colocate-tp2
      else
        e2e_default=fsdp-tiny-colocate-1gpu,megatron-tiny-colocate-1gpu,fsdp-0.6b-colocate-1gpu
      fi
      run_stage train-e2e 900 python3 scripts/gpu_train_e2e.py --out "$OUT_DIR/train_e2e" \
        --cases "${E2E_CASES:-$e2e_default}" --rollouts "${E2E_ROLLOUTS:-3}" ;;
    bench-moe)
      run_stage bench-moe 240 python3 scripts/bench_fused_moe.py --out "$OUT_DIR/bench_fused_moe.json" ;;
    *)
      say "unknown stage '$stage'"; failed=$((failed + 1)) ;;
  esac
done
say "done: $failed stage(s) failed"
exit "$failed"
