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
# JOBS overrides -j16. CMESH_DEVICE_CHECK_STEPS="mp_nccl mp_nccl_alt ..." runs only
# those checks (set-up steps always run); CMESH_DEVICE_CHECK_TC is a doctest
# test-case filter for the NCCL tests.
# CMESH_DEVICE_PREBUILT=ARCHIVE (made by scripts/device_pack.sh on a machine
# with the build's packages) skips configure and build: the archive is
# unpacked and its binaries run against this machine's CUDA runtime and NCCL,
# found in /usr/local/cuda or, failing that, in Python's nvidia-* packages.
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
  if [ -n "${CMESH_DEVICE_CHECK_STEPS:-}" ] && [[ " environment configure build unpack libraries $CMESH_DEVICE_CHECK_STEPS " != *" $name "* ]]; then
    return 0
  fi
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

# A model large enough for the GPU's rate to show (the default one trains in
# seconds on two CPU cores): tokens/s on the GPU beside this machine's CPUs.
cat >"$OUT/big.toml" <<'TOML'
[model]
d_model = 256
context = 8
layers = 4
ffn = 1024
experts = 8
top_k = 2
expert_ffn = 512
[train]
global_batch = 64
micro_batch = 16
seq_len = 128
log_every = 5
TOML

# The checks themselves, on binaries in $BINS (CMESH_BIN_DIR for the tests
# that spawn workers).
checks() {
  export CMESH_BIN_DIR=$BINS UCX_WARN_UNUSED_ENV_VARS=n
  # One process, one GPU: the kernels and the NCCL wrapper.
  step kernels 90 "$BINS/test_kernels"
  local tc=()
  [ -n "${CMESH_DEVICE_CHECK_TC:-}" ] && tc=("-tc=$CMESH_DEVICE_CHECK_TC")
  step collectives_nccl 90 "$BINS/test_collectives_nccl" "${tc[@]}"
  # Several processes sharing the GPU, with the NCCL found first and, where
  # this machine has another that differs in ncclCommRevoke, with that one.
  step mp_nccl 150 "$BINS/test_mp_nccl" "${tc[@]}"
  if [ -n "${ALT_NCCL_DIR:-}" ]; then
    step collectives_nccl_alt 90 env LD_LIBRARY_PATH="$ALT_NCCL_DIR:$LD_LIBRARY_PATH" \
      "$BINS/test_collectives_nccl" "${tc[@]}"
    step mp_nccl_alt 120 env LD_LIBRARY_PATH="$ALT_NCCL_DIR:$LD_LIBRARY_PATH" "$BINS/test_mp_nccl" "${tc[@]}"
  fi
  # The model on the GPU against the CPU model, then short training runs
  # with --device cuda beside the same runs on the CPU.
  step model_gpu 60 "$BINS/test_model" -tc='*GPU*,*device code path*'
  step train_cuda1 90 "$BINS/cmesh" launch -n 1 --device cuda --steps 60 --log-every 20
  step train_cuda 90 "$BINS/cmesh" launch -n 2 --device cuda --steps 60 --log-every 20
  step train_cpu 90 "$BINS/cmesh" launch -n 2 --steps 60 --log-every 20
  # The same two ranks with the gradient summed on the host (the path
  # before NCCL summed it), then a kill: the survivors' epoch and the grown
  # one each build their NCCL communicator, the dead epoch's is aborted.
  printf '[train]\ngradient_collectives = "host"\n' >"$OUT/host_sum.toml"
  step train_cuda_hostsum 90 "$BINS/cmesh" launch -n 2 --device cuda --steps 60 --log-every 20 \
    --config "$OUT/host_sum.toml"
  step train_cuda_kill 120 "$BINS/cmesh" launch -n 3 --device cuda --steps 100 --log-every 20 \
    --restart-delay-ms 200 --chaos kill@10:1 --events "$OUT/kill_events.jsonl"
  step train_cuda_big 90 "$BINS/cmesh" launch -n 1 --device cuda --config "$OUT/big.toml" --steps 30
  step train_cpu_big 90 "$BINS/cmesh" launch -n 1 --config "$OUT/big.toml" --steps 3
  # bf16 on the GPU: tensor-core products (model.products "auto") against
  # the same run multiplying in fp32.
  { cat "$OUT/big.toml"; printf 'precision = "bf16"\n'; } >"$OUT/big_bf16.toml"
  sed 's/^\[model\]$/[model]\nproducts = "fp32"/' "$OUT/big_bf16.toml" >"$OUT/big_bf16_fp32.toml"
  step train_cuda_big_bf16 90 "$BINS/cmesh" launch -n 1 --device cuda --config "$OUT/big_bf16.toml" \
    --steps 30
  step train_cuda_big_bf16_fp32 90 "$BINS/cmesh" launch -n 1 --device cuda \
    --config "$OUT/big_bf16_fp32.toml" --steps 30
  # The catch-up's rate and the survivors' stall on a machine with cores to
  # spare (this one's CPUs, the GPU unused): the serving thread and the
  # joiner each get a core beside the trainers', which the 2-core machines
  # the benchmark otherwise runs on cannot give them.
  if [ -x "$BINS/cmesh_bench_recovery" ]; then
    step recovery_cores 200 "$BINS/cmesh_bench_recovery" --catchup-only --quick
  fi
}

# Every NCCL library on this machine: path, version, and whether it has
# ncclCommRevoke and ncclCommShrink (the backend looks both up at run time).
nccl_candidates() {
  { ls /usr/local/cuda/lib64/libnccl.so.2 /usr/local/cuda/lib/libnccl.so.2 \
       /usr/lib/x86_64-linux-gnu/libnccl.so.2 2>/dev/null
    find /opt /usr/lib /usr/local /root -name libnccl.so.2 -path '*nvidia*' 2>/dev/null
  } | xargs -r readlink -f | sort -u | while read -r l; do
    python3 -c 'import ctypes, sys
l = ctypes.CDLL(sys.argv[1]); v = ctypes.c_int(); l.ncclGetVersion(ctypes.byref(v))
print(sys.argv[1], v.value, "revoke" if hasattr(l, "ncclCommRevoke") else "no-revoke",
      "shrink" if hasattr(l, "ncclCommShrink") else "no-shrink")' "$l" 2>/dev/null \
      || echo "$l unreadable"
  done
}

# Where this machine keeps a library: CUDA's directory, the loader's cache,
# then Python's nvidia-* packages (PyTorch's wheels bring NCCL and cuBLAS).
find_lib() {
  local d
  for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu; do
    [ -e "$d/$1" ] && { echo "$d"; return 0; }
  done
  d=$(ldconfig -p 2>/dev/null | awk -v n="$1" '$1 == n {print $NF; exit}')
  [ -n "$d" ] && { dirname "$d"; return 0; }
  d=$(find /opt /usr /root -name "$1" -path '*nvidia*' 2>/dev/null | head -1)
  [ -n "$d" ] && { dirname "$d"; return 0; }
  return 1
}

if [ -n "${CMESH_DEVICE_PREBUILT:-}" ]; then
  PACK=$(mktemp -d)
  if step unpack 60 tar -C "$PACK" -xJf "$CMESH_DEVICE_PREBUILT"; then
    BINS=$PACK/cmesh-gpu/bin
    log "prebuilt binaries of commit $(cat "$PACK/cmesh-gpu/COMMIT")"
    libpath=$PACK/cmesh-gpu/lib
    for l in libcudart.so.13 libnccl.so.2 libcublas.so.13 libcublasLt.so.13; do
      if d=$(find_lib "$l"); then
        log "$l from $d"
        case ":$libpath:" in *":$d:"*) ;; *) libpath=$libpath:$d ;; esac
      else
        log "$l: not found on this machine"
        failed=1
      fi
    done
    # The C++ runtime travels too, used only where this machine's is older.
    sys_cxx=$(ldconfig -p 2>/dev/null | awk '$1 == "libstdc++.so.6" {print $NF; exit}')
    if [ -z "$sys_cxx" ] || ! grep -q GLIBCXX_3.4.30 "$sys_cxx"; then
      log "libstdc++: this machine's (${sys_cxx:-none}) is older than the build's; using the packed one"
      libpath=$PACK/cmesh-gpu/cxx:$libpath
    fi
    export LD_LIBRARY_PATH=$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export UCX_MODULE_DIR=$PACK/cmesh-gpu/ucx
    nccl_candidates >"$OUT/nccl_libraries.txt"
    log "NCCL libraries here (path, version, revoke, shrink):"
    tee -a "$OUT/summary.txt" <"$OUT/nccl_libraries.txt"
    if nccl_dir=$(find_lib libnccl.so.2); then
      first=$(readlink -f "$nccl_dir/libnccl.so.2")
      first_kind=$(awk -v p="$first" '$1 == p {print $3}' "$OUT/nccl_libraries.txt")
      alt=$(awk -v p="$first" -v k="$first_kind" '$1 != p && $3 != k && $3 != "" {print $1; exit}' \
        "$OUT/nccl_libraries.txt")
      if [ -n "$alt" ]; then
        ALT_NCCL_DIR=$(dirname "$alt")
        log "mp_nccl runs with $first ($first_kind), then again with $alt"
      fi
    fi
    step libraries 30 bash -c 'for b in "$1"/*; do echo "== $b"; ldd "$b"; done' _ "$BINS"
    if grep -q "not found" "$OUT/libraries.log"; then
      log "libraries: some are missing (libraries.log)"
      failed=1
    fi
    checks
  fi
elif step configure 90 cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release; then
  if ! grep -q 'CMESH_WITH_CUDA:BOOL=ON' "$BUILD/CMakeCache.txt" \
     || ! grep -q 'cmesh: CUDA kernels ON, NCCL backend ON' "$OUT/configure.log"; then
    log "configure: CUDA or NCCL not found; the GPU checks cannot run"
    failed=1
  fi
  if [ "${CMESH_DEVICE_CHECK_FULL_BUILD:-0}" = 1 ]; then
    step build 330 cmake --build "$BUILD" -j"$JOBS"
  else
    step build 270 cmake --build "$BUILD" -j"$JOBS" --target \
      test_kernels test_collectives_nccl cmesh_test_nccl test_mp_nccl test_model cmesh \
      cmesh_bench_recovery
  fi
  if [ $? -eq 0 ]; then
    mkdir -p "$BUILD/gpu-bin"
    for b in src/kernels/test_kernels src/test_collectives_nccl src/test_mp_nccl src/test_model \
             bin/cmesh bin/cmesh_test_nccl bin/cmesh_bench_recovery; do
      ln -sf "$(pwd)/$BUILD/$b" "$BUILD/gpu-bin/"
    done
    BINS=$(pwd)/$BUILD/gpu-bin
    checks
  fi
fi

# A GPU machine must not skip: that would mean the device was not seen.
gpu_logs=("$OUT"/kernels.log "$OUT"/collectives_nccl.log "$OUT"/mp_nccl.log
          "$OUT"/collectives_nccl_alt.log "$OUT"/mp_nccl_alt.log
          "$OUT"/model_gpu.log)
if grep -h "skipped: no CUDA device\|skipped: invalid_argument" "${gpu_logs[@]}" >/dev/null 2>&1; then
  log "FAIL: tests skipped for lack of a CUDA device:"
  grep -h -m3 "skipped: no CUDA device" "${gpu_logs[@]}" 2>/dev/null | tee -a "$OUT/summary.txt"
  failed=1
fi

{
  echo "---- results"
  for l in "${gpu_logs[@]}"; do
    [ -e "$l" ] && echo "$(basename "$l" .log): $(grep -hE "test cases:" "$l")"
  done
  echo "---- measurements"
  grep -hE "MESSAGE: (accelerators|aborted \(|abort_all|init without|abort returned|rank [0-9]|all_reduce of|[0-9] ranks:|seed|GPU against)" \
    "${gpu_logs[@]}" 2>/dev/null | sed 's/^.*MESSAGE: //' | grep -v "^seed"
  grep -h "the loaded NCCL" "${gpu_logs[@]}" 2>/dev/null | sed 's/^.*\] //' | sort -u
  for t in train_cuda1 train_cuda train_cpu train_cuda_hostsum train_cuda_kill train_cuda_big \
           train_cpu_big train_cuda_big_bf16 train_cuda_big_bf16_fp32; do
    echo "---- $t"
    grep -hE "^step|summary|cmesh: training|committed step|lost|device communicator|summed on the device" \
      "$OUT/$t.log" 2>/dev/null | sed 's/^\[[^]]*\] \[info\] //'
  done
  echo "---- recovery_cores"
  grep -hE "^#|^\|" "$OUT/recovery_cores.log" 2>/dev/null
  echo "---- failures"
  grep -hE "ERROR:|FATAL|fatal|FAIL|symbol lookup|rebuilt .*\(ok" "${gpu_logs[@]}" 2>/dev/null | head -40
} >>"$OUT/summary.txt"

if [ "$failed" -eq 0 ]; then
  log "device check PASSED (logs in $OUT)"
else
  log "device check FAILED (logs in $OUT)"
fi
exit "$failed"
