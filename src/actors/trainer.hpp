// The trainer: one per rank, the step loop of HSDP training.
//
//   load this rank's micro-batches of the step (a pure function of seed,
//   step and the epoch's membership) -> forward/backward -> reduce the
//   gradients over the replica groups (exact mode: 64-bit fixed point, so
//   the sum is the same whatever the layout) -> commit vote -> optimizer.
//
// The commit vote: after the gradient reduction every rank votes; the step
// commits only if every rank of every live group voted yes (an all_reduce of
// the votes). Errors are latched: once a collective of a step failed, the
// step's later collectives are skipped and the vote is no. The step counter
// moves only on commit, and the optimizer runs only on commit, so a failed
// step is retried whole.
//
// Layout so far: R replica groups of one rank each (pure data parallel, all
// experts on every rank); sharding inside a group builds on the same loop.
#pragma once

#include "collectives/communicator.hpp"
#include "model/config.hpp"
#include "model/data.hpp"
#include "model/model.hpp"

#include <functional>
#include <memory>

namespace cmesh::actors {

struct step_report {
  uint64_t step = 0;            // the step that committed
  double loss = 0;              // mean over the global batch
  double aux_loss = 0;
  double tokens_per_s = 0;
  double step_ms = 0;
  double comm_ms = 0;           // waiting on collectives
  double expert_imbalance = 1;  // max expert load / mean, worst layer
  uint64_t dropped = 0;
  bool skipped = false;         // dynamic loss scaling skipped the update
};

struct train_result {
  uint64_t steps = 0;
  double final_loss = 0;
  double seconds = 0;
  double tokens_per_s = 0;
  uint64_t weights_xxh64 = 0;   // of the final fp32 weights, to compare runs
};

struct trainer_options {
  model::run_config config;
  size_t replicas = 1;
  size_t ranks_per_group = 1;
  std::function<void(const step_report&)> on_step; // called on every commit
};

/// The step loop over a communicator of every rank (one per replica group).
class trainer {
public:
  trainer(trainer_options opts, std::unique_ptr<model::model> m,
          std::shared_ptr<const model::corpus> data, coll::communicator& comm);
  ~trainer();

  /// Runs until config.train.steps committed steps. Errors: from the
  /// collectives (peer_lost, timeout, ...), overflow in exact mode.
  expected<train_result> run();

  model::model& net() { return *model_; }

private:
  struct impl;
  std::unique_ptr<impl> impl_;
  std::unique_ptr<model::model> model_;
};

} // namespace cmesh::actors
