// cmesh: the command line of Candies Mesh.
#include "cli/checkpoint.hpp"
#include "cli/commands.hpp"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cstdlib>

namespace {

using cmesh::cli::job_options;

/// The checkpoint flags of a training job.
void add_durable_flags(CLI::App* cmd, job_options& job) {
  auto& d = job.supervise.durable;
  cmd->add_option("--checkpoint-dir", d.dir,
                  "write checkpoints here from the shadow (turns it on), every "
                  "--checkpoint-every steps and at the last step; one replica group writes "
                  "each, every rank of it its shard, so all ranks of a group must see the "
                  "directory");
  cmd->add_option("--checkpoint-shared", d.shared,
                  "a second tier (a parallel file system or an object-store mount): each "
                  "checkpoint is written here too, after the local one");
  cmd->add_option("--checkpoint-every", d.every, "steps between checkpoints (0: the last only)")
    ->capture_default_str();
  cmd->add_option("--checkpoint-seconds", d.seconds,
                  "also a checkpoint once this many seconds passed since the last one (the "
                  "ranks agree on the step in the commit vote; 0: off)")
    ->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--checkpoint-keep", d.keep_last, "retention: the newest N checkpoints")
    ->capture_default_str()->check(CLI::Range(size_t{1}, size_t{1000000}));
  cmd->add_option("--checkpoint-keep-every", d.keep_every,
                  "retention: also every checkpoint of a multiple of M steps (0: none)")
    ->capture_default_str();
  cmd->add_flag("--checkpointer", d.checkpointer,
                "the checkpoints are written by a `cmesh checkpointer` process (launch starts "
                "it), which the writing group's ranks stream their committed updates to, so "
                "the last committed step outlives every worker");
  cmd->add_option("--resume", d.resume,
                  "start from a checkpoint: a step directory, a directory of checkpoints (its "
                  "newest valid one), or latest (the newest valid one of --checkpoint-dir and "
                  "--checkpoint-shared; none yet: step 0); at any layout");
}

/// The flags of the job a coordinator, worker, launch or checkpointer runs.
void add_job_flags(CLI::App* cmd, job_options& job) {
  cmd->add_option("--job", job.job, "train (the built-in MoE workload) or ring (transport smoke)")
    ->capture_default_str()->check(CLI::IsMember({"train", "ring"}));
  cmd->add_option("--laps", job.laps, "ring laps of the smoke job")->capture_default_str();
  cmd->add_option("--timeout-s", job.timeout_s, "give up after this long")
    ->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--config", job.train.config_file, "TOML config of the run")
    ->check(CLI::ExistingFile);
  cmd->add_option("--data", job.train.data_file, "text file to train on (default: synthetic)")
    ->check(CLI::ExistingFile);
  cmd->add_option("--steps", job.train.steps, "steps to train (overrides the config)")
    ->check(CLI::PositiveNumber);
  cmd->add_option("--log-every", job.train.log_every, "progress line every K steps")
    ->check(CLI::PositiveNumber);
  cmd->add_flag("--exact", job.train.exact,
                "exact mode: fixed-point gradient sums, bit-identical across layouts");
  cmd->add_option("--verify-every", job.train.verify_every,
                  "compare the replica groups' weights and optimizer state (hashes in the "
                  "commit vote) at step 0 and every N steps; a group that differs is fenced "
                  "(0: off; default: the config's, 50)")
    ->check(CLI::NonNegativeNumber);
  cmd->add_option("--replicas", job.train.replicas, "replica groups (default: one per rank)")
    ->check(CLI::PositiveNumber);
  cmd->add_option("--device", job.train.device,
                  "where each rank computes: cpu, cuda (one GPU per rank; overrides the "
                  "config), or emulated (the device code path on the CPU, for tests)")
    ->check(CLI::IsMember({"cpu", "cuda", "emulated"}));
  cmd->add_flag("--shadow", job.supervise.shadow,
                "keep a checkpoint shadow of the rank's shard: a copy of its state that an "
                "actor brings to each committed step with the same optimizer");
  cmd->add_flag("--shadow-check", job.supervise.shadow_check,
                "--shadow, and compare the shadow with the trainer's state after every step "
                "(costs a hash of the state per step on both sides)");
  cmd->add_option("--catchup-nice", job.supervise.catchup_nice,
                  "nice value added to the threads serving or receiving a catch-up, so that "
                  "on a shared host it takes idle cores rather than the survivors' (0: off)")
    ->capture_default_str()->check(CLI::Range(0, 19));
  cmd->add_option("--step-timeout-ms", job.supervise.step_timeout_ms,
                  "step watchdog: a rank computing one step longer than this is hung and "
                  "ends itself (0: off)")
    ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{86400000}));
  add_durable_flags(cmd, job);
}

/// The coordinator's supervision flags (cmesh coordinator and launch).
void add_supervise_flags(CLI::App* cmd, job_options& job) {
  auto& f = job.supervise;
  cmd->add_option("--events", f.events, "JSON-lines event log of failures and recoveries "
                                        "(a file, or - for stdout)");
  cmd->add_option("--heartbeat-timeout-ms", f.heartbeat_timeout_ms,
                  "a worker silent this long is dead")
    ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{3600000}));
  cmd->add_option("--join-window-ms", f.join_window_ms,
                  "returning groups wait this long to join together")
    ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{3600000}));
  cmd->add_option("--min-replicas", f.min_replicas, "replica groups an epoch needs at least")
    ->capture_default_str()->check(CLI::Range(1u, 1u << 20));
  cmd->add_option("--quorum-wait-ms", f.quorum_wait_ms,
                  "a broken epoch that finds no quorum this long ends the job")
    ->capture_default_str()->check(CLI::Range(int64_t{1}, int64_t{86400000}));
  cmd->add_option("--broken-grace-ms", f.broken_grace_ms,
                  "a member's report that its step failed with every member alive waits this "
                  "long for a death to explain it, then the epoch is re-formed")
    ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{3600000}));
  cmd->add_option("--max-reforms", f.max_reforms,
                  "epochs re-formed in a row with no step committed before the job fails")
    ->capture_default_str()->check(CLI::Range(1u, 1000u));
}

/// cmesh launch's own: restarts and the chaos plan.
void add_launch_flags(CLI::App* launch, job_options& job) {
  launch->add_option("--restart-delay-ms", job.supervise.restart_delay_ms,
                     "a dead worker restarts after this long (a spare node)")
    ->capture_default_str()->check(CLI::Range(int64_t{0}, int64_t{3600000}));
  launch->add_option("--max-restarts", job.supervise.max_restarts, "restarts per rank")
    ->capture_default_str();
  launch->add_option("--chaos", job.supervise.chaos,
                     "faults to inject: kill@STEP:RANK, stop@STEP:RANK:MS, hang@STEP:RANK, "
                     "fault@STEP:RANK[:TIMES], kill-source@STEP, kill-all@STEP, corrupt@STEP, "
                     "kill-checkpointer@STEP (comma-separated; a '?' after "
                     "a kill, a stop or a hang skips it when its group is the last live one)");
  launch->add_option("--chaos-kills", job.supervise.chaos_kills,
                     "SIGKILLs of random ranks at random steps, drawn with --chaos-seed");
  launch->add_option("--chaos-faults", job.supervise.chaos_faults,
                     "steps of random ranks made to fail with every process alive (fault@), "
                     "at random steps, drawn with --chaos-seed");
  launch->add_option("--chaos-stops", job.supervise.chaos_stops,
                     "SIGSTOPs of random ranks at random steps, each from half a heartbeat "
                     "timeout (ridden out) to two (taken for a death), drawn with --chaos-seed");
  launch->add_option("--chaos-hangs", job.supervise.chaos_hangs,
                     "hangs of random ranks at random steps (hang@; the step watchdog, "
                     "--step-timeout-ms, ends each), drawn with --chaos-seed");
  launch->add_option("--chaos-seed", job.supervise.chaos_seed,
                     "seed of --chaos-kills, --chaos-faults, --chaos-stops and --chaos-hangs")
    ->capture_default_str();
  launch->add_option("--chaos-first-step", job.supervise.chaos_first_step,
                     "the random actions fall at this step or later")
    ->capture_default_str();

}

} // namespace

int main(int argc, char** argv) {
  using namespace cmesh::cli;
  spdlog::set_pattern("[%H:%M:%S.%e] [%^%l%$] [pid %P] %v");
  if (const char* lvl = std::getenv("CMESH_LOG_LEVEL"))
    spdlog::set_level(spdlog::level::from_str(lvl));

  CLI::App app{"Candies Mesh: a fault-tolerant training runtime"};
  app.require_subcommand(1);
  job_options job;
  std::string bind = "127.0.0.1";
  uint16_t port = 0;

  app.add_subcommand("version", "print the versions of cmesh and its libraries");

  auto* coord = app.add_subcommand("coordinator", "serve membership and bootstrap for N workers");
  coord->add_option("--bind", bind, "address to listen on")->capture_default_str();
  coord->add_option("--port", port, "port to listen on (0: any)")->capture_default_str();
  coord->add_option("-n,--world-size", job.world_size, "number of workers")
    ->required()->check(CLI::Range(1u, 1u << 20));

  add_job_flags(coord, job); // the job it supervises (train: epochs, retries, catch-up)
  add_supervise_flags(coord, job);

  auto* worker = app.add_subcommand(
    "worker", "one rank; rank and size from OMPI_COMM_WORLD_*, SLURM_* or CMESH_*, "
              "the coordinator from CMESH_COORDINATOR=host:port");
  add_job_flags(worker, job);

  auto* launch = app.add_subcommand("launch", "a coordinator and N workers on this machine");
  launch->add_option("-n,--world-size", job.world_size, "number of workers")
    ->required()->check(CLI::Range(1u, 256u));
  add_job_flags(launch, job);
  add_supervise_flags(launch, job);
  add_launch_flags(launch, job);

  std::string checkpointer_at;
  auto* checkpointer = app.add_subcommand(
    "checkpointer", "a job's checkpoint shadows in a process of their own: the writing "
                    "group's ranks stream their shards to it (see --checkpointer)");
  checkpointer->add_option("-n,--world-size", job.world_size, "the job's number of workers")
    ->required()->check(CLI::Range(1u, 1u << 20));
  checkpointer->add_option("--coordinator", checkpointer_at,
                           "the job's coordinator, HOST:PORT (default: CMESH_COORDINATOR)");
  add_job_flags(checkpointer, job);

  checkpoint_args ckpt;
  auto* checkpoint = add_checkpoint_command(app, ckpt);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    fmt::print(stderr, "cmesh: error: {} (see cmesh --help)\n", e.what());
    return 2;
  }
  if (app.got_subcommand("version"))
    return run_version();
  if (app.got_subcommand(coord))
    return run_coordinator(bind, port, job);
  if (app.got_subcommand(worker))
    return run_worker(job);
  if (app.got_subcommand(launch))
    return run_launch(job);
  if (app.got_subcommand(checkpointer))
    return run_checkpointer(job, checkpointer_at);
  if (app.got_subcommand(checkpoint))
    return run_checkpoint(ckpt);
  return 2;
}
