// Joining the mesh: what every worker process does before its actors can
// talk. Reads rank and size from the launcher's environment, creates the
// transport, registers with the coordinator (CMESH_COORDINATOR) and connects
// the endpoints of the peer table it gets back.
#pragma once

#include "core/env.hpp"
#include "core/error.hpp"
#include "core/job_config.hpp"
#include "transport/bootstrap.hpp"
#include "transport/transport.hpp"

#include <chrono>
#include <memory>
#include <optional>
#include <string>

namespace cmesh {

struct join_options {
  std::optional<host_port> coordinator; // default: CMESH_COORDINATOR
  std::optional<launch_env> place;      // default: read_launch_env()
  int64_t connect_timeout_ms = 10000;   // to reach the coordinator (CMESH_CONNECT_TIMEOUT_MS)
  int64_t register_timeout_ms = 60000;  // for every rank to register (CMESH_REGISTER_TIMEOUT_MS)
  uint64_t incarnation = 0;             // 0: the wall clock in ns (grows across restarts)
  transport_options transport;
  /// Connect the transport's endpoints to the whole peer table. The
  /// training job does not: a restarted rank must not dial the dead
  /// addresses in the table, so its supervisor dials each epoch's members
  /// as they come (transport::connect_peer, entries_to_dial).
  bool connect_transport = true;
  /// The job configuration this worker runs (model::canonical_config),
  /// sent with its registration (and every registration again after a
  /// coordinator restart): the coordinator refuses a worker whose
  /// configuration differs from the job's. Empty: not checked.
  config_list config;
};

struct joined_mesh {
  launch_env place;
  uint64_t incarnation = 0;       // this process's, as registered
  wire::register_worker registration; // what it registered with
  host_port coordinator_address;
  std::unique_ptr<transport> net; // connected, not started
  coordinator_client coordinator;
  wire::peer_table table;
};

/// Errors: invalid_argument (bad environment), unreachable (coordinator),
/// timeout, transport_failure.
expected<joined_mesh> join_mesh(join_options opts);

/// A rank at an incarnation (0: whichever the peer table holds).
struct rank_incarnation {
  uint32_t rank = 0;
  uint64_t incarnation = 0;
};

/// The entries of `table` to dial for `wanted`: each one's entry when the
/// table holds that incarnation (or any, for 0), never `self`'s, ascending
/// by rank. A rank whose entry is of another incarnation (the table is
/// older or newer than what asked for it) is left out: nobody dials the
/// dead, and a newer table brings the newer entry.
std::vector<wire::peer_entry> entries_to_dial(const wire::peer_table& table,
                                              const std::vector<rank_incarnation>& wanted,
                                              uint32_t self);

} // namespace cmesh
