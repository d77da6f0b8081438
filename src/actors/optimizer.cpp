#include "actors/optimizer.hpp"

#include "core/check.hpp"
#include "kernels/precision.hpp"

#include <algorithm>
#include <cmath>

namespace cmesh::actors {

double learning_rate(const model::train_config& t, uint64_t step) {
  if (step < t.warmup)
    return t.lr * static_cast<double>(step + 1) / static_cast<double>(t.warmup + 1);
  double progress = static_cast<double>(step - t.warmup)
                    / static_cast<double>(std::max<size_t>(1, t.steps - t.warmup));
  return t.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, progress))));
}

kernels::cpu::adamw_params adamw_hyper(const model::train_config& t, uint64_t k) {
  kernels::cpu::adamw_params hp;
  hp.lr = static_cast<float>(learning_rate(t, k));
  hp.beta1 = static_cast<float>(t.beta1);
  hp.beta2 = static_cast<float>(t.beta2);
  hp.eps = static_cast<float>(t.eps);
  hp.weight_decay = static_cast<float>(t.weight_decay);
  return hp;
}

void apply_committed(const model::train_config& t, const train_state& st, uint64_t k,
                     std::span<const float> update) {
  CMESH_CHECK(update.size() == st.params.size());
  CMESH_CHECK(st.adam_m.size() == st.params.size() && st.adam_v.size() == st.params.size());
  const bool skip = is_skipped_update(update);
  if (!skip)
    kernels::cpu::adamw_step(st.params.data(), update.data(), st.adam_m.data(),
                             st.adam_v.data(), st.params.size(), adamw_hyper(t, k), k + 1);
  if (t.precision == "bf16") {
    CMESH_CHECK(st.scalars.size() >= 2);
    kernels::cpu::loss_scaler ls;
    ls.scale = st.scalars[0];
    ls.good_steps = static_cast<uint32_t>(st.scalars[1]);
    ls.max_scale = std::max(ls.max_scale, st.scalars[0]);
    kernels::cpu::update_loss_scale(ls, skip);
    st.scalars[0] = ls.scale;
    st.scalars[1] = static_cast<float>(ls.good_steps);
  }
}

} // namespace cmesh::actors
