// The optimizer every holder of a shard's state runs: the trainer on its
// shard, and the checkpoint actor's shadow on its copy. AdamW at the
// learning rate of step k (linear warm-up, then cosine decay to a tenth of
// the peak), and in bf16 runs the dynamic loss scale. Bit-exact: the same
// state and the same committed update give the same bits anywhere, which
// is what lets a shadow (or a replica) follow the trainers by replaying
// their updates.
#pragma once

#include "actors/trainer.hpp"
#include "kernels/optim.hpp"
#include "model/config.hpp"

#include <span>

namespace cmesh::actors {

/// The learning rate of step `step` (0-based).
double learning_rate(const model::train_config& t, uint64_t step);

/// AdamW's parameters for step `k`.
kernels::cpu::adamw_params adamw_hyper(const model::train_config& t, uint64_t k);

/// Applies the committed update of step `k` (the final, averaged and
/// clipped gradient of the shard, or a skipped step's NaNs) to a shard's
/// state at step k: AdamW on params with its moments, and with
/// train.precision = "bf16" the loss scale in `scalars` (scale, good steps).
/// `st.step` is not moved.
void apply_committed(const model::train_config& t, const train_state& st, uint64_t k,
                     std::span<const float> update);

} // namespace cmesh::actors
