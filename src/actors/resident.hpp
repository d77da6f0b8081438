// Resident experts (train.experts = "resident"): which elements of the flat
// parameter buffer a rank holds, and in which order its state arrays keep
// them.
//
// With S ranks per replica group, expert e of every MoE layer lives on
// position e * S / E (the static block of E / S experts each), and on no
// other rank of the group: its weights, its gradient and its optimizer state.
// The dense tensors are sharded as before, but over the dense elements only:
// they are packed in flat order ("packed dense", the flat buffer without the
// experts) and split over the S positions in whole norm blocks
// (split_shards). So position p's state is
//   [its piece of packed dense | its experts' units, in flat order]
// and its master, AdamW moments, committed updates, catch-up snapshots all
// hold exactly that, in that order. A restarted rank at position p has the
// same layout as every other rank at p, so catch-up copies arrays as before.
//
// Norm blocks (the clipping norm adds per-block sums of squares in one fixed
// order): the packed dense space in blocks of norm_block, then each expert
// unit, in flat order, in blocks of norm_block from its start. Each
// position's state is a run of whole blocks, so every layout adds the same
// numbers in the same order: S = 1 holds every block and is the reference.
#pragma once

#include "actors/trainer.hpp"
#include "model/model.hpp"

#include <cstddef>
#include <span>
#include <vector>

namespace cmesh::actors {

/// Elements [begin, end) of the flat buffer.
struct flat_range {
  size_t begin = 0, end = 0;
  size_t size() const { return end - begin; }
  bool operator==(const flat_range&) const = default;
};

class resident_layout {
public:
  /// The layout of position `position` of `ranks` ranks per group, for a
  /// model with `experts` experts per layer whose tensors are `tensors`
  /// (expert tensors are those with expert >= 0; one expert of one layer,
  /// its tensors adjacent, is a unit). errc::invalid_argument when the
  /// experts do not divide over the ranks, or the tensors do not tile the
  /// buffer.
  static expected<resident_layout> make(const std::vector<model::tensor_info>& tensors,
                                        size_t experts, size_t ranks, size_t position);

  size_t ranks() const { return ranks_; }
  size_t position() const { return position_; }
  /// Elements of the flat buffer.
  size_t total() const { return total_; }
  /// The flat ranges of the dense tensors (merged, ascending) and their
  /// element count: the packed dense space.
  const std::vector<flat_range>& dense() const { return dense_; }
  size_t dense_total() const { return dense_total_; }
  /// The packed dense space split over the positions (norm blocks).
  const shard_split& dense_split() const { return dense_split_; }
  /// This position's experts' units, ascending, and their element count.
  const std::vector<flat_range>& units() const { return units_[position_]; }
  const std::vector<flat_range>& units_of(size_t p) const { return units_[p]; }
  /// The position hosting expert e.
  size_t host_of(size_t expert) const { return model::static_host(expert, ranks_, experts_); }

  /// Elements of this position's state: its dense piece, then its units.
  size_t state_size() const { return state_size_; }
  size_t dense_piece() const { return dense_split_.counts[position_]; }
  /// The flat ranges of this position's state, in state order.
  const std::vector<flat_range>& state_ranges() const { return state_ranges_; }
  /// The flat element at index i of this position's state.
  size_t flat_of(size_t i) const;
  /// The packed dense index of flat element `flat` of a dense tensor.
  size_t packed_of(size_t flat) const;
  /// The state index of flat element `flat` of one of this position's
  /// experts' units.
  size_t state_of(size_t flat) const;
  /// Every flat range this rank reads or writes: the dense tensors and its
  /// experts' units, ascending.
  std::vector<flat_range> touched() const;

  /// Copies this position's state-order elements out of `flat` into `state`
  /// (state_size() of them), or back (`state` into `flat`).
  void gather_state(std::span<const float> flat, std::span<float> state) const;
  void scatter_state(std::span<const float> state, std::span<float> flat) const;
  /// The same for its experts' units only (the state's tail).
  void gather_units(std::span<const float> flat, std::span<float> state) const;
  void scatter_units(std::span<const float> state, std::span<float> flat) const;
  /// The dense elements of `flat` packed into `packed` (dense_total()), or back.
  void pack_dense(std::span<const float> flat, std::span<float> packed) const;
  void unpack_dense(std::span<const float> packed, std::span<float> flat) const;

  /// Norm blocks: how many in all, and this position's, in state order:
  /// each one's global index and length.
  size_t blocks() const { return blocks_; }
  const std::vector<size_t>& block_ids() const { return block_ids_; }
  const std::vector<size_t>& block_lengths() const { return block_lengths_; }

private:
  size_t ranks_ = 1, position_ = 0, experts_ = 1, total_ = 0;
  std::vector<flat_range> dense_;
  std::vector<size_t> dense_starts_; // packed index where each dense range starts
  size_t dense_total_ = 0;
  shard_split dense_split_;
  std::vector<std::vector<flat_range>> units_; // per position
  std::vector<flat_range> state_ranges_;
  std::vector<size_t> state_starts_; // state index where each state range starts
  std::vector<size_t> unit_starts_;  // state index where each of its units starts
  size_t state_size_ = 0;
  size_t blocks_ = 0;
  std::vector<size_t> block_ids_, block_lengths_;
};

} // namespace cmesh::actors
