#!/usr/bin/env bash
# Builds (if needed) and runs the test suite; the multi-process tests run one
# at a time, the rest in parallel. Extra arguments go to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f build/CMakeCache.txt ] || cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j"$(nproc)"
ctest --test-dir build --output-on-failure -j"$(nproc)" "$@"
