// The training job of `cmesh worker` / `cmesh launch`: the built-in MoE
// workload under HSDP, with a progress line every log_every steps.
#pragma once

#include "cli/durable.hpp"
#include "model/config.hpp"
#include "transport/join.hpp"

#include <chrono>
#include <optional>
#include <string>

namespace cmesh::cli {

struct train_flags {
  std::string config_file;           // TOML; empty: defaults
  std::string data_file;             // overrides [data] file
  std::optional<size_t> steps;       // overrides [train] steps
  std::optional<size_t> log_every;   // overrides [train] log_every
  bool exact = false;                // forces [train] exact = true
  size_t replicas = 0;               // 0: one group per rank
  std::string device;                // overrides [train] device ("cpu" or "cuda")
  std::optional<size_t> verify_every; // overrides [train] verify_every
};

/// Reads the config and applies the flags. Errors: invalid_argument.
/// `check_device`: --device cuda needs a GPU here (a coordinator, which
/// computes nothing, passes false).
expected<model::run_config> resolve_config(const train_flags& f, size_t world_size,
                                           bool check_device = true);

/// Whether the flags say anything about the job's configuration: --config,
/// or a flag that changes what it computes (--log-every does not).
inline bool has_job_flags(const train_flags& f) {
  return !f.config_file.empty() || !f.data_file.empty() || f.steps || f.exact || f.replicas != 0
         || !f.device.empty() || f.verify_every;
}

/// The job's canonical configuration (model::canonical_config) of a
/// resolved config on `world_size` ranks. Error: invalid_argument.
expected<config_list> job_config_of(const model::run_config& c, const train_flags& f,
                                    size_t world_size);

/// The replica groups R of a run: --replicas, or one per rank.
inline size_t replica_groups(const train_flags& f, size_t world_size) {
  return f.replicas == 0 ? world_size : f.replicas;
}

/// The ranks of each replica group S (a layout resolve_config accepted).
inline size_t ranks_per_group(const train_flags& f, size_t world_size) {
  return world_size / replica_groups(f, world_size);
}

/// The checkpoint shadow of a worker (actors/checkpoint.hpp), what it
/// writes, and where the run resumes from (cli/durable.hpp).
struct shadow_flags {
  bool on = false;
  bool check = false; // compared with the trainer's state after every step
  durable_flags durable;
  config_list config;               // the job's: written into each checkpoint
  std::optional<resume_point> resume; // found by find_resume before the mesh joined
};

/// Runs the trainer of this rank on a joined mesh with a config from
/// resolve_config, under the coordinator's supervision (epochs, retries,
/// catch-up), reports "done" (or "failed", "fenced") to the coordinator and
/// waits for its shutdown. Returns the exit code: the shutdown's, or
/// exit_fenced when this incarnation was left out of an epoch.
expected<int> run_training(joined_mesh& j, const model::run_config& config, size_t replicas,
                           std::chrono::seconds timeout,
                           std::chrono::milliseconds step_timeout = std::chrono::milliseconds(0),
                           int catchup_nice = 0, const shadow_flags& shadow = {});

/// Exit code of a worker fenced out of the job (it may be restarted).
constexpr int exit_fenced = 4;

} // namespace cmesh::cli
