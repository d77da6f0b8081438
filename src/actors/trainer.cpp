#include "actors/trainer.hpp"

#include "collectives/exact.hpp"
#include "core/check.hpp"
#include "core/env.hpp"
#include "kernels/optim.hpp"

#include <xxhash.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <chrono>
#include <deque>
#include <thread>

namespace cmesh::actors {

namespace {

std::atomic<bool> hang_requested{false};

/// A chaos hang: the computation never ends (until the process is killed).
void maybe_hang() {
  while (hang_requested.load(std::memory_order_relaxed))
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

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

void request_hang() {
  hang_requested.store(true, std::memory_order_relaxed);
}

struct trainer::impl {
  trainer_options o;
  std::shared_ptr<const model::corpus> data;
  coll::communicator* comm = nullptr; // the current epoch's
  supervision* sup = nullptr;         // elastic runs only
  std::vector<float> adam_m, adam_v;
  std::vector<std::vector<float>> contributions; // exact mode: one per micro-batch
  std::deque<std::pair<uint64_t, std::vector<float>>> recent; // committed updates, oldest first
  double comm_s = 0;

  impl(trainer_options opts, std::shared_ptr<const model::corpus> d)
      : o(std::move(opts)), data(std::move(d)) {}

  /// A collective, timed; the first error latches (later ones are skipped).
  template <class F>
  void collective(caf::error& latched, F&& f) {
    if (latched)
      return;
    double t0 = now_s();
    latched = f();
    comm_s += now_s() - t0;
  }

  kernels::cpu::adamw_params hyper(uint64_t k) const;
  void apply(std::span<float> params, uint64_t k, std::span<const float> update);
  void remember(uint64_t k, std::span<const float> update);
  caf::error reconcile(train_state& st);
};

trainer::trainer(trainer_options opts, std::unique_ptr<model::model> m,
                 std::shared_ptr<const model::corpus> data, coll::communicator& comm)
    : impl_(std::make_unique<impl>(std::move(opts), std::move(data))), model_(std::move(m)) {
  impl_->comm = &comm;
  auto n = model_->parameters().size();
  impl_->adam_m.assign(n, 0.0f);
  impl_->adam_v.assign(n, 0.0f);
}

trainer::trainer(trainer_options opts, std::unique_ptr<model::model> m,
                 std::shared_ptr<const model::corpus> data, supervision& sup)
    : impl_(std::make_unique<impl>(std::move(opts), std::move(data))), model_(std::move(m)) {
  impl_->sup = &sup;
  auto n = model_->parameters().size();
  impl_->adam_m.assign(n, 0.0f);
  impl_->adam_v.assign(n, 0.0f);
}

trainer::~trainer() = default;

kernels::cpu::adamw_params trainer::impl::hyper(uint64_t k) const {
  const auto& tc = o.config.train;
  kernels::cpu::adamw_params hp;
  hp.lr = static_cast<float>(learning_rate(tc, k));
  hp.beta1 = static_cast<float>(tc.beta1);
  hp.beta2 = static_cast<float>(tc.beta2);
  hp.eps = static_cast<float>(tc.eps);
  hp.weight_decay = static_cast<float>(tc.weight_decay);
  return hp;
}

void trainer::impl::apply(std::span<float> params, uint64_t k, std::span<const float> update) {
  kernels::cpu::adamw_step(params.data(), update.data(), adam_m.data(), adam_v.data(),
                           params.size(), hyper(k), k + 1);
}

void trainer::impl::remember(uint64_t k, std::span<const float> update) {
  if (o.replay_window == 0)
    return;
  std::vector<float> slot;
  if (recent.size() >= o.replay_window) {
    slot = std::move(recent.front().second);
    recent.pop_front();
  }
  slot.assign(update.begin(), update.end());
  recent.emplace_back(k, std::move(slot));
}

caf::error trainer::impl::reconcile(train_state& st) {
  const size_t n = comm->size(), me = comm->index();
  // [step of each member..., oldest update each member still holds...]
  std::vector<int64_t> steps(2 * n, -1);
  steps[me] = static_cast<int64_t>(st.step);
  steps[n + me] = recent.empty() ? static_cast<int64_t>(st.step)
                                 : static_cast<int64_t>(recent.front().first);
  if (auto e = comm->all_reduce(steps.data(), 2 * n, coll::dtype::int64, coll::reduce_op::max))
    return e;
  const int64_t hi = *std::max_element(steps.begin(), steps.begin() + n);
  const int64_t lo = *std::min_element(steps.begin(), steps.begin() + n);
  if (hi == lo)
    return {};
  const size_t leader = static_cast<size_t>(std::find(steps.begin(), steps.end(), hi) - steps.begin());
  const int64_t oldest = steps[n + leader];
  for (size_t i = 0; i < n; ++i) {
    if (steps[i] < oldest) {
      auto who = comm->members().ranks[i];
      return make_error(i == me ? errc::fenced : errc::aborted,
                        fmt::format("rank {} is at step {}, behind the oldest update (step {}) "
                                    "that rank {} at step {} still holds",
                                    who, steps[i], oldest, comm->members().ranks[leader], hi));
    }
  }
  std::vector<float> update(st.params.size());
  for (int64_t k = lo; k < hi; ++k) {
    if (me == leader) {
      auto it = std::find_if(recent.begin(), recent.end(),
                             [&](const auto& r) { return r.first == static_cast<uint64_t>(k); });
      CMESH_CHECK(it != recent.end()); // the window covers hi - lo steps, checked above
      update = it->second;
    }
    if (auto e = comm->broadcast(update.data(), update.size(), coll::dtype::float32, leader))
      return e;
    if (static_cast<int64_t>(st.step) == k) {
      apply(st.params, static_cast<uint64_t>(k), update);
      remember(static_cast<uint64_t>(k), update);
      ++st.step;
    }
  }
  spdlog::info("trainer: reconciled epoch {}: steps {}..{}, {} update(s) replayed", comm->members().epoch,
               lo, hi, hi - lo);
  return {};
}

expected<train_result> trainer::run() {
  auto& I = *impl_;
  const auto& tc = I.o.config.train;
  auto& net = *model_;
  const size_t micro_total = model::micro_batches_per_step(tc);
  auto params = net.parameters();
  auto grads = net.gradients();
  train_result result;
  const double t_start = now_s();
  const double tokens_per_step = static_cast<double>(tc.global_batch * tc.seq_len);
  train_state st{0, params, I.adam_m, I.adam_v};
  apply_update replay = [&](uint64_t k, std::span<const float> u) {
    I.apply(params, k, u);
    I.remember(k, u);
  };
  uint64_t committed_here = 0; // steps this process computed and committed

  // Enters the next epoch (after a failure `why`, or an agreed switch) and
  // reconciles its members; retried while the new epoch fails too.
  auto enter = [&](caf::error why) -> caf::error {
    for (;;) {
      uint64_t after = I.comm ? I.comm->members().epoch : 0;
      auto c = I.sup->enter_epoch(after, why, st, replay);
      if (!c)
        return c.error();
      I.comm = *c;
      auto e = I.reconcile(st);
      if (!e)
        return {};
      if (code_of(e) == errc::fenced)
        return e;
      spdlog::warn("trainer: epoch {} failed while reconciling: {}", after, describe(e));
      why = e;
    }
  };
  if (I.sup)
    if (auto e = enter({}))
      return e;

  uint64_t switch_to = 0;
  while (st.step < tc.steps) {
    if (I.sup && switch_to > I.comm->members().epoch) {
      if (auto e = enter({}))
        return e;
      switch_to = 0;
      continue;
    }
    if (I.sup)
      I.sup->at_boundary(st);
    const uint64_t step = st.step;
    auto& comm = *I.comm;
    const size_t groups = comm.size();
    const double t0 = now_s();
    I.comm_s = 0;
    auto mine = model::micro_batches_of(micro_total, groups, comm.index());
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
    if (I.sup)
      I.sup->computing(true);
    maybe_hang();
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
      if (mine.empty())
        net.zero_gradients();
      if (I.sup)
        I.sup->computing(false);
      I.collective(latched,
                   [&] { return coll::exact_all_reduce(comm, spans, grads, micro_total); });
    } else {
      for (auto m : mine)
        account(net.forward_backward(model::make_micro_batch(*I.data, tc, step, m)));
      if (I.sup)
        I.sup->computing(false);
      I.collective(latched, [&] {
        return comm.all_reduce(grads.data(), grads.size(), coll::dtype::float32,
                               coll::reduce_op::sum);
      });
    }
    // Every rank must have the same length of statistics for the reduction.
    stats.resize(3 + net.moe_layers() * net.experts(), 0.0f);
    I.collective(latched, [&] {
      return comm.all_reduce(stats.data(), stats.size(), coll::dtype::float32,
                             coll::reduce_op::sum);
    });
    // The commit vote: a no from anyone (or a failed vote) means no commit.
    // The second entry is the newest epoch anyone has heard of.
    int64_t vote[2] = {latched ? 1 : 0,
                       I.sup ? static_cast<int64_t>(I.sup->newest_epoch()) : 0};
    caf::error vote_error;
    I.collective(vote_error, [&] {
      return comm.all_reduce(vote, 2, coll::dtype::int64, coll::reduce_op::max);
    });
    if (latched || vote_error || vote[0] != 0) {
      auto why = latched ? latched
                 : vote_error ? vote_error
                              : make_error(errc::aborted, "step " + std::to_string(step)
                                                            + " was voted down");
      if (!I.sup)
        return why;
      spdlog::warn("trainer: step {} failed in epoch {}: {}; retrying it in the next epoch",
                   step, comm.members().epoch, describe(why));
      if (auto e = enter(why))
        return e;
      continue;
    }
    // Committed: the mean gradient over the global batch, then the update.
    kernels::cpu::scale_in_place(grads.data(), 1.0f / static_cast<float>(micro_total),
                                 grads.size());
    if (tc.grad_clip > 0)
      kernels::cpu::clip_to_norm(grads.data(), grads.size(),
                                 kernels::cpu::l2_norm(grads.data(), grads.size()), tc.grad_clip);
    I.apply(params, step, grads);
    if (I.sup) {
      I.remember(step, grads);
      I.sup->committed(step, grads);
      switch_to = static_cast<uint64_t>(vote[1]);
    }
    ++st.step;
    ++committed_here;
    const double dt = now_s() - t0;
    step_report rep;
    rep.step = st.step;
    rep.loss = stats[0] / static_cast<double>(micro_total);
    rep.aux_loss = stats[1] / static_cast<double>(micro_total);
    rep.dropped = static_cast<uint64_t>(stats[2]);
    rep.step_ms = dt * 1e3;
    rep.comm_ms = I.comm_s * 1e3;
    rep.tokens_per_s = tokens_per_step / dt;
    rep.epoch = comm.members().epoch;
    rep.first_member = comm.index() == 0;
    rep.expert_imbalance =
      imbalance(std::vector<float>(stats.begin() + 3, stats.end()), net.experts());
    result.final_loss = rep.loss;
    if (I.o.on_step)
      I.o.on_step(rep);
  }
  result.steps = st.step;
  result.seconds = now_s() - t_start;
  result.tokens_per_s =
    tokens_per_step * static_cast<double>(committed_here) / std::max(result.seconds, 1e-9);
  result.weights_xxh64 = XXH64(params.data(), params.size() * sizeof(float), 0);
  return result;
}

} // namespace cmesh::actors
