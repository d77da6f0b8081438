#!/usr/bin/env bash
# Runs the transport benchmark (it builds nothing): cmesh actors over the UCX
# transport, CAF's TCP middleman and the raw UCX anchor, between two processes
# of this host, then prints the comparison table.
#
#   cmake --build build --target cmesh_bench_transport   # once
#   bench/transport/run.sh                               # from anywhere
#
# The raw UCX anchor (../shared/anchors/ucx.sh) needs ucx_perftest from
# ucx-utils: apt-get install -y ucx-utils. Without it the table shows n/a for
# the UCX columns. Knobs: see the header of bench_transport.cpp
# (CMESH_BENCH_LAT_ITERS, CMESH_BENCH_BW_MSGS, CMESH_BENCH_SPINS, ...).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
bin=build/bin/cmesh_bench_transport
if [ ! -x "$bin" ]; then
  echo "run.sh: $bin not found; build it first: cmake --build build --target cmesh_bench_transport" >&2
  exit 2
fi
command -v ucx_perftest >/dev/null || echo "run.sh: ucx_perftest missing (apt-get install -y ucx-utils): no raw UCX anchor" >&2
export UCX_WARN_UNUSED_ENV_VARS=${UCX_WARN_UNUSED_ENV_VARS:-n}
exec "$bin" "$@"
