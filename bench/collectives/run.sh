#!/usr/bin/env bash
# Runs the collectives benchmark (it builds nothing): the host backend's
# all_reduce between two processes of this host against OpenMPI, Gloo and
# memcpy, then the rebuild time after a rank is SIGKILLed, and prints the
# comparison tables. About 1.5 to 3 minutes on a 2-core machine.
#
#   cmake --build build --target cmesh_bench_collectives   # once
#   bench/collectives/run.sh [OPTIONS]                     # from anywhere
#
# The anchors (../shared/anchors/run.sh from the repo root: OpenMPI's
# MPI_Allreduce and Gloo's ring) are built by that script each time and need
#   apt-get install -y libopenmpi-dev openmpi-bin libgloo-dev
# Without them the table shows n/a in their columns. Options: see the header
# of bench_collectives.cpp (--anchors PATH, --no-anchors, --rounds N,
# --chunks 256K,512K,1M,2M, --small-max BYTES, --spin N, --phases, --reps N,
# --no-rebuild, --verbose).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
bin=build/bin/cmesh_bench_collectives
if [ ! -x "$bin" ]; then
  echo "run.sh: $bin not found; build it first: cmake --build build --target cmesh_bench_collectives" >&2
  exit 2
fi
for tool in mpicc mpirun; do
  command -v "$tool" >/dev/null || echo "run.sh: $tool missing (apt-get install -y libopenmpi-dev openmpi-bin): no OpenMPI anchor" >&2
done
[ -e /usr/include/gloo/allreduce_ring_chunked.h ] || echo "run.sh: Gloo headers missing (apt-get install -y libgloo-dev): no Gloo anchor" >&2
export UCX_WARN_UNUSED_ENV_VARS=${UCX_WARN_UNUSED_ENV_VARS:-n}
exec "$bin" "$@"
