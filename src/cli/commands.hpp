// The subcommands of `cmesh`. Each returns the process exit code:
// 0 success, 1 job failure, 2 usage error, 3 environment / unreachable.
#pragma once

#include "cli/train.hpp"

#include <cstdint>
#include <string>

namespace cmesh::cli {

/// Supervision of a training job (coordinator and launch).
struct supervise_flags {
  std::string events;               // JSON-lines event log ("-": stdout)
  int64_t heartbeat_timeout_ms = 1500;
  int64_t join_window_ms = 500;
  uint32_t min_replicas = 1;
  int64_t quorum_wait_ms = 120000;  // a broken epoch without quorum this long fails the job
  int64_t broken_grace_ms = 200;    // a member's report of a broken epoch, before a re-form
  uint32_t max_reforms = 3;         // re-forms in a row with no commit before the job fails
  int64_t step_timeout_ms = 300000; // worker: the step watchdog (0: off)
  int catchup_nice = 0;              // worker: nice added to its catch-up threads
  bool shadow = false;               // worker: a checkpoint shadow of its shard
  bool shadow_check = false;         // worker: ... compared with the trainer every step
  durable_flags durable;             // worker: checkpoints written and resumed from
  int64_t restart_delay_ms = 1000;  // launch: before a dead worker is restarted
  uint32_t max_restarts = 3;        // launch: per rank
  std::string chaos;                // launch: a chaos plan (chaos/plan.hpp)
  size_t chaos_kills = 0;           // launch: random kills ...
  size_t chaos_faults = 0;          // ... and faults (a step failing, nobody dying) ...
  size_t chaos_stops = 0;           // ... and SIGSTOPs of 0.5 to 2 heartbeat timeouts ...
  size_t chaos_hangs = 0;           // ... and hangs (for the step watchdog) ...
  uint64_t chaos_seed = 1;          // ... drawn with this seed
  uint64_t chaos_first_step = 2;    // ... at this step or later
};

struct job_options {
  uint32_t world_size = 1;
  std::string job = "train";  // "train" or "ring" (the transport smoke job)
  uint32_t laps = 3;          // ring laps of the smoke job
  int64_t timeout_s = 1800;   // whole job
  train_flags train;
  supervise_flags supervise;
};

/// The worker's command line for a job (what `launch` passes on).
std::vector<std::string> worker_args(const job_options& job);

int run_version();
int run_coordinator(const std::string& bind, uint16_t port, const job_options& job);
int run_worker(const job_options& job);
int run_launch(const job_options& job);
/// `cmesh checkpointer`: the job's checkpoint shadows in a process of their
/// own (actors/checkpointer.hpp), until SIGTERM or the coordinator's end;
/// then the newest whole step is written. `coordinator`: empty for
/// CMESH_COORDINATOR.
int run_checkpointer(const job_options& job, const std::string& coordinator);

} // namespace cmesh::cli
