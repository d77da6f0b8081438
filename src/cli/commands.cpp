#include "cli/commands.hpp"

#include "actors/checkpoint.hpp"
#include "actors/supervisor.hpp"
#include "actors/epoch_manager.hpp"
#include "chaos/plan.hpp"
#include "cli/ring.hpp"
#include "cli/train.hpp"
#include "core/env.hpp"
#include "core/process.hpp"
#include "kernels/device.hpp"
#include "model/moe_lm.hpp"
#include "transport/bootstrap.hpp"
#include "transport/join.hpp"

#include <caf/config.hpp>
#include <fmt/format.h>
#include <msgpack/version.hpp>
#include <spdlog/spdlog.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <csignal>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include <unistd.h>

namespace cmesh::cli {

namespace {

using namespace std::chrono_literals;

void fail_line(const std::string& what) {
  fmt::print(stderr, "cmesh: error: {}\n", what);
}

/// Waits until every rank reported "done" (or one reported "failed", or
/// one disconnected before it was done, or the deadline passed).
struct job_outcome {
  bool ok = false;
  bool no_epoch = false; // the epoch manager found that no epoch can form
  std::string reason;
  std::map<uint32_t, std::string> done;
};

job_outcome await_job(coordinator& coord, uint32_t world_size, std::chrono::seconds timeout,
                      const std::function<std::string()>& extra_failure = {}) {
  job_outcome out;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    auto r = coord.wait_report(
      [&](const wire::report& r) {
        return (r.key == "done" && !out.done.count(r.rank)) || r.key == "failed";
      },
      100ms);
    if (r && r->key == "failed") {
      out.reason = fmt::format("rank {} failed: {}", r->rank, r->value);
      return out;
    }
    if (r) {
      out.done[r->rank] = r->value;
      fmt::print("cmesh: rank {} done ({})\n", r->rank, r->value);
      if (out.done.size() == world_size) {
        out.ok = true;
        return out;
      }
      continue;
    }
    for (auto rank : coord.disconnected()) {
      if (!out.done.count(rank)) {
        out.reason = fmt::format("rank {} disconnected before it was done", rank);
        return out;
      }
    }
    if (extra_failure) {
      if (auto why = extra_failure(); !why.empty()) {
        out.reason = why;
        return out;
      }
    }
  }
  out.reason = fmt::format("job did not finish within {} s ({} of {} ranks done)",
                           timeout.count(), out.done.size(), world_size);
  return out;
}

/// What recovery cost over a supervised job, one line (nothing when no
/// failure happened and nobody rejoined).
void print_recovery(const actors::epoch_manager* manager) {
  if (!manager)
    return;
  if (auto line = manager->summary().describe(); !line.empty())
    fmt::print("cmesh: recovery: {}\n", line);
  std::fflush(stdout); // before an error line on stderr
}

/// The epoch manager of a training job, from the flags.
expected<std::unique_ptr<actors::epoch_manager>> make_epoch_manager(coordinator& coord,
                                                              const job_options& job,
                                                              uint64_t target_step) {
  auto log = actors::event_log::open(job.supervise.events);
  if (!log)
    return log.error();
  actors::epoch_manager_options so;
  so.groups = static_cast<uint32_t>(replica_groups(job.train, job.world_size));
  so.ranks_per_group = static_cast<uint32_t>(ranks_per_group(job.train, job.world_size));
  so.target_step = target_step;
  so.quorum.min_replicas = job.supervise.min_replicas;
  so.quorum.join_window_ms = job.supervise.join_window_ms;
  so.quorum.heartbeat_timeout_ms = job.supervise.heartbeat_timeout_ms;
  so.quorum.broken_grace_ms = job.supervise.broken_grace_ms;
  so.quorum.max_reforms = job.supervise.max_reforms;
  so.print = true;
  so.quorum_wait_ms = job.supervise.quorum_wait_ms;
  if (auto e = recovery::validate(so.quorum))
    return e;
  auto manager = std::make_unique<actors::epoch_manager>(coord, so, *log);
  manager->start();
  return manager;
}

/// Starts `coord`, with the epoch manager of a training job (into
/// `manager`) hooked in before it listens, so that it hears every
/// registration (workers that outlived a coordinator reconnect at once).
/// 0, or the exit code of what failed (its line said): 2 bad flags, 3 the
/// port.
int start_coordinator(coordinator& coord, const job_options& job, uint64_t target_step,
                      std::unique_ptr<actors::epoch_manager>& manager) {
  if (job.job == "train") {
    auto made = make_epoch_manager(coord, job, target_step);
    if (!made) {
      fail_line(describe(made.error()));
      return 2;
    }
    manager = std::move(*made);
  }
  if (auto e = coord.start()) {
    fail_line(describe(e));
    return 3;
  }
  return 0;
}

/// Waits for the end of a supervised training job: every member of the
/// current epoch that is training reported "done" (a joiner still catching
/// up when the others finish is left behind), or the epoch manager found that
/// no epoch can form, or the deadline passed. `each_tick` (the launcher's
/// restarts and chaos) runs every 20 ms and may end the job with a reason.
job_outcome await_training(coordinator& coord, actors::epoch_manager& manager,
                           std::chrono::seconds timeout,
                           const std::function<std::string(const actors::epoch_manager::view&)>&
                             each_tick = {}) {
  job_outcome out;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  size_t seen = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    auto reports = coord.reports();
    for (; seen < reports.size(); ++seen) {
      const auto& r = reports[seen];
      if (r.key == "done") {
        out.done[r.rank] = r.value;
        fmt::print("cmesh: rank {} done ({})\n", r.rank, r.value);
      } else if (r.key == "failed" || r.key == "fenced") {
        fmt::print("cmesh: rank {} {}: {}\n", r.rank, r.key, r.value);
      }
    }
    if (auto why = manager.failure()) {
      out.no_epoch = true;
      out.reason = "no epoch can form: " + *why;
      return out;
    }
    auto v = manager.snapshot();
    bool any_done = false, all_done = v.epoch != 0;
    for (auto& r : v.ranks) {
      if (!r.member)
        continue;
      bool done = out.done.count(r.rank) > 0;
      any_done |= done;
      if (!done && r.state == wire::worker_status::training)
        all_done = false;
    }
    if (any_done && all_done) {
      out.ok = true;
      return out;
    }
    if (each_tick) {
      if (auto why = each_tick(v); !why.empty()) {
        out.reason = why;
        return out;
      }
    }
    std::this_thread::sleep_for(20ms);
  }
  out.reason = fmt::format("job did not finish within {} s ({} ranks done)", timeout.count(),
                           out.done.size());
  return out;
}

/// What `cmesh coordinator` checks registrations against: the job's
/// configuration when it was given one (--config or a job flag), else only
/// its own version and layout, and the first training worker that
/// registers sets the rest. Says which on stdout.
caf::error check_configs(coordinator_options& co, const job_options& job,
                         const model::run_config& cfg) {
  const auto R = replica_groups(job.train, job.world_size);
  const auto S = ranks_per_group(job.train, job.world_size);
  if (!has_job_flags(job.train)) {
    co.config_pinned = model::canonical_layout(R, S);
    fmt::print("cmesh: no --config or job flags: the first training worker to register sets the "
               "job's configuration ({} replica group(s) of {} rank(s))\n",
               R, S);
    return {};
  }
  auto list = job_config_of(cfg, job.train, job.world_size);
  if (!list)
    return list.error();
  co.job_config = std::move(*list);
  fmt::print("cmesh: the job's configuration (digest {:016x}): workers that differ are refused\n",
             config_digest(co.job_config));
  return {};
}

} // namespace

int run_version() {
  fmt::print("cmesh {}\n", CMESH_VERSION);
  fmt::print("  CAF {}.{}.{}, UCX {}, msgpack-c {}\n", CAF_VERSION / 10000,
             (CAF_VERSION / 100) % 100, CAF_VERSION % 100, ucp_get_version_string(),
             msgpack_version());
  fmt::print("  accelerators: {}\n", kernels::describe(kernels::query_accelerators()));
  return 0;
}

int run_coordinator(const std::string& bind, uint16_t port, const job_options& job) {
  coordinator_options co{bind, port, job.world_size};
  uint64_t target = 0;
  if (job.job == "train") {
    // The coordinator computes nothing: --device cuda needs no GPU here.
    auto cfg = resolve_config(job.train, job.world_size, /*check_device=*/false);
    auto e = cfg ? check_configs(co, job, *cfg) : cfg.error();
    if (e) {
      fail_line(describe(e));
      return 2;
    }
    target = cfg->train.steps;
  }
  coordinator coord(co);
  std::unique_ptr<actors::epoch_manager> manager;
  if (int rc = start_coordinator(coord, job, target, manager))
    return rc;
  fmt::print("cmesh: coordinator listening on {}:{} for {} workers\n", bind, coord.port(),
             job.world_size);
  std::fflush(stdout);
  auto out = manager ? await_training(coord, *manager, std::chrono::seconds(job.timeout_s))
                 : await_job(coord, job.world_size, std::chrono::seconds(job.timeout_s));
  if (manager)
    manager->stop(); // workers leaving now are not failures
  coord.broadcast_shutdown(out.ok ? 0 : 1, out.ok ? "job done" : out.reason);
  std::this_thread::sleep_for(200ms); // let the shutdown frames leave
  coord.stop();
  print_recovery(manager.get());
  if (!out.ok) {
    fail_line(out.reason);
    return 1;
  }
  fmt::print("cmesh: all {} workers done\n", job.world_size);
  return 0;
}

std::vector<std::string> worker_args(const job_options& job) {
  std::vector<std::string> a{"worker", "--job", job.job, "--timeout-s",
                             std::to_string(job.timeout_s)};
  if (job.job == "ring") {
    a.insert(a.end(), {"--laps", std::to_string(job.laps)});
    return a;
  }
  const auto& t = job.train;
  if (!t.config_file.empty())
    a.insert(a.end(), {"--config", t.config_file});
  if (!t.data_file.empty())
    a.insert(a.end(), {"--data", t.data_file});
  if (t.steps)
    a.insert(a.end(), {"--steps", std::to_string(*t.steps)});
  if (t.log_every)
    a.insert(a.end(), {"--log-every", std::to_string(*t.log_every)});
  if (t.exact)
    a.push_back("--exact");
  if (t.verify_every)
    a.insert(a.end(), {"--verify-every", std::to_string(*t.verify_every)});
  if (t.replicas != 0)
    a.insert(a.end(), {"--replicas", std::to_string(t.replicas)});
  if (!t.device.empty())
    a.insert(a.end(), {"--device", t.device});
  a.insert(a.end(), {"--step-timeout-ms", std::to_string(job.supervise.step_timeout_ms)});
  if (job.supervise.catchup_nice != 0)
    a.insert(a.end(), {"--catchup-nice", std::to_string(job.supervise.catchup_nice)});
  if (job.supervise.shadow)
    a.push_back("--shadow");
  if (job.supervise.shadow_check)
    a.push_back("--shadow-check");
  const auto& d = job.supervise.durable;
  if (!d.dir.empty())
    a.insert(a.end(), {"--checkpoint-dir", d.dir});
  if (!d.shared.empty())
    a.insert(a.end(), {"--checkpoint-shared", d.shared});
  if (d.writes())
    a.insert(a.end(), {"--checkpoint-every", std::to_string(d.every), "--checkpoint-seconds",
                       fmt::format("{}", d.seconds), "--checkpoint-keep",
                       std::to_string(d.keep_last), "--checkpoint-keep-every",
                       std::to_string(d.keep_every)});
  if (d.writes() && d.checkpointer)
    a.push_back("--checkpointer");
  if (!d.resume.empty())
    a.insert(a.end(), {"--resume", d.resume});
  return a;
}

/// The worker's exit status in words, for the launcher's lines.
std::string exit_text(int status) {
  if (exit_code_of(status) == exit_fenced)
    return "fenced out of the job (exit 4)";
  if (exit_code_of(status) == actors::exit_hung)
    return "hung: ended by its step watchdog (exit 5)";
  if (exit_code_of(status) == actors::exit_actor_failed)
    return "a local actor died: ended by its supervisor (exit 6)";
  return describe_wait_status(status);
}

namespace {

/// The checkpoint a worker resumes from (--resume), with this rank's shard
/// of the state (trainer.hpp: split_shards), read while it is verified.
expected<std::optional<resume_point>> resume_of(const job_options& job, const launch_env& place,
                                                const model::run_config& config,
                                                const config_list& job_config) {
  const auto S = ranks_per_group(job.train, static_cast<size_t>(place.world_size));
  const auto split =
    actors::split_shards(model::moe_lm_parameter_count(config.model), S, actors::norm_block);
  const auto position = static_cast<size_t>(place.rank) % S;
  auto r = find_resume(job.supervise.durable, job_config, split.offsets[position],
                       split.counts[position]);
  if (r && !*r && !job.supervise.durable.resume.empty())
    fmt::print("cmesh: --resume {}: no checkpoint yet; starting at step 0\n",
               job.supervise.durable.resume);
  return r;
}

/// A training worker's signals: the chaos plan's faults, and a clean stop.
void install_worker_signals() {
  // Chaos support: SIGUSR1 hangs the trainer's next step (hang@STEP:RANK),
  // SIGUSR2 fails its next step's collectives (fault@STEP:RANK),
  struct sigaction sa {};
  sa.sa_handler = [](int) { actors::request_hang(); };
  sigemptyset(&sa.sa_mask);
  sigaction(SIGUSR1, &sa, nullptr);
  sa.sa_handler = [](int) { actors::request_fault(); };
  sigaction(SIGUSR2, &sa, nullptr);
  // SIGRTMIN flips a bit of its weights (flip@STEP:RANK), SIGRTMIN+1
  // makes its actor die with an error (crash@STEP:RANK), SIGRTMIN+2 its
  // checkpoint shadow's (crash-shadow@STEP:RANK).
  sa.sa_handler = [](int) { actors::request_flip(); };
  sigaction(SIGRTMIN, &sa, nullptr);
  sa.sa_handler = [](int) { actors::request_crash(); };
  sigaction(SIGRTMIN + 1, &sa, nullptr);
  sa.sa_handler = [](int) { actors::request_shadow_crash(); };
  sigaction(SIGRTMIN + 2, &sa, nullptr);
  // SIGTERM (a scheduler's preemption or cancel, cmesh launch passing on
  // a Ctrl-C) and SIGINT stop training after a step every member agrees
  // on, checkpointed; a worker not training by then ends 60 s later
  // (SIGALRM's default action).
  sa.sa_handler = [](int) {
    if (!actors::stop_was_requested())
      ::alarm(60);
    actors::request_stop();
  };
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

} // namespace

int run_worker(const job_options& job) {
  std::optional<model::run_config> config; // the train job's, resolved once
  config_list job_config;                  // ... and what it registers with
  shadow_flags shadow;                     // ... its checkpoints and resume
  if (job.job == "train") {
    // Bad flags or config fail before anything is started.
    std::string err;
    auto place = read_launch_env(err);
    if (!err.empty()) {
      fail_line(err);
      return 2;
    }
    auto cfg = resolve_config(job.train, static_cast<size_t>(place.world_size));
    auto list = cfg ? job_config_of(*cfg, job.train, static_cast<size_t>(place.world_size))
                    : expected<config_list>(cfg.error());
    if (!list) {
      fail_line(describe(list.error()));
      return 2;
    }
    config = std::move(*cfg);
    job_config = std::move(*list);
    // A checkpoint to resume from is found, verified and checked against
    // the configuration before the worker joins: a bad one fails here.
    auto r = resume_of(job, place, *config, job_config);
    if (!r) {
      fail_line(fmt::format("--resume {}: {}", job.supervise.durable.resume, describe(r.error())));
      return code_of(r.error()) == errc::unreachable ? 3 : 2;
    }
    shadow.resume = std::move(*r);
    shadow.on = job.supervise.shadow || job.supervise.shadow_check;
    shadow.check = job.supervise.shadow_check;
    shadow.durable = job.supervise.durable;
    shadow.config = job_config;
  }
  if (job.job == "train")
    install_worker_signals();
  join_options jo;
  jo.connect_transport = job.job != "train";
  jo.config = std::move(job_config); // the coordinator refuses one that is not the job's
  auto j = join_mesh(jo);
  if (!j) {
    fail_line(describe(j.error()));
    auto c = code_of(j.error());
    return c == errc::invalid_argument ? 2 : 3;
  }
  if (job.job == "train") {
    auto rc = run_training(*j, *config,
                           replica_groups(job.train, static_cast<size_t>(j->place.world_size)),
                           std::chrono::seconds(job.timeout_s),
                           std::chrono::milliseconds(job.supervise.step_timeout_ms),
                           job.supervise.catchup_nice, shadow);
    j->net->stop();
    if (!rc) {
      fail_line(fmt::format("rank {}: {}", j->place.rank, describe(rc.error())));
      return 1;
    }
    if (*rc == exit_fenced)
      fail_line(fmt::format("rank {}: fenced out of the job; a restart rejoins it as a new "
                            "incarnation",
                            j->place.rank));
    return *rc;
  }
  auto err = run_ring(*j, job.laps, std::chrono::seconds(job.timeout_s));
  if (err) {
    fail_line(fmt::format("rank {}: {}", j->place.rank, describe(err)));
    j->net->stop();
    return 1;
  }
  auto sd = j->coordinator.wait_shutdown(std::chrono::seconds(job.timeout_s));
  j->net->begin_shutdown();
  j->net->stop();
  if (!sd) {
    fail_line(fmt::format("rank {}: waiting for the coordinator's shutdown: {}", j->place.rank,
                          describe(sd.error())));
    return 1;
  }
  return sd->exit_code;
}

namespace {

/// What every attempt of a launched job shares: the coordinator's
/// options, the target step, the chaos plan and whether ranks need NCCL
/// host ids of their own.
struct launch_setup {
  coordinator_options co{"127.0.0.1", 0, 1};
  uint64_t target = 0;
  bool own_nccl_hosts = false;
  std::vector<chaos::action> plan;
  size_t next_action = 0; // the plan's actions before it were done (by an earlier attempt too)
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  uint32_t job_restarts = 0; // every worker restarted from the checkpoints
  int signals_seen = 0;      // SIGINT / SIGTERM acted on
};

/// SIGINT and SIGTERM received by `cmesh launch`, and the last one.
std::atomic<int> launch_signals{0};
std::atomic<int> launch_last_signal{0};

/// The launch's setup from the flags. Errors: invalid_argument.
expected<launch_setup> prepare_launch(const job_options& job) {
  launch_setup ls;
  ls.co = coordinator_options{"127.0.0.1", 0, job.world_size};
  auto& co = ls.co;
  auto& plan = ls.plan;
  auto& target = ls.target;
  // Ranks sharing a GPU: NCCL refuses two ranks of a communicator on one
  // device of one host unless each process is a host of its own
  // (NCCL_HOSTID); they then talk over NCCL's socket transport.
  bool& own_nccl_hosts = ls.own_nccl_hosts;
  if (job.job == "train") {
    auto cfg = resolve_config(job.train, job.world_size);
    if (!cfg)
      return cfg.error();
    target = cfg->train.steps;
    auto list = job_config_of(*cfg, job.train, job.world_size);
    if (!list)
      return list.error();
    co.job_config = std::move(*list);
    if (cfg->train.device == "cuda" && !env_string("NCCL_HOSTID")) {
      const auto gpus = kernels::query_accelerators().devices.size();
      own_nccl_hosts = gpus < job.world_size;
      if (own_nccl_hosts)
        fmt::print("cmesh: {} ranks on {} GPU(s): each worker gets an NCCL_HOSTID of its own "
                   "(NCCL's socket transport between them)\n",
                   job.world_size, gpus);
    }
    auto p = chaos::parse_plan(job.supervise.chaos, job.world_size);
    if (!p)
      return p.error();
    plan = std::move(*p);
    const auto& sv = job.supervise;
    if (sv.chaos_kills > 0 || sv.chaos_faults > 0 || sv.chaos_stops > 0 || sv.chaos_hangs > 0) {
      auto first = sv.chaos_first_step;
      // Stops from half a heartbeat timeout (ridden out: the others wait
      // for it) to two (taken for a death: fenced after SIGCONT, restarted).
      const auto hb = sv.heartbeat_timeout_ms;
      auto more = chaos::random_plan(sv.chaos_seed, first, target > first + 2 ? target - 2 : first,
                                     job.world_size,
                                     {.kills = sv.chaos_kills,
                                      .faults = sv.chaos_faults,
                                      .stops = sv.chaos_stops,
                                      .stop_min_ms = hb / 2,
                                      .stop_max_ms = 2 * hb,
                                      .hangs = sv.chaos_hangs});
      plan.insert(plan.end(), more.begin(), more.end());
      std::stable_sort(plan.begin(), plan.end(),
                       [](auto& a, auto& b) { return a.at_step < b.at_step; });
    }
  }
  return ls;
}

/// The checkpointer process of a launched attempt (--checkpointer): it
/// outlives the workers, so when every worker is lost it writes the last
/// step they all committed before the next attempt resumes from it.
struct launched_checkpointer {
  child_process proc; // pid() <= 0: none was started (no --checkpointer)
  uint32_t restarts = 0;

  /// Errors: a line for the launcher (it could not be started).
  std::string start(const std::string& exe, const job_options& job, const std::string& address,
                    actors::epoch_manager* manager) {
    std::string err;
    auto args = worker_args(job);
    args.front() = "checkpointer";
    args.insert(args.begin() + 1, {"-n", std::to_string(job.world_size)});
    proc = child_process::spawn(exe, args, {{"CMESH_COORDINATOR", address}}, &err);
    if (proc.pid() < 0)
      return "cannot start the checkpointer: " + err;
    if (manager)
      manager->note("checkpointer_started", {{"pid", int64_t{proc.pid()}}});
    return {};
  }

  /// One that died is started again (the writing ranks link to the new
  /// one and seed it), up to --max-restarts. Errors: a reason to end the job.
  std::string keep(const std::string& exe, const job_options& job, const std::string& address,
                   actors::epoch_manager& manager, double t) {
    if (proc.pid() <= 0)
      return {};
    auto st = proc.poll();
    if (!st)
      return {};
    fmt::print("cmesh: the checkpointer (pid {}) ended: {} (t+{:.3f} s)\n", proc.pid(),
               describe_wait_status(*st), t);
    manager.note("checkpointer_exit",
             {{"pid", int64_t{proc.pid()}}, {"status", describe_wait_status(*st)}});
    if (restarts++ >= job.supervise.max_restarts)
      return "the checkpointer ended too often";
    return start(exe, job, address, &manager);
  }

  /// Chaos kill-checkpointer@STEP.
  void kill(uint64_t step, actors::epoch_manager& manager, double t) {
    if (!proc.running()) {
      fmt::print("cmesh: chaos: no checkpointer to kill at step {} (--checkpointer)\n", step);
      return;
    }
    fmt::print("cmesh: chaos: SIGKILL the checkpointer (pid {}) at step {} (t+{:.3f} s)\n",
               proc.pid(), step, t);
    manager.note("chaos", {{"signal", std::string("SIGKILL (checkpointer)")},
                       {"pid", int64_t{proc.pid()}},
                       {"step", step}});
    proc.signal(SIGKILL);
  }

  /// At the attempt's end: SIGTERM, and it writes the newest whole step and
  /// exits. False when it failed or had to be killed.
  bool stop(const job_options& job, actors::epoch_manager* manager) {
    if (proc.pid() <= 0 || !proc.running())
      return true;
    proc.signal(SIGTERM);
    auto st = proc.wait(std::chrono::seconds(job.timeout_s));
    bool ok = true;
    if (!st) {
      fmt::print(stderr, "cmesh: the checkpointer did not exit; killing it\n");
      proc.kill_and_reap();
      ok = false;
    } else if (exit_code_of(*st) != 0) {
      fmt::print(stderr, "cmesh: the checkpointer ended with {}\n", describe_wait_status(*st));
      ok = false;
    }
    if (manager)
      manager->note("checkpointer_exit",
                {{"pid", int64_t{proc.pid()}},
                 {"status", st ? describe_wait_status(*st) : std::string("killed")}});
    return ok;
  }
};

using launch_clock = std::chrono::steady_clock;

/// The workers of one attempt: their processes, their restarts, and the
/// signals the chaos plan sends them.
struct launched_workers {
  const job_options& job;
  job_options replacement; // a restarted worker catches up; it never resumes
  std::string exe, address;
  bool own_nccl_hosts = false;
  actors::epoch_manager* manager = nullptr;
  launch_clock::time_point t0;
  std::vector<child_process> procs;
  std::vector<uint32_t> restarts;
  std::vector<std::optional<launch_clock::time_point>> restart_at;
  std::vector<bool> signalled_down; // killed or stopped by chaos
  std::vector<std::pair<launch_clock::time_point, uint32_t>> to_continue; // SIGCONT due

  launched_workers(const job_options& j, const launch_setup& ls, std::string exe_path,
                   std::string addr, actors::epoch_manager* m)
      : job(j), replacement(j), exe(std::move(exe_path)), address(std::move(addr)),
        own_nccl_hosts(ls.own_nccl_hosts), manager(m), t0(ls.t0), procs(j.world_size),
        restarts(j.world_size, 0), restart_at(j.world_size), signalled_down(j.world_size, false) {
    replacement.supervise.durable.resume.clear();
  }

  double since_start() const {
    return std::chrono::duration<double>(launch_clock::now() - t0).count();
  }

  /// Starts worker `r`; `replacing`: a restart while the job trains (it
  /// catches up from a live peer; only the attempt's first workers resume
  /// from a checkpoint).
  bool start(uint32_t r, bool replacing) {
    std::string err;
    std::vector<std::pair<std::string, std::string>> env{
      {"CMESH_COORDINATOR", address},
      {"CMESH_RANK", std::to_string(r)},
      {"CMESH_WORLD_SIZE", std::to_string(job.world_size)},
      {"CMESH_LOCAL_RANK", std::to_string(r)}};
    if (own_nccl_hosts)
      env.emplace_back("NCCL_HOSTID", fmt::format("cmesh-{}-rank{}", ::getpid(), r));
    procs[r] = child_process::spawn(exe, worker_args(replacing ? replacement : job), env, &err);
    if (procs[r].pid() < 0) {
      fail_line("cannot start worker: " + err);
      return false;
    }
    if (manager)
      manager->note("worker_started", {{"rank", uint64_t{r}}, {"pid", int64_t{procs[r].pid()}}});
    return true;
  }

  void signal(uint32_t r, int sig, const char* name, uint64_t step) {
    if (!procs[r].running())
      return;
    if (sig != SIGUSR2 && sig != SIGRTMIN && sig != SIGRTMIN + 2) // the process lives on
      signalled_down[r] = sig != SIGCONT;
    fmt::print("cmesh: chaos: {} rank {} (pid {}) at step {} (t+{:.3f} s)\n", name, r,
               procs[r].pid(), step, since_start());
    std::fflush(stdout);
    manager->note("chaos", {{"signal", std::string(name)},
                            {"rank", uint64_t{r}},
                            {"pid", int64_t{procs[r].pid()}},
                            {"step", step}});
    procs[r].signal(sig);
  }

  /// SIGCONT to the stopped ranks whose stop is over.
  void continue_due(launch_clock::time_point now, uint64_t step) {
    for (auto it = to_continue.begin(); it != to_continue.end();) {
      if (it->first <= now) {
        signal(it->second, SIGCONT, "SIGCONT", step);
        it = to_continue.erase(it);
      } else {
        ++it;
      }
    }
  }

  /// Worker `r` exited: whether the job can go on, and its restart.
  /// Errors: a line for the launcher.
  std::string exited(uint32_t r, int status, launch_clock::time_point now) {
    if (exit_code_of(status) == 0)
      return {};
    fmt::print("cmesh: worker {} (pid {}) ended: {} (t+{:.3f} s)\n", r, procs[r].pid(),
               exit_text(status), since_start());
    manager->note("worker_exit", {{"rank", uint64_t{r}},
                                  {"pid", int64_t{procs[r].pid()}},
                                  {"status", exit_text(status)}});
    // A usage error (bad flags or environment, a registration the
    // coordinator refused) comes back on every restart.
    if (exit_code_of(status) == 2)
      return fmt::format("worker {} ended with a usage error (exit 2; see its error line): a "
                         "restart would fail the same way",
                         r);
    if (restarts[r] < job.supervise.max_restarts) {
      restart_at[r] = now + std::chrono::milliseconds(job.supervise.restart_delay_ms);
      fmt::print("cmesh: worker {} restarts in {} ms\n", r, job.supervise.restart_delay_ms);
    }
    std::fflush(stdout);
    return {};
  }

  /// Dead workers are restarted after the delay, up to max_restarts each
  /// (none while `stopping`). Errors: a line for the launcher (a worker
  /// that cannot be started or restarted, or none left).
  std::string keep(launch_clock::time_point now, bool stopping) {
    size_t alive = 0;
    for (uint32_t r = 0; r < procs.size(); ++r) {
      if (restart_at[r] && stopping)
        restart_at[r].reset(); // stopping: nobody is replaced
      if (restart_at[r] && *restart_at[r] <= now) {
        restart_at[r].reset();
        ++restarts[r];
        fmt::print("cmesh: restarting worker {} (restart {} of {}, t+{:.3f} s)\n", r, restarts[r],
                   job.supervise.max_restarts, since_start());
        std::fflush(stdout);
        manager->note("restart", {{"rank", uint64_t{r}}, {"restart", uint64_t{restarts[r]}}});
        signalled_down[r] = false;
        if (!start(r, true))
          return "cannot restart a worker";
      }
      if (procs[r].running())
        if (auto st = procs[r].poll())
          if (auto e = exited(r, *st, now); !e.empty())
            return e;
      alive += procs[r].running() || restart_at[r] ? 1 : 0;
    }
    return alive == 0 ? "every worker has exited" : "";
  }

  /// After the job: every worker waited for (a stopped one continued
  /// first), killed after 10 s. False when one had to be killed, or (not
  /// training) one ended badly.
  bool reap() {
    bool ok = true;
    for (uint32_t r = 0; r < procs.size(); ++r) {
      if (procs[r].pid() <= 0)
        continue;
      procs[r].signal(SIGCONT); // a stopped worker cannot hear the shutdown
      auto st = procs[r].wait(10s);
      if (!st) {
        fmt::print(stderr, "cmesh: worker {} did not exit; killing it\n", r);
        procs[r].kill_and_reap();
        ok = false;
      } else if (exit_code_of(*st) != 0 && job.job != "train") {
        fmt::print(stderr, "cmesh: worker {} ended with {}\n", r, describe_wait_status(*st));
        ok = false;
      }
    }
    return ok;
  }
};

/// The chaos plan's actions whose step the members reached, sent to the
/// workers (and the checkpointer, and the checkpoints).
struct launch_chaos {
  const job_options& job;
  launch_setup& ls;
  launched_workers& w;
  launched_checkpointer& checkpointer;
  uint32_t per_group = 1;

  /// Live member groups other than `target`'s (a group lives while all its
  /// ranks do). A group the newest epoch admits counts only once its ranks
  /// trained in an epoch: until they enter it they are still catching up,
  /// and the state they lack may be only on the group about to be killed
  /// (whose surviving rank is then fenced).
  size_t others_live(const actors::epoch_manager::view& v, uint32_t target) const {
    auto trained = [](uint8_t state) {
      return state == wire::worker_status::training || state == wire::worker_status::recovering;
    };
    std::map<uint32_t, size_t> up;
    for (auto& r : v.ranks)
      if (r.member && r.live && trained(r.state) && !w.signalled_down[r.rank]
          && r.rank / per_group != target / per_group)
        ++up[r.rank / per_group];
    size_t n = 0;
    for (auto& [g, k] : up)
      n += k == per_group ? 1 : 0;
    return n;
  }

  /// One action; false when it must wait (a kill of a catch-up source with
  /// none running).
  bool act(const chaos::action& a, const actors::epoch_manager::view& v,
           launch_clock::time_point now) {
    const uint64_t step = v.max_member_step;
    switch (a.kind) {
      case chaos::action_kind::kill_all:
        for (uint32_t r = 0; r < w.procs.size(); ++r)
          w.signal(r, SIGKILL, "SIGKILL (kill-all)", step);
        return true;
      case chaos::action_kind::kill_checkpointer:
        checkpointer.kill(step, *w.manager, w.since_start());
        return true;
      case chaos::action_kind::corrupt:
        w.manager->note("chaos", {{"action", std::string("corrupt")},
                                  {"step", step},
                                  {"what", corrupt_newest_checkpoint(job.supervise.durable)}});
        return true;
      case chaos::action_kind::kill_source:
        // Waits for a catch-up to run whose source is not the last live member.
        if (!v.catchup_source || others_live(v, *v.catchup_source) == 0)
          return false;
        w.signal(*v.catchup_source, SIGKILL, "SIGKILL (catch-up source)", step);
        return true;
      case chaos::action_kind::fault:
        // One signal per failed attempt; apart, so that none merges with one
        // still pending.
        for (uint32_t k = 0; k < a.times; ++k) {
          if (k > 0)
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          w.signal(a.rank, SIGUSR2, "SIGUSR2 (fault)", step);
        }
        return true;
      case chaos::action_kind::flip:
        w.signal(a.rank, SIGRTMIN, "SIGRTMIN (flip)", step);
        return true;
      case chaos::action_kind::crash:
        w.signal(a.rank, SIGRTMIN + 1, "SIGRTMIN+1 (crash)", step);
        return true;
      case chaos::action_kind::crash_shadow:
        w.signal(a.rank, SIGRTMIN + 2, "SIGRTMIN+2 (crash-shadow)", step);
        return true;
      default:
        break;
    }
    if (a.survivable && others_live(v, a.rank) == 0) {
      // A survivable kill, stop or hang of the last live group.
      fmt::print("cmesh: chaos: skipped {} of rank {} at step {}: its group is the last live "
                 "one\n",
                 a.kind == chaos::action_kind::kill   ? "SIGKILL"
                 : a.kind == chaos::action_kind::stop ? "SIGSTOP"
                                                      : "SIGUSR1 (hang)",
                 a.rank, step);
    } else if (a.kind == chaos::action_kind::hang) {
      w.signal(a.rank, SIGUSR1, "SIGUSR1 (hang)", step);
    } else if (a.kind == chaos::action_kind::kill) {
      w.signal(a.rank, SIGKILL, "SIGKILL", step);
    } else {
      w.signal(a.rank, SIGSTOP, "SIGSTOP", step);
      w.to_continue.emplace_back(now + std::chrono::milliseconds(a.stop_ms), a.rank);
    }
    return true;
  }

  /// The next action is a due kill of a catch-up source, and no catch-up
  /// runs to act on yet.
  bool awaits_catchup(uint64_t step) const {
    return ls.next_action < ls.plan.size() && ls.plan[ls.next_action].at_step <= step
           && ls.plan[ls.next_action].kind == chaos::action_kind::kill_source;
  }

  void run_due(const actors::epoch_manager::view& v, launch_clock::time_point now) {
    while (ls.next_action < ls.plan.size()
           && ls.plan[ls.next_action].at_step <= v.max_member_step) {
      if (!act(ls.plan[ls.next_action], v, now))
        break;
      ++ls.next_action;
    }
  }
};

/// SIGINT or SIGTERM to the launcher: every worker is asked to stop after a
/// step they agree on (checkpointed); a second one ends the job at once
/// (its reason returned).
std::string forward_stop(const job_options& job, launch_setup& ls, launched_workers& w,
                         uint64_t step) {
  const int n = launch_signals.load();
  if (n <= ls.signals_seen)
    return {};
  ls.signals_seen = n;
  if (n > 1)
    return "interrupted twice: every worker is ended";
  fmt::print("cmesh: stopping: every worker finishes a step they agree on{} and exits (again to "
             "end them at once)\n",
             job.supervise.durable.writes() ? ", checkpoints it," : "");
  std::fflush(stdout);
  w.manager->note("stop", {{"step", step}});
  for (auto& p : w.procs)
    if (p.running())
      p.signal(SIGTERM);
  return {};
}

/// Prints the attempt's opening lines: the coordinator, and the chaos plan.
void announce_attempt(const job_options& job, const launch_setup& ls, const std::string& address,
                      actors::epoch_manager* manager) {
  fmt::print("cmesh: coordinator on {}, launching {} workers\n", address, job.world_size);
  if (manager && ls.job_restarts > 0)
    manager->note("job_restart", {{"restart", uint64_t{ls.job_restarts}},
                                  {"resume", job.supervise.durable.resume}});
  const auto& plan = ls.plan;
  if (!plan.empty() && ls.job_restarts == 0)
    fmt::print("cmesh: chaos plan {} (seed {})\n", chaos::to_string(plan),
               job.supervise.chaos_seed);
  if (std::any_of(plan.begin(), plan.end(),
                  [](auto& a) { return a.kind == chaos::action_kind::hang; }))
    fmt::print("cmesh: chaos: a hung rank is ended by its step watchdog after {} ms "
               "(--step-timeout-ms)\n",
               job.supervise.step_timeout_ms);
}

/// A training attempt's wait: each tick forwards a stop, runs the chaos
/// plan, keeps the checkpointer and restarts dead workers.
job_outcome await_launched_training(coordinator& coord, const job_options& job,
                                    launch_setup& ls, launched_workers& w,
                                    launched_checkpointer& checkpointer) {
  launch_chaos chaos{job, ls, w, checkpointer,
                     static_cast<uint32_t>(ranks_per_group(job.train, job.world_size))};
  auto tick = [&](const actors::epoch_manager::view& v) -> std::string {
    const auto now = launch_clock::now();
    if (auto e = forward_stop(job, ls, w, v.max_member_step); !e.empty())
      return e;
    chaos.run_due(v, now);
    // A catch-up of a small model lasts a step or two (tens of ms), and the
    // view names its source only until the joiner is a member: while a kill
    // of its source waits for one, look every millisecond through this
    // tick and the pause before the next (40 ms by the clock, however slow
    // a loaded machine makes each look), not once per tick.
    const auto until = launch_clock::now() + std::chrono::milliseconds(40);
    while (chaos.awaits_catchup(v.max_member_step) && launch_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      chaos.run_due(w.manager->snapshot(), launch_clock::now());
    }
    w.continue_due(now, v.max_member_step);
    if (ls.signals_seen == 0)
      if (auto e = checkpointer.keep(w.exe, job, w.address, *w.manager, w.since_start());
          !e.empty())
        return e;
    return w.keep(now, ls.signals_seen > 0);
  };
  return await_training(coord, *w.manager, std::chrono::seconds(job.timeout_s), tick);
}

/// One attempt of a launched job: a coordinator, its epoch manager and the
/// workers, until the job ends. `resumable`: it ended because no epoch can
/// form (every replica group lost), which a restart of every worker from
/// the checkpoints repairs; with `may_resume` that is said as a line, not
/// as the job's error.
int launch_attempt(const job_options& job, launch_setup& ls, bool may_resume, bool& resumable) {
  coordinator coord(ls.co);
  std::unique_ptr<actors::epoch_manager> manager;
  if (int rc = start_coordinator(coord, job, ls.target, manager))
    return rc;
  auto address = fmt::format("127.0.0.1:{}", coord.port());
  announce_attempt(job, ls, address, manager.get());
  launched_workers w(job, ls, self_exe_dir() + "/cmesh", address, manager.get());
  launched_checkpointer checkpointer;
  if (job.job == "train" && job.supervise.durable.checkpointer && job.supervise.durable.writes())
    if (auto e = checkpointer.start(w.exe, job, address, manager.get()); !e.empty()) {
      fail_line(e);
      return 3;
    }
  for (uint32_t r = 0; r < job.world_size; ++r)
    if (!w.start(r, false))
      return 3;
  job_outcome out;
  if (job.job == "train") {
    out = await_launched_training(coord, job, ls, w, checkpointer);
  } else {
    auto early_exit = [&]() -> std::string {
      for (uint32_t r = 0; r < w.procs.size(); ++r)
        if (auto st = w.procs[r].poll(); st && exit_code_of(*st) != 0)
          return fmt::format("worker {} (pid {}) ended early: {}", r, w.procs[r].pid(),
                             describe_wait_status(*st));
      return {};
    };
    out = await_job(coord, job.world_size, std::chrono::seconds(job.timeout_s), early_exit);
  }
  if (manager)
    manager->stop(); // workers leaving now are not failures
  coord.broadcast_shutdown(out.ok ? 0 : 1, out.ok ? "job done" : out.reason);
  int rc = out.ok ? 0 : 1;
  if (!w.reap())
    rc = 1;
  if (!checkpointer.stop(job, manager.get()))
    rc = 1;
  if (manager)
    manager->stop();
  coord.stop();
  print_recovery(manager.get());
  resumable = !out.ok && out.no_epoch;
  if (!out.ok) {
    if (!resumable || !may_resume) // else the epoch manager said it, and the job restarts
      fail_line(out.reason);
    return 1;
  }
  fmt::print("cmesh: {} workers done in {:.2f} s{}\n", job.world_size, w.since_start(),
             rc == 0 ? "" : " (some exited badly)");
  if (job.job == "train" && !out.done.empty())
    fmt::print("cmesh: summary: {}\n", out.done.begin()->second);
  return rc;
}

} // namespace

int run_launch(const job_options& job) {
  auto ls = prepare_launch(job);
  if (!ls) {
    fail_line(describe(ls.error()));
    return 2;
  }
  if (job.job == "train") {
    struct sigaction sa {};
    sa.sa_handler = [](int sig) {
      launch_last_signal.store(sig);
      launch_signals.fetch_add(1);
    };
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
  }
  job_options attempt = job;
  for (;;) {
    const bool may_resume = job.job == "train" && job.supervise.durable.writes()
                            && ls->job_restarts < job.supervise.max_restarts;
    bool resumable = false;
    const int rc = launch_attempt(attempt, *ls, may_resume && ls->signals_seen == 0, resumable);
    if (ls->signals_seen > 0) // stopped on request: 128 + the signal, as a shell reports it
      return rc == 0 ? 128 + launch_last_signal.load() : rc;
    if (!resumable || !may_resume)
      return rc;
    ++ls->job_restarts;
    fmt::print("cmesh: every worker restarts from the newest checkpoint (job restart {} of {})\n",
               ls->job_restarts, job.supervise.max_restarts);
    std::fflush(stdout);
    attempt.supervise.durable.resume = "latest";
  }
}

} // namespace cmesh::cli
