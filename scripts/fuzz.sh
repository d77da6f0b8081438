#!/usr/bin/env bash
# Builds the libFuzzer target for the frame decoder with clang and runs it
# for a while (default 30 s). Usage: scripts/fuzz.sh [seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-30}
if ! command -v clang++ >/dev/null; then
  echo "fuzz: clang++ is not installed; skipped"
  exit 0
fi
CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMESH_FUZZ=ON -DCMESH_WITH_CUDA=OFF -DCMESH_BENCH=OFF -DBUILD_TESTING=OFF >/dev/null
cmake --build build-fuzz -j"$(nproc)" --target fuzz_wire
mkdir -p build-fuzz/corpus
seed=${CMESH_SEED:-$RANDOM}
echo "fuzz: seed $seed, ${secs} s"
UCX_WARN_UNUSED_ENV_VARS=n build-fuzz/tests/fuzz/fuzz_wire -seed="$seed" -max_total_time="$secs" \
  -max_len=4096 build-fuzz/corpus
