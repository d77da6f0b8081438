#!/usr/bin/env bash
# Runs the storage benchmark (it builds nothing): checkpoint writes against
# `dd conv=fsync` of the same bytes, and checkpoint loads against read(2)
# and cat of the shard files, cold and warm, for the default model's state,
# 2.5M and 25M parameters at 1 and 2 shard files, then prints the tables.
# Its files go to a directory under DIR (default /tmp) and are removed.
# About a minute on an idle 2-core machine with a local disk; --quick (the
# two smaller states, 2 repetitions) in seconds.
#
#   cmake --build build --target cmesh_bench_storage   # once
#   bench/storage/run.sh [--dir DIR] [--reps N] [--quick] [--verbose]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
bin=build/bin/cmesh_bench_storage
if [ ! -x "$bin" ]; then
  echo "run.sh: $bin not found; build it first: cmake --build build --target cmesh_bench_storage" >&2
  exit 2
fi
exec "$bin" "$@"
