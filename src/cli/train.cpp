#include "cli/train.hpp"

#include "actors/supervisor.hpp"
#include "actors/checkpoint.hpp"
#include "actors/checkpointer.hpp"
#include "actors/trainer.hpp"
#include "collectives/host/host_communicator.hpp"
#include "kernels/gemm.hpp"
#include "kernels/device.hpp"
#include "model/moe_lm.hpp"
#include "transport/mesh.hpp"

#include "core/env.hpp"
#include "core/spawn.hpp"

#include <caf/all.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <sys/resource.h>
#include <unistd.h>

#include <future>
#include <optional>
#include <variant>
#include <memory>
#include <thread>

namespace cmesh::cli {

expected<model::run_config> resolve_config(const train_flags& f, size_t world_size,
                                           bool check_device) {
  auto cfg = f.config_file.empty() ? model::parse_config("") : model::load_config(f.config_file);
  if (!cfg)
    return cfg.error();
  if (!f.data_file.empty())
    cfg->data.file = f.data_file;
  if (f.steps)
    cfg->train.steps = *f.steps;
  if (f.log_every)
    cfg->train.log_every = *f.log_every;
  if (f.verify_every)
    cfg->train.verify_every = *f.verify_every;
  if (f.exact)
    cfg->train.exact = true;
  if (!f.device.empty())
    cfg->train.device = f.device;
  if (check_device && cfg->train.device == "cuda") {
    // Said at once, not after the mesh has formed.
    const auto acc = kernels::query_accelerators();
    if (!acc.cuda_compiled || acc.devices.empty())
      return make_error(errc::invalid_argument,
                        "--device cuda: " + std::string(acc.cuda_compiled ? "no CUDA device"
                                                                          : "built without CUDA")
                          + " (" + kernels::describe(acc) + ")");
  }
  size_t replicas = replica_groups(f, world_size);
  if (world_size % replicas != 0)
    return make_error(errc::invalid_argument,
                      fmt::format("{} ranks do not split into {} replica groups", world_size,
                                  replicas));
  size_t per_group = world_size / replicas;
  if (auto e = model::validate(*cfg, replicas, per_group))
    return e;
  return cfg;
}

expected<config_list> job_config_of(const model::run_config& c, const train_flags& f,
                                    size_t world_size) {
  return model::canonical_config(c, replica_groups(f, world_size), ranks_per_group(f, world_size));
}

namespace {

void print_progress(const actors::step_report& r, size_t every, size_t total) {
  if (r.step % every != 0 && r.step != total && r.step != 1)
    return;
  fmt::print("step {:>5}  loss {:.4f}  aux {:.4f}  tokens/s {:>8.0f}  step {:>6.1f} ms  "
             "comm {:>5.1f} ms  imbalance {:.2f}  dropped {}{}\n",
             r.step, r.loss, r.aux_loss, r.tokens_per_s, r.step_ms, r.comm_ms,
             r.expert_imbalance, r.dropped,
             r.host_imbalance > 0 ? fmt::format("  hosts {:.2f}", r.host_imbalance) : "");
  std::fflush(stdout);
}

// The rank's own figures, printed after its "done" report: the matrix
// products' rate and time (kernels::cpu::gemm_counters), the committed
// steps' summed time, the peak resident memory, and the actor mesh's peers
// (connections made as the membership changed, incarnations lost, frames
// of another incarnation dropped). With CMESH_GEMM_SHAPES set, one line per
// distinct product shape follows (bench/train reads them).
void print_stats(uint32_t rank, double step_ms_total, double verify_ms,
                 const transport_stats& mesh) {
  const auto g = kernels::cpu::gemm_counters();
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru); // ru_maxrss in KiB
  fmt::print("cmesh: rank {} stats gemm_gflops={:.2f} gemm_ms={:.1f} gemm_calls={} "
             "step_ms_total={:.1f} max_rss_mb={:.1f} verify_ms={:.3f} mesh_connected={} "
             "mesh_lost={} mesh_stale={}\n",
             rank, g.ns ? static_cast<double>(g.flops) / static_cast<double>(g.ns) : 0.0,
             static_cast<double>(g.ns) / 1e6, g.calls, step_ms_total,
             static_cast<double>(ru.ru_maxrss) / 1024.0, verify_ms, mesh.peers_connected,
             mesh.peers_lost, mesh.frames_stale);
  if (env_string("CMESH_GEMM_SHAPES"))
    for (const auto& s : kernels::cpu::gemm_shape_counters())
      fmt::print("cmesh: rank {} gemm shape={}{} m={} n={} k={} calls={} ms={:.3f}\n", rank,
                 s.trans_a ? 'T' : 'N', s.trans_b ? 'T' : 'N', s.m, s.n, s.k, s.calls,
                 static_cast<double>(s.ns) / 1e6);
  std::fflush(stdout);
}

/// Where the checkpoint shadow stands against the trainer's final state.
void print_shadow(uint32_t rank, actors::shadow_feed& feed, const actors::train_result& r) {
  auto s = feed.status(std::chrono::seconds(10));
  if (!s) {
    fmt::print("cmesh: rank {} shadow unavailable: {}\n", rank, describe(s.error()));
  } else {
    fmt::print("cmesh: rank {} shadow step={} state={:016x} trainer_step={} trainer_state={:016x} "
               "applied={} seeds={} dropped={} checked={} mismatches={} written={} "
               "write_failures={} write_skipped={} last_written={} restarts={}\n",
               rank, s->step, s->state_hash, r.steps, r.state_hash, s->applied, s->seeds,
               feed.dropped(), s->checked, s->mismatches, s->written, s->write_failures,
               s->write_skipped, s->last_written, feed.restarts());
  }
  std::fflush(stdout);
}

/// The supervisor's options for this worker.
actors::supervisor_options supervisor_options_of(joined_mesh& j, mesh& actor_mesh,
                                                 const model::run_config& config,
                                                 std::chrono::milliseconds step_timeout,
                                                 int catchup_nice) {
  const auto rank = static_cast<uint32_t>(j.place.rank);
  actors::supervisor_options ao;
  ao.rank = rank;
  ao.incarnation = j.incarnation;
  ao.coordinator = j.coordinator_address;
  ao.registration = j.registration;
  ao.step_timeout = step_timeout;
  ao.catchup_nice = catchup_nice;
  ao.net = j.net.get();
  ao.actor_mesh = &actor_mesh;
  // The gradient's sum over the groups on the device (trainer.hpp): NCCL
  // on the model's GPU, or the host backend over the emulated device.
  if (config.train.device == "emulated")
    ao.device_collectives = actors::supervisor_options::device_kind::host;
#ifdef CMESH_HAVE_NCCL
  if (config.train.device == "cuda") {
    ao.device_collectives = actors::supervisor_options::device_kind::nccl;
    const auto acc = kernels::query_accelerators();
    if (!acc.devices.empty())
      ao.device = static_cast<int>(rank % acc.devices.size()); // the model's GPU
  }
#endif
  return ao;
}

/// Rank 0's first line: what trains on what.
void announce_training(const model::run_config& config, size_t replicas, size_t size,
                       const std::string& origin, const shadow_flags& shadow) {
  fmt::print("cmesh: training {} on {} replica group(s) x {} rank(s), {} ({} steps, global "
             "batch {}, {}{}{}{})\n",
             "the built-in MoE model", replicas, size / replicas, origin, config.train.steps,
             config.train.global_batch, config.train.precision,
             config.model.activations == "bf16" ? ", bf16 activations" : "",
             model::bf16_products(config.model, config.train.device != "cpu") ? ", bf16 products"
                                                                              : "",
             config.train.exact ? ", exact" : "");
  if (shadow.resume) {
    const auto& c = *shadow.resume->ckpt;
    fmt::print("cmesh: resuming from {} (step {}, written by {} replica group(s) x {} "
               "rank(s)){}\n",
               c.dir(), c.step(), c.info().meta.replicas, c.info().meta.ranks_per_group,
               shadow.resume->note.empty() ? "" : "; " + shadow.resume->note);
  }
}

/// Where the committed steps go besides the trainer: the checkpoint shadow
/// made beside the model (which names its tensors), or, with
/// --checkpointer, the feed of the process that holds the shadows.
struct commit_sinks {
  std::unique_ptr<actors::shadow_feed> feed;
  std::unique_ptr<actors::checkpointer_feed> remote;

  actors::commit_listener* make(caf::actor_system& sys, joined_mesh& j,
                                const model::run_config& config, const shadow_flags& shadow,
                                model::model& net, size_t replicas, actors::supervisor& sup) {
    const auto rank = static_cast<uint32_t>(j.place.rank);
    const auto size = static_cast<size_t>(j.place.world_size);
    if (shadow.durable.checkpointer && shadow.durable.writes()) {
      actors::checkpointer_feed_options co;
      co.train = config.train;
      co.coordinator = j.coordinator_address;
      co.rank = rank;
      co.ranks_per_group = static_cast<uint32_t>(size / replicas);
      co.check = shadow.check;
      co.every = shadow.durable.every;
      co.every_time = shadow.durable.every_time();
      remote = std::make_unique<actors::checkpointer_feed>(sys, std::move(co));
      return remote.get();
    }
    if (!shadow.on && !shadow.durable.writes())
      return nullptr;
    actors::shadow_options so{config.train, 8, shadow.check, {}, {}};
    // The shadow holds a copy of the trainer's state: one that dies is
    // restarted, seeded at the next step boundary.
    so.supervise = [&sup](const caf::actor& a, std::function<void()> died) {
      sup.watch(a, "checkpoint shadow", [died](const caf::error&) { died(); });
    };
    if (shadow.durable.writes())
      so.target = target_of(shadow.durable, shadow.config, net, rank, replicas, size / replicas,
                            shadow.resume ? shadow.resume->ckpt->step() : 0);
    feed = std::make_unique<actors::shadow_feed>(sys, std::move(so));
    return feed.get();
  }

  /// The last step's checkpoint is on disk (or at least its update reached
  /// the checkpointer's shadow) before the rank says it is done.
  void drain(uint32_t rank, const shadow_flags& shadow, uint64_t steps,
             std::chrono::seconds timeout) {
    if (feed && shadow.durable.writes())
      if (auto s = feed->drain(steps, timeout); !s)
        spdlog::error("rank {}: {}", rank, describe(s.error()));
    if (remote)
      if (auto e = remote->drain(std::chrono::seconds(60)))
        spdlog::error("rank {}: {}", rank, describe(e));
  }

  void print(uint32_t rank, const actors::train_result& result) {
    if (feed)
      print_shadow(rank, *feed, result);
    if (remote) {
      const auto st = remote->stats();
      fmt::print("cmesh: rank {} checkpointer feed linked={} links={} seeds={} sent={} "
                 "dropped={} acked={} refused={}\n",
                 rank, st.linked, st.links, st.seeds, st.sent, st.dropped, st.acked, st.refused);
      std::fflush(stdout);
    }
  }
};

/// Waits for the trainer while the job may end (the coordinator's shutdown:
/// the others finished, or the job failed) or time out: either stops the
/// supervisor, which aborts whatever the trainer waits on. The result, or
/// the exit code of a job that ended first (nullopt: timed out).
std::variant<expected<actors::train_result>, std::optional<int>>
wait_trainer(actors::supervisor& sup, std::future<expected<actors::train_result>>& fut,
             uint32_t rank, std::chrono::seconds timeout) {
  auto give_up = std::chrono::steady_clock::now() + timeout;
  while (fut.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready) {
    auto sd = sup.client()->wait_shutdown(std::chrono::milliseconds(0));
    if (!sd && std::chrono::steady_clock::now() <= give_up)
      continue;
    sup.stop();
    fut.wait();
    if (!sd)
      break;
    auto r = fut.get();
    // Finished just in time, or cut short by the end of the job.
    if (!r)
      spdlog::info("rank {}: the job ended first ({}): {}", rank, sd->reason,
                   describe(r.error()));
    return std::optional<int>(sd->exit_code);
  }
  return fut.get();
}

/// Beacons go on until the job ends, so the coordinator never mistakes a
/// finished rank for a dead one while the others finish. A coordinator
/// that is away is waited for (the supervisor reconnects to its restart).
expected<int> await_shutdown(actors::supervisor& sup, std::chrono::seconds timeout) {
  auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto sd = sup.client()->wait_shutdown(std::chrono::milliseconds(200));
    if (sd) {
      sup.stop();
      return sd->exit_code;
    }
    if (std::chrono::steady_clock::now() > until) {
      sup.stop();
      return make_error(errc::timeout, "waiting for the coordinator's shutdown: "
                                         + describe(sd.error()));
    }
    if (code_of(sd.error()) == errc::closed)
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

/// The trainer actor's work: the model built on its device, then the run.
expected<actors::train_result> build_and_train(caf::actor_system& sys, joined_mesh& j,
                                               const model::run_config& config,
                                               const shadow_flags& shadow, size_t replicas,
                                               actors::supervisor& sup, commit_sinks& sinks,
                                               actors::trainer_options opts,
                                               std::shared_ptr<const model::corpus> data) {
  const auto rank = static_cast<uint32_t>(j.place.rank);
  const auto& d = opts.config.train.device;
  const auto where = d == "cuda"       ? model::compute_device::cuda
                     : d == "emulated" ? model::compute_device::emulated
                                       : model::compute_device::cpu;
  auto net = model::make_moe_lm_on(opts.config.model, where, rank);
  if (!net)
    return net.error();
  opts.listener = sinks.make(sys, j, config, shadow, **net, replicas, sup);
  actors::trainer t(opts, std::move(*net), std::move(data), sup, rank);
  return t.run();
}

/// The trainer's options: the layout, the progress lines (and each step's
/// time summed into `step_ms_total`), and the checkpoint to resume from.
actors::trainer_options trainer_options_of(const model::run_config& config, size_t replicas,
                                           size_t size, const shadow_flags& shadow,
                                           std::shared_ptr<double> step_ms_total) {
  actors::trainer_options opts;
  opts.config = config;
  opts.replicas = replicas;
  opts.ranks_per_group = size / replicas;
  size_t every = config.train.log_every, total = config.train.steps;
  opts.on_step = [every, total, step_ms_total](const actors::step_report& r) {
    *step_ms_total += r.step_ms;
    if (r.first_member)
      print_progress(r, every, total);
  };
  if (shadow.resume)
    opts.load = loader_of(*shadow.resume);
  return opts;
}

} // namespace

expected<int> run_training(joined_mesh& j, const model::run_config& config, size_t replicas,
                           std::chrono::seconds timeout, std::chrono::milliseconds step_timeout,
                           int catchup_nice, const shadow_flags& shadow) {
  const auto rank = static_cast<uint32_t>(j.place.rank);
  const auto size = static_cast<size_t>(j.place.world_size);
  auto report_failure = [&](const caf::error& e) {
    j.coordinator.report({rank, code_of(e) == errc::fenced ? "fenced" : "failed", describe(e),
                          mono_ns()});
    return e;
  };
  auto data = model::corpus::load(config.data, config.train.seq_len);
  if (!data)
    return report_failure(data.error());
  auto ctx = coll::host_context::create(rank);
  if (!ctx)
    return report_failure(ctx.error());
  // One actor system per worker: the supervisor, the trainer, the
  // checkpoint shadow and the mesh's proxies live in it.
  caf::actor_system_config sys_cfg;
  tune_actor_system(sys_cfg, 1);
  caf::actor_system sys{sys_cfg};
  // The actor mesh over the worker's transport: the supervisor is published
  // on it (catch-up sessions run over it), the transport's detector reports
  // to the supervisor, and its peers follow the membership (the supervisor
  // dials them).
  mesh actor_mesh(sys, *j.net);
  // The supervisor owns the coordinator connection from here on (it
  // reconnects to a coordinator that restarts).
  actors::supervisor sup(sys, supervisor_options_of(j, actor_mesh, config, step_timeout, catchup_nice),
                         std::move(j.coordinator), *ctx);
  sup.start();
  auto report_failure_late = [&](const caf::error& e) {
    sup.client()->report({rank, code_of(e) == errc::fenced ? "fenced" : "failed", describe(e),
                          mono_ns()});
    return e;
  };
  if (rank == 0)
    announce_training(config, replicas, size, (*data)->origin(), shadow);
  auto step_ms_total = std::make_shared<double>(0.0); // read once the trainer is done
  auto opts = trainer_options_of(config, replicas, size, shadow, step_ms_total);
  actor_mesh.watch_peers(sup.actor());
  if (auto e = j.net->start())
    return report_failure_late(e);
  commit_sinks sinks;
  // The trainer runs in its own (detached) actor, which the supervisor
  // watches; this thread waits for it.
  auto done = std::make_shared<std::promise<expected<actors::train_result>>>();
  auto fut = done->get_future();
  auto trainer_actor = spawn_blocking(sys, [&, done, opts, data = *data](caf::blocking_actor* self) {
    // An exception (a bug) ends the actor with its reason, for the
    // supervisor that watches it.
    try {
      done->set_value(build_and_train(sys, j, config, shadow, replicas, sup, sinks, opts, data));
    } catch (const std::exception& e) {
      self->fail_state(make_error(errc::crashed, e.what()));
    }
  });
  sup.watch(trainer_actor, "trainer");
  auto waited = wait_trainer(sup, fut, rank, timeout);
  if (auto* ended = std::get_if<std::optional<int>>(&waited); ended && *ended)
    return **ended;
  auto result = std::get<0>(std::move(waited));
  if (!result) {
    sup.stop();
    report_failure_late(result.error());
    if (code_of(result.error()) == errc::fenced)
      return exit_fenced;
    return result.error();
  }
  ::alarm(0); // a stop's deadline (run_worker) is for a rank that never trained
  sinks.drain(rank, shadow, result->steps, timeout);
  if (result->stopped && rank == 0)
    fmt::print("cmesh: stopped after step {} on request{}\n", result->steps,
               shadow.durable.writes() ? "; --resume latest goes on from there" : "");
  sup.finished(result->steps,
               {rank, "done",
                fmt::format("steps={} loss={:.4f} tokens/s={:.0f} seconds={:.1f} "
                            "expert_mib={:.3f} weights={:016x}",
                            result->steps, result->final_loss, result->tokens_per_s,
                            result->seconds, static_cast<double>(result->expert_bytes) / (1 << 20),
                            result->weights_xxh64),
                mono_ns()});
  print_stats(rank, *step_ms_total, result->verify_ms, j.net->stats());
  sinks.print(rank, *result);
  return await_shutdown(sup, timeout);
}

} // namespace cmesh::cli
