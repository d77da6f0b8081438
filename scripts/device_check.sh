#!/usr/bin/env bash
# The checks that need a GPU: builds with CUDA and NCCL into build-gpu/, runs
# the kernels and NCCL unit tests, then the multi-process NCCL tests
# (src/collectives/nccl/mp_nccl.test.cpp: 2-4 ranks sharing the GPU, a
# SIGKILLed rank then shrink/re-init, abort, the wrapper's overhead).
# Unattended, in well under 8 minutes on a 16-core machine with one GPU.
#
#   scripts/device_check.sh [OUT_DIR]        (default ./device-out)
#
# Every step's output is shown and kept in OUT_DIR/<step>.log; OUT_DIR/summary.txt
# has the verdicts and the interesting numbers. Exit status: 0 when every step
# passed (and the GPU was really used), 1 otherwise.
#
# Environment: CMESH_DEVICE_CHECK_BUDGET (seconds, default 450) bounds the
# whole run: each step's limit is cut to what is left, and a step with less
# than 20 s left is skipped (and counts as a failure).
# CMESH_DEVICE_CHECK_FULL_BUILD=1 builds every target (slower), NCCL_DEBUG=INFO
# makes NCCL verbose in the multi-process test, CMESH_SEED replays a seed,
# JOBS overrides -j16.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-./device-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUILD=build-gpu
JOBS=${JOBS:-16}
DEADLINE=$((SECONDS + ${CMESH_DEVICE_CHECK_BUDGET:-450}))
: >"$OUT/summary.txt"
failed=0

log() { echo "[device_check $(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }

# step NAME SECONDS CMD...: runs CMD under a time limit, output to the
# console and OUT/NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 20 ]; then
    log "skip $name: the time budget is spent"
    failed=1
    return 125
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  log "start $name (limit ${limit} s): $*"
  local t0=$SECONDS
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  local verdict=ok
  if [ "$rc" -ne 0 ]; then
    verdict="FAILED rc=$rc"
    [ "$rc" -eq 124 ] && verdict="TIMED OUT"
    failed=1
  fi
  log "end $name: $verdict after $((SECONDS - t0)) s"
  return "$rc"
}

environment() {
  date -u
  uname -a
  nproc
  nvidia-smi || echo "nvidia-smi: not available"
  /usr/local/cuda/bin/nvcc --version || true
  grep -E '^#define NCCL_(MAJOR|MINOR|PATCH)' /usr/local/cuda/include/nccl.h || true
  ls -l /usr/local/cuda/lib64/libnccl* 2>/dev/null || true
  env | grep -E '^(CUDA|NCCL|CMESH)_' || true
}

export -f environment
step environment 30 bash -c environment

if step configure 90 cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release; then
  if ! grep -q 'CMESH_WITH_CUDA:BOOL=ON' "$BUILD/CMakeCache.txt" \
     || ! grep -q 'cmesh: CUDA kernels ON, NCCL backend ON' "$OUT/configure.log"; then
    log "configure: CUDA or NCCL not found; the GPU checks cannot run"
    failed=1
  fi
  if [ "${CMESH_DEVICE_CHECK_FULL_BUILD:-0}" = 1 ]; then
    step build 330 cmake --build "$BUILD" -j"$JOBS"
  else
    step build 270 cmake --build "$BUILD" -j"$JOBS" --target \
      test_kernels test_collectives_nccl cmesh_test_nccl test_mp_nccl test_model cmesh
  fi
  build_rc=$?

  if [ "$build_rc" -eq 0 ]; then
    # One process, one GPU: the kernels and the NCCL wrapper.
    step unit_tests 90 ctest --test-dir "$BUILD" -R '^(kernels|collectives_nccl)$' \
      --output-on-failure -V
    # Several processes sharing the GPU.
    step mp_nccl 300 ctest --test-dir "$BUILD" -R '^mp_nccl$' --output-on-failure -V
    # The model on the GPU against the CPU model, then a short training run
    # with --device cuda beside the same run on the CPU.
    step model_gpu 60 "$BUILD/src/test_model" -tc='*GPU*,*device code path*'
    step train_cuda 90 "$BUILD/bin/cmesh" launch -n 2 --device cuda --steps 60 --log-every 20
    step train_cpu 90 "$BUILD/bin/cmesh" launch -n 2 --steps 60 --log-every 20
  fi
  cp -f "$BUILD/Testing/Temporary/LastTest.log" "$OUT/ctest-LastTest.log" 2>/dev/null || true
fi

# A GPU machine must not skip: that would mean the device was not seen.
if grep -h "skipped: no CUDA device\|skipped: invalid_argument" "$OUT"/unit_tests.log "$OUT"/mp_nccl.log \
   "$OUT"/model_gpu.log >/dev/null 2>&1; then
  log "FAIL: tests skipped for lack of a CUDA device:"
  grep -h -m3 "skipped: no CUDA device" "$OUT"/unit_tests.log "$OUT"/mp_nccl.log \
    | tee -a "$OUT/summary.txt"
  failed=1
fi

{
  echo "---- results"
  grep -hE "^(\s*[0-9]+/[0-9]+ Test|[0-9]+% tests passed|The following tests FAILED)" \
    "$OUT"/unit_tests.log "$OUT"/mp_nccl.log 2>/dev/null
  grep -hE "test cases:|assertions:" "$OUT"/unit_tests.log "$OUT"/mp_nccl.log 2>/dev/null
  echo "---- measurements"
  grep -hE "MESSAGE: (accelerators|aborted after|abort_all|init without|abort returned|rank [0-9]|all_reduce of|[0-9] ranks:|seed|GPU against)" \
    "$OUT"/unit_tests.log "$OUT"/mp_nccl.log "$OUT"/model_gpu.log 2>/dev/null | sed 's/^.*MESSAGE: //'
  echo "---- training, --device cuda then cpu (2 ranks)"
  grep -hE "^step|summary" "$OUT"/train_cuda.log "$OUT"/train_cpu.log 2>/dev/null
  echo "---- failures"
  grep -hE "ERROR:|FATAL|fatal|FAIL" "$OUT"/unit_tests.log "$OUT"/mp_nccl.log 2>/dev/null | head -40
} >>"$OUT/summary.txt"

if [ "$failed" -eq 0 ]; then
  log "device check PASSED (logs in $OUT)"
else
  log "device check FAILED (logs in $OUT)"
fi
exit "$failed"
