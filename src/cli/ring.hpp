// The smoke job of `cmesh launch` before training exists: rank 0 sends a token
// around the ring of workers `laps` times; every rank reports when it has
// seen its share.
#pragma once

#include "transport/join.hpp"

#include <chrono>

namespace cmesh::cli {

/// Runs the ring on a joined mesh: starts the transport, passes the token
/// and reports "done" to the coordinator. Returns an error when the ring
/// breaks (a peer lost) or the deadline passes.
caf::error run_ring(joined_mesh& j, uint32_t laps, std::chrono::milliseconds timeout);

} // namespace cmesh::cli
