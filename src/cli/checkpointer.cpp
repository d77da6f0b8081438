// `cmesh checkpointer`: the checkpoint shadows of a job in a process of
// their own (actors/checkpointer.hpp).
#include "actors/checkpointer.hpp"
#include "cli/commands.hpp"
#include "core/env.hpp"
#include "core/spawn.hpp"
#include "model/moe_lm.hpp"
#include "storage/reader.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <csignal>
#include <thread>

namespace cmesh::cli {

namespace {

std::atomic<int> checkpointer_signal{0};

/// The step a run resumed from (not written again): the newest checkpoint
/// listed in the tiers, read without verifying them (the workers verify).
uint64_t resumed_step(const durable_flags& d) {
  if (d.resume.empty())
    return 0;
  uint64_t newest = 0;
  for (const auto& root : d.roots())
    if (auto all = storage::list_checkpoints(root, false))
      for (const auto& c : *all)
        if (!c.error)
          newest = std::max(newest, c.step);
  return newest;
}

void print_positions(actors::checkpointer& c) {
  auto all = c.status(std::chrono::seconds(10));
  for (size_t p = 0; p < all.size(); ++p) {
    if (!all[p]) {
      fmt::print("cmesh: checkpointer position {} unavailable: {}\n", p,
                 describe(all[p].error()));
      continue;
    }
    const auto& s = *all[p];
    fmt::print("cmesh: checkpointer position {} step={} state={:016x} applied={} seeds={} "
               "checked={} mismatches={} written={} write_failures={} write_skipped={} "
               "last_written={}\n",
               p, s.step, s.state_hash, s.applied, s.seeds, s.checked, s.mismatches, s.written,
               s.write_failures, s.write_skipped, s.last_written);
  }
  std::fflush(stdout);
}

} // namespace

int run_checkpointer(const job_options& job, const std::string& coordinator) {
  auto fail = [](const std::string& what, int rc) {
    fmt::print(stderr, "cmesh: error: {}\n", what);
    return rc;
  };
  const auto& d = job.supervise.durable;
  if (!d.writes())
    return fail("cmesh checkpointer writes checkpoints: give --checkpoint-dir or "
                "--checkpoint-shared",
                2);
  auto where = coordinator.empty() ? env_string("CMESH_COORDINATOR")
                                   : std::optional<std::string>(coordinator);
  if (!where)
    return fail("no coordinator: give --coordinator HOST:PORT or set CMESH_COORDINATOR", 2);
  auto hp = parse_host_port(*where);
  if (!hp)
    return fail(describe(hp.error()), 2);
  auto cfg = resolve_config(job.train, job.world_size, false);
  auto list = cfg ? job_config_of(*cfg, job.train, job.world_size)
                  : expected<config_list>(cfg.error());
  if (!list)
    return fail(describe(list.error()), 2);
  // The model names the tensors of the state (built on the CPU: only its
  // layout is used).
  auto net = model::make_moe_lm_on(cfg->model, model::compute_device::cpu, 0);
  if (!net)
    return fail(describe(net.error()), 2);
  const size_t R = replica_groups(job.train, job.world_size);
  const size_t S = ranks_per_group(job.train, job.world_size);

  struct sigaction sa {};
  sa.sa_handler = [](int sig) { checkpointer_signal.store(sig); };
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);

  caf::actor_system_config sys_cfg;
  tune_actor_system(sys_cfg, 2);
  caf::actor_system sys{sys_cfg};
  actors::checkpointer_options o;
  o.train = cfg->train;
  o.target = target_of(d, *list, **net, 0, R, S, resumed_step(d));
  o.coordinator = *hp;
  net->reset(); // its layout is copied
  auto c = actors::checkpointer::start(sys, std::move(o));
  if (!c)
    return fail(describe(c.error()), 3);
  fmt::print("cmesh: checkpointer for {} replica group(s) x {} rank(s): the writing group's "
             "ranks stream their shards here; checkpoints go to {}\n",
             R, S, fmt::join(d.roots(), " and "));
  std::fflush(stdout);
  std::string why = "the job ended";
  for (;;) {
    if (int sig = checkpointer_signal.load()) {
      why = fmt::format("signal {}", sig);
      break;
    }
    if (auto e = (*c)->poll_links()) {
      if (code_of(e) != errc::closed)
        return fail(describe(e), 1);
      why = "the coordinator is gone";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  // The newest whole step is written before the process ends: after every
  // worker was killed, the restarted ones resume from it.
  auto step = (*c)->flush(std::chrono::seconds(job.timeout_s));
  print_positions(**c);
  if (!step)
    return fail(fmt::format("checkpointer ({}): {}", why, describe(step.error())), 1);
  if (*step == 0)
    fmt::print("cmesh: checkpointer ({}): nothing was fed, nothing written\n", why);
  else
    fmt::print("cmesh: checkpointer ({}): step {} is on disk\n", why, *step);
  std::fflush(stdout);
  return 0;
}

} // namespace cmesh::cli
