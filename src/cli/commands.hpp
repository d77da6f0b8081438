// The subcommands of `cmesh`. Each returns the process exit code:
// 0 success, 1 job failure, 2 usage error, 3 environment / unreachable.
#pragma once

#include "cli/train.hpp"

#include <cstdint>
#include <string>

namespace cmesh::cli {

struct job_options {
  uint32_t world_size = 1;
  std::string job = "train";  // "train" or "ring" (the transport smoke job)
  uint32_t laps = 3;          // ring laps of the smoke job
  int64_t timeout_s = 1800;   // whole job
  train_flags train;
};

/// The worker's command line for a job (what `launch` passes on).
std::vector<std::string> worker_args(const job_options& job);

int run_version();
int run_coordinator(const std::string& bind, uint16_t port, const job_options& job);
int run_worker(const job_options& job);
int run_launch(const job_options& job);

} // namespace cmesh::cli
