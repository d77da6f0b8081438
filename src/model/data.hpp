// Training data: a byte corpus (any text file, or the built-in synthetic
// one) and a deterministic, stateless loader. The samples of step s are a
// pure function of (seed, s): sample i starts at hash(seed, s, i). A step's
// global batch is cut into micro-batches (the unit of contribution), and the
// micro-batches are dealt to the live replica groups by their position in
// the epoch's sorted membership, then to the ranks of a group. So no sample
// is skipped or repeated when membership changes, and a run restarted at
// any step sees exactly the samples a continuous run would.
#pragma once

#include "core/error.hpp"
#include "model/config.hpp"
#include "model/model.hpp"

#include <cstdint>
#include <memory>
#include <vector>

namespace cmesh::model {

class corpus {
public:
  /// The file named by the config, or the synthetic corpus when none is.
  /// Errors: invalid_argument (unreadable, or shorter than one sample).
  static expected<std::shared_ptr<const corpus>> load(const data_config& d, size_t seq_len);

  /// A deterministic English-like text of about `bytes` bytes.
  static std::shared_ptr<const corpus> synthetic(size_t bytes = 1 << 20);

  size_t size() const { return bytes_.size(); }
  const uint8_t* data() const { return bytes_.data(); }
  const std::string& origin() const { return origin_; }

private:
  std::vector<uint8_t> bytes_;
  std::string origin_;
};

/// Micro-batch `micro` of step `step`: train.micro_batch sequences of
/// train.seq_len + 1 bytes.
batch make_micro_batch(const corpus& c, const train_config& t, uint64_t step, size_t micro);

/// Micro-batches per step.
inline size_t micro_batches_per_step(const train_config& t) {
  return t.global_batch / t.micro_batch;
}

/// Indices of the micro-batches a rank processes at a step: the step's
/// micro-batches dealt in contiguous runs to `groups` groups (this one at
/// `group_position` in the sorted live membership), then to the group's
/// `ranks` ranks.
std::vector<size_t> micro_batches_of(size_t micro_batches, size_t groups, size_t group_position,
                                     size_t ranks = 1, size_t rank_in_group = 0);

} // namespace cmesh::model
