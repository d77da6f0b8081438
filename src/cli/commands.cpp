#include "cli/commands.hpp"

#include "cli/ring.hpp"
#include "core/process.hpp"
#include "kernels/device.hpp"
#include "transport/bootstrap.hpp"
#include "transport/join.hpp"

#include <caf/config.hpp>
#include <fmt/format.h>
#include <msgpack/version.hpp>
#include <spdlog/spdlog.h>
#include <ucp/api/ucp.h>

#include <map>
#include <optional>
#include <thread>

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
  coordinator coord({bind, port, job.world_size});
  if (auto e = coord.start()) {
    fail_line(describe(e));
    return 3;
  }
  fmt::print("cmesh: coordinator listening on {}:{} for {} workers\n", bind, coord.port(),
             job.world_size);
  std::fflush(stdout);
  auto out = await_job(coord, job.world_size, std::chrono::seconds(job.timeout_s));
  coord.broadcast_shutdown(out.ok ? 0 : 1, out.ok ? "job done" : out.reason);
  std::this_thread::sleep_for(200ms); // let the shutdown frames leave
  coord.stop();
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
  if (t.replicas != 0)
    a.insert(a.end(), {"--replicas", std::to_string(t.replicas)});
  return a;
}

int run_worker(const job_options& job) {
  std::optional<model::run_config> config; // the train job's, resolved once
  if (job.job == "train") {
    // Bad flags or config fail before anything is started.
    std::string err;
    auto place = read_launch_env(err);
    if (!err.empty()) {
      fail_line(err);
      return 2;
    }
    auto cfg = resolve_config(job.train, static_cast<size_t>(place.world_size));
    if (!cfg) {
      fail_line(describe(cfg.error()));
      return 2;
    }
    config = std::move(*cfg);
  }
  auto j = join_mesh({});
  if (!j) {
    fail_line(describe(j.error()));
    auto c = code_of(j.error());
    return c == errc::invalid_argument ? 2 : 3;
  }
  auto err = job.job == "ring" ? run_ring(*j, job.laps, std::chrono::seconds(job.timeout_s))
                               : run_training(*j, *config, std::chrono::seconds(job.timeout_s));
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

int run_launch(const job_options& job) {
  if (job.job == "train") {
    if (auto cfg = resolve_config(job.train, job.world_size); !cfg) {
      fail_line(describe(cfg.error()));
      return 2;
    }
  }
  coordinator coord({"127.0.0.1", 0, job.world_size});
  if (auto e = coord.start()) {
    fail_line(describe(e));
    return 3;
  }
  auto address = fmt::format("127.0.0.1:{}", coord.port());
  fmt::print("cmesh: coordinator on {}, launching {} workers\n", address, job.world_size);
  auto exe = self_exe_dir() + "/cmesh";
  std::vector<child_process> workers;
  auto t0 = std::chrono::steady_clock::now();
  for (uint32_t r = 0; r < job.world_size; ++r) {
    std::string err;
    auto c = child_process::spawn(
      exe, worker_args(job),
      {{"CMESH_COORDINATOR", address},
       {"CMESH_RANK", std::to_string(r)},
       {"CMESH_WORLD_SIZE", std::to_string(job.world_size)},
       {"CMESH_LOCAL_RANK", std::to_string(r)}},
      &err);
    if (c.pid() < 0) {
      fail_line("cannot start worker: " + err);
      return 3;
    }
    workers.push_back(std::move(c));
  }
  auto early_exit = [&]() -> std::string {
    for (uint32_t r = 0; r < workers.size(); ++r)
      if (auto st = workers[r].poll(); st && exit_code_of(*st) != 0)
        return fmt::format("worker {} (pid {}) ended early: {}", r, workers[r].pid(),
                           describe_wait_status(*st));
    return {};
  };
  auto out = await_job(coord, job.world_size, std::chrono::seconds(job.timeout_s), early_exit);
  coord.broadcast_shutdown(out.ok ? 0 : 1, out.ok ? "job done" : out.reason);
  int rc = out.ok ? 0 : 1;
  for (uint32_t r = 0; r < workers.size(); ++r) {
    auto st = workers[r].wait(10s);
    if (!st) {
      fmt::print(stderr, "cmesh: worker {} did not exit; killing it\n", r);
      workers[r].kill_and_reap();
      rc = 1;
    } else if (exit_code_of(*st) != 0) {
      fmt::print(stderr, "cmesh: worker {} ended with {}\n", r, describe_wait_status(*st));
      rc = 1;
    }
  }
  coord.stop();
  auto secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!out.ok) {
    fail_line(out.reason);
    return 1;
  }
  fmt::print("cmesh: {} workers done in {:.2f} s{}\n", job.world_size, secs,
             rc == 0 ? "" : " (some exited badly)");
  if (job.job == "train" && !out.done.empty())
    fmt::print("cmesh: summary: {}\n", out.done.begin()->second);
  return rc;
}

} // namespace cmesh::cli
