#!/usr/bin/env bash
# Runs the training benchmark (it builds nothing): `cmesh launch` of the
# built-in model at 1x1, 2x1 and 2x2, the step's matrix products against
# OpenBLAS's sgemm alone, and peak memory per rank at 1x1 and 1x2, then prints
# the tables. Under a minute on an idle 2-core machine.
#   --activations-only: bf16 against fp32 activations, in this process.
#   --verify-only: the step time by --verify-every at 2x1.
#   --durable-only: at 2x1, the step time with durable checkpointing off, the
#     shadow alone (--shadow), a local tier (--checkpoint-dir) and a shared one
#     too (--checkpoint-shared), on the default model and a 26.5 M-parameter
#     one, with the checkpoints written and skipped; a checkpoint's bytes and
#     what resuming from it adds to a run's start. About 6-8 minutes on 2 cores;
#     it writes (and removes) up to ~2 GB under /tmp.
#
#   cmake --build build --target cmesh_bench_train   # once (builds cmesh too)
#   bench/train/run.sh [--steps N] [--warmup N] [--quick] [--activations-only] [--verify-only]
#                      [--durable-only]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
bin=build/bin/cmesh_bench_train
if [ ! -x "$bin" ]; then
  echo "run.sh: $bin not found; build it first: cmake --build build --target cmesh_bench_train" >&2
  exit 2
fi
export UCX_WARN_UNUSED_ENV_VARS=${UCX_WARN_UNUSED_ENV_VARS:-n}
exec "$bin" "$@"
