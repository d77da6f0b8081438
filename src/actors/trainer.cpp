#include "actors/trainer.hpp"

#include "collectives/exact.hpp"
#include "core/env.hpp"
#include "kernels/optim.hpp"

#include <xxhash.h>

#include <algorithm>
#include <cmath>

namespace cmesh::actors {

namespace {

double now_s() {
  return static_cast<double>(mono_ns()) / 1e9;
}

/// Linear warm-up, then cosine decay to a tenth of the peak.
double learning_rate(const model::train_config& t, uint64_t step) {
  if (step < t.warmup)
    return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup + 1);
  double progress = static_cast<double>(step - t.warmup)
                    / static_cast<double>(std::max<size_t>(1, t.steps - t.warmup));
  return t.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, progress))));
}

/// Worst layer's max expert load over its mean.
double imbalance(const std::vector<float>& loads, size_t experts) {
  double worst = 1.0;
  for (size_t l = 0; experts > 0 && l + experts <= loads.size(); l += experts) {
    double sum = 0, mx = 0;
    for (size_t e = 0; e < experts; ++e) {
      sum += loads[l + e];
      mx = std::max<double>(mx, loads[l + e]);
    }
    if (sum > 0)
      worst = std::max(worst, mx / (sum / static_cast<double>(experts)));
  }
  return worst;
}

} // namespace

struct trainer::impl {
  trainer_options o;
  std::shared_ptr<const model::corpus> data;
  coll::communicator& comm;
  std::vector<float> adam_m, adam_v;
  std::vector<std::vector<float>> contributions; // exact mode: one per micro-batch
  double comm_s = 0;

  impl(trainer_options opts, std::shared_ptr<const model::corpus> d, coll::communicator& c)
      : o(std::move(opts)), data(std::move(d)), comm(c) {}

  /// A collective, timed; the first error latches (later ones are skipped).
  template <class F>
  void collective(caf::error& latched, F&& f) {
    if (latched)
      return;
    double t0 = now_s();
    latched = f();
    comm_s += now_s() - t0;
  }
};

trainer::trainer(trainer_options opts, std::unique_ptr<model::model> m,
                 std::shared_ptr<const model::corpus> data, coll::communicator& comm)
    : impl_(std::make_unique<impl>(std::move(opts), std::move(data), comm)),
      model_(std::move(m)) {
  auto n = model_->parameters().size();
  impl_->adam_m.assign(n, 0.0f);
  impl_->adam_v.assign(n, 0.0f);
}

trainer::~trainer() = default;

expected<train_result> trainer::run() {
  auto& I = *impl_;
  const auto& tc = I.o.config.train;
  auto& net = *model_;
  const size_t micro_total = model::micro_batches_per_step(tc);
  const size_t groups = I.comm.size();
  auto params = net.parameters();
  auto grads = net.gradients();
  train_result result;
  const double t_start = now_s();
  const double tokens_per_step = static_cast<double>(tc.global_batch * tc.seq_len);

  for (uint64_t step = 0; step < tc.steps;) {
    const double t0 = now_s();
    I.comm_s = 0;
    auto mine = model::micro_batches_of(micro_total, groups, I.comm.index());
    // [loss sum, aux sum, dropped, expert loads...], summed over all ranks.
    std::vector<float> stats(3, 0.0f);
    auto account = [&](const model::step_stats& s) {
      stats[0] += static_cast<float>(s.loss);
      stats[1] += static_cast<float>(s.aux_loss);
      stats[2] += static_cast<float>(s.dropped);
      if (stats.size() < 3 + s.expert_load.size())
        stats.resize(3 + s.expert_load.size(), 0.0f);
      for (size_t i = 0; i < s.expert_load.size(); ++i)
        stats[3 + i] += static_cast<float>(s.expert_load[i]);
    };
    caf::error latched;
    net.zero_gradients();
    if (tc.exact) {
      // Each micro-batch's gradient is one contribution, turned into fixed
      // point before any sum, so no float sum depends on the layout.
      I.contributions.resize(mine.size());
      std::vector<std::span<const float>> spans;
      for (size_t k = 0; k < mine.size(); ++k) {
        net.zero_gradients();
        account(net.forward_backward(model::make_micro_batch(*I.data, tc, step, mine[k])));
        I.contributions[k].assign(grads.begin(), grads.end());
        spans.emplace_back(I.contributions[k]);
      }
      I.collective(latched,
                   [&] { return coll::exact_all_reduce(I.comm, spans, grads, micro_total); });
    } else {
      for (auto m : mine)
        account(net.forward_backward(model::make_micro_batch(*I.data, tc, step, m)));
      I.collective(latched, [&] {
        return I.comm.all_reduce(grads.data(), grads.size(), coll::dtype::float32,
                                 coll::reduce_op::sum);
      });
    }
    // Every rank must have the same length of statistics for the reduction.
    stats.resize(3 + net.moe_layers() * net.experts(), 0.0f);
    I.collective(latched, [&] {
      return I.comm.all_reduce(stats.data(), stats.size(), coll::dtype::float32,
                               coll::reduce_op::sum);
    });
    // The commit vote: a no from anyone (or a failed vote) means no commit.
    int64_t vote = latched ? 1 : 0;
    caf::error vote_error;
    I.collective(vote_error, [&] {
      return I.comm.all_reduce(&vote, 1, coll::dtype::int64, coll::reduce_op::max);
    });
    if (latched || vote_error || vote != 0)
      return latched ? latched
                     : vote_error ? vote_error
                                  : make_error(errc::aborted, "step " + std::to_string(step)
                                                                + " was voted down");
    // Committed: the mean gradient over the global batch, then the update.
    kernels::cpu::scale_in_place(grads.data(), 1.0f / static_cast<float>(micro_total),
                                 grads.size());
    if (tc.grad_clip > 0)
      kernels::cpu::clip_to_norm(grads.data(), grads.size(),
                                 kernels::cpu::l2_norm(grads.data(), grads.size()), tc.grad_clip);
    kernels::cpu::adamw_params hp;
    hp.lr = static_cast<float>(learning_rate(tc, step));
    hp.beta1 = static_cast<float>(tc.beta1);
    hp.beta2 = static_cast<float>(tc.beta2);
    hp.eps = static_cast<float>(tc.eps);
    hp.weight_decay = static_cast<float>(tc.weight_decay);
    kernels::cpu::adamw_step(params.data(), grads.data(), I.adam_m.data(), I.adam_v.data(),
                             params.size(), hp, step + 1);
    ++step;
    const double dt = now_s() - t0;
    step_report rep;
    rep.step = step;
    rep.loss = stats[0] / static_cast<double>(micro_total);
    rep.aux_loss = stats[1] / static_cast<double>(micro_total);
    rep.dropped = static_cast<uint64_t>(stats[2]);
    rep.step_ms = dt * 1e3;
    rep.comm_ms = I.comm_s * 1e3;
    rep.tokens_per_s = tokens_per_step / dt;
    rep.expert_imbalance =
      imbalance(std::vector<float>(stats.begin() + 3, stats.end()), net.experts());
    result.final_loss = rep.loss;
    if (I.o.on_step)
      I.o.on_step(rep);
  }
  result.steps = tc.steps;
  result.seconds = now_s() - t_start;
  result.tokens_per_s = tokens_per_step * static_cast<double>(tc.steps) / result.seconds;
  result.weights_xxh64 = XXH64(params.data(), params.size() * sizeof(float), 0);
  return result;
}

} // namespace cmesh::actors
