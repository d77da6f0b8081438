#include "cli/train.hpp"

#include "actors/trainer.hpp"
#include "collectives/host/host_communicator.hpp"
#include "model/moe_lm.hpp"

#include "core/spawn.hpp"

#include <caf/all.hpp>
#include <fmt/format.h>

#include <future>

namespace cmesh::cli {

expected<model::run_config> resolve_config(const train_flags& f, size_t world_size) {
  auto cfg = f.config_file.empty() ? model::parse_config("") : model::load_config(f.config_file);
  if (!cfg)
    return cfg.error();
  if (!f.data_file.empty())
    cfg->data.file = f.data_file;
  if (f.steps)
    cfg->train.steps = *f.steps;
  if (f.log_every)
    cfg->train.log_every = *f.log_every;
  if (f.exact)
    cfg->train.exact = true;
  size_t replicas = f.replicas == 0 ? world_size : f.replicas;
  if (world_size % replicas != 0)
    return make_error(errc::invalid_argument,
                      fmt::format("{} ranks do not split into {} replica groups", world_size,
                                  replicas));
  size_t per_group = world_size / replicas;
  if (per_group != 1)
    return make_error(errc::invalid_argument,
                      fmt::format("{} ranks per replica group: this build trains one rank per "
                                  "group (--replicas equal to -n)",
                                  per_group));
  if (auto e = model::validate(*cfg, replicas, per_group))
    return e;
  return cfg;
}

namespace {

void print_progress(const actors::step_report& r, size_t every, size_t total) {
  if (r.step % every != 0 && r.step != total && r.step != 1)
    return;
  fmt::print("step {:>5}  loss {:.4f}  aux {:.4f}  tokens/s {:>8.0f}  step {:>6.1f} ms  "
             "comm {:>5.1f} ms  imbalance {:.2f}  dropped {}\n",
             r.step, r.loss, r.aux_loss, r.tokens_per_s, r.step_ms, r.comm_ms,
             r.expert_imbalance, r.dropped);
  std::fflush(stdout);
}

} // namespace

caf::error run_training(joined_mesh& j, const model::run_config& config,
                        std::chrono::seconds timeout) {
  const auto rank = static_cast<uint32_t>(j.place.rank);
  const auto size = static_cast<size_t>(j.place.world_size);
  auto report_failure = [&](const caf::error& e) {
    j.coordinator.report({rank, "failed", describe(e), mono_ns()});
    return e;
  };
  auto data = model::corpus::load(config.data, config.train.seq_len);
  if (!data)
    return report_failure(data.error());
  auto ctx = coll::host_context::create(rank);
  if (!ctx)
    return report_failure(ctx.error());
  if (auto e = j.net->start())
    return report_failure(e);
  coll::membership everyone{1, {}};
  for (uint32_t r = 0; r < size; ++r)
    everyone.ranks.push_back(r);
  auto* net = j.net.get();
  auto comm = coll::make_host_communicator(*ctx, everyone, j.coordinator,
                                           [net](uint32_t r) { return net->peer_error(r); });
  if (!comm)
    return report_failure(comm.error());

  actors::trainer_options opts;
  opts.config = config;
  opts.replicas = size;
  if (rank == 0) {
    fmt::print("cmesh: training {} on {} replica group(s), {} ({} steps, global batch {}, "
               "{}{})\n",
               "the built-in MoE model", size, (*data)->origin(), config.train.steps,
               config.train.global_batch, config.train.precision, config.train.exact ? ", exact" : "");
    size_t every = config.train.log_every, total = config.train.steps;
    opts.on_step = [every, total](const actors::step_report& r) { print_progress(r, every, total); };
  }
  // The trainer runs in its own (detached) actor; this thread waits for it.
  caf::actor_system_config sys_cfg;
  tune_actor_system(sys_cfg, 1);
  caf::actor_system sys{sys_cfg};
  auto done = std::make_shared<std::promise<expected<actors::train_result>>>();
  auto fut = done->get_future();
  auto* c = comm->get();
  spawn_blocking(sys, [done, opts, data = *data, c](caf::blocking_actor*) {
    actors::trainer t(opts, model::make_moe_lm(opts.config.model), data, *c);
    done->set_value(t.run());
  });
  if (fut.wait_for(timeout) != std::future_status::ready) {
    (*comm)->abort(make_error(errc::timeout, "training did not finish in time"));
    fut.wait();
  }
  auto result = fut.get();
  if (!result)
    return report_failure(result.error());
  j.coordinator.report(
    {rank, "done",
     fmt::format("steps={} loss={:.4f} tokens/s={:.0f} seconds={:.1f} weights={:016x}",
                 result->steps, result->final_loss, result->tokens_per_s, result->seconds,
                 result->weights_xxh64),
     mono_ns()});
  return {};
}

} // namespace cmesh::cli
