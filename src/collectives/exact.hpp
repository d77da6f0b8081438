// Exact mode: float32 gradients summed as 64-bit fixed point, so the result is
// bit-identical whatever the order of the contributions and however they
// were spread over the ranks.
//
// The unit of contribution is one micro-batch's float32 gradient (computed
// the same way wherever it runs). No float addition ever happens between
// contributions; the protocol is:
//
// Phase 1 (agree on a range). Every rank computes max |x| over its local
//   contributions (observe()). The global maximum is agreed by an
//   all_reduce(max) over float32: max is exact and order independent.
//   exact_all_reduce() sends a second float next to it, a status (0 = fine,
//   1 = a non-finite value, 2 = more contributions than declared, 3 = bad
//   sizes), so that every rank learns of a local problem and fails with the
//   same errc instead of waiting in phase 3 for a rank that gave up.
//
// Phase 2 (scale and convert). From the global max abs M and the declared
//   maximum number of contributions N (over all ranks together) a power of
//   two 2^shift is chosen, the largest one with N * M * 2^shift < 2^62
//   (exact_shift()). Each contribution element becomes
//   llrint(double(x) * 2^shift): a float times a power of two is exact in
//   double, so the round-to-nearest-even to an integer is the only rounding,
//   and it depends on x alone. Each fixed value has |v| <= 2^62, and any
//   partial sum of at most N of them stays below 2^62 + N/2 < 2^63, so no
//   order of summation (local loop, ring, tree) can overflow int64 as long
//   as at most N contributions are added. Adds are checked anyway.
//
// Phase 3 (sum). The local int64 accumulators are all_reduce(sum)'d. Integer
//   addition is associative and commutative, so every order and every
//   spread of the contributions over ranks gives the same int64 sum. The
//   accumulator carries one extra trailing int64, the number of
//   contributions added, so the global count is checked against N too.
//
// Finish. out = the int64 sum times 2^-shift, rounded once to the nearest
//   float (ties to even; fixed_to_float()). Same int64 sum and same shift
//   imply the same bits.
//
// Resolution: each contribution is rounded to a multiple of 2^-shift, so the
// result is within N * 2^-shift / 2 of the exact real sum, plus the final
// rounding to float. Values far below M * 2^-62 are lost; that is the price
// of order independence.
//
// Pieces: a micro-batch's gradient may be computed in parts on several
//   ranks (expert parallelism: an expert's weight gradient for a
//   micro-batch's rows is computed where the expert lives). A part is a
//   piece: a range of the buffer and its values, the rest of that
//   contribution being zero here. Pieces are observed and converted like
//   contributions, element by element, but do not count as contributions:
//   the micro-batch is counted once, by the rank holding the rest of it.
//   The caller guarantees that the pieces and the contribution of one
//   micro-batch never cover the same element (else that element would be
//   added twice), so no element receives more than N values and the
//   overflow argument above holds unchanged.
//
// Errors: a non-finite input, more contributions than declared, a checked add
// overflowing, or a sum beyond the float range give errc::overflow; mismatched
// sizes and protocol misuse give errc::invalid_argument.
#pragma once

#include "collectives/communicator.hpp"
#include "core/error.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace cmesh::coll {

/// The largest shift with contributions_max * max_abs * 2^shift < 2^62
/// (contributions_max counts as at least 1), kept within
/// [kExactMinShift, kExactMaxShift]; kExactZeroShift when max_abs is 0.
/// max_abs must be finite and >= 0.
int exact_shift(float max_abs, size_t contributions_max);

constexpr int kExactMinShift = -1000;
constexpr int kExactMaxShift = 1000;
constexpr int kExactZeroShift = 0;

/// v * 2^-shift rounded once to the nearest float, ties to even (an infinity
/// when beyond the float range).
float fixed_to_float(int64_t v, int shift);

/// One rank's side of an exact sum of `count` floats.
class exact_sum {
public:
  exact_sum(size_t count, size_t contributions_max);

  /// Phase 1: folds the contribution's max |x| into local_max_abs(). A
  /// non-finite value makes local_max_abs() infinite; a span of the wrong
  /// size is remembered and returned by every later call that returns an
  /// error.
  void observe(std::span<const float> contribution);
  float local_max_abs() const;

  /// Phase 2: fixes the scale from the agreed global max abs. Fails with
  /// overflow when it is infinite (a non-finite input somewhere), with
  /// invalid_argument when it is NaN, negative, below this rank's own
  /// local_max_abs(), or when contributions were already added.
  caf::error set_global_max_abs(float m);
  /// The scale exponent (valid after set_global_max_abs()).
  int shift() const { return shift_; }

  /// Converts the contribution to fixed point and adds it (checked).
  caf::error add(std::span<const float> contribution);
  /// Phase 1 for a piece: `values` at [offset, offset + size) of the buffer.
  void observe_piece(size_t offset, std::span<const float> values);
  /// Phase 2 for a piece: converted and added like a contribution, without
  /// counting as one (see Pieces above).
  caf::error add_piece(size_t offset, std::span<const float> values);

  /// Contributions added here so far.
  size_t added() const { return added_; }

  /// What gets all_reduce'd as an int64 sum: count + 1 elements, the fixed
  /// point sums and then the number of contributions added.
  std::span<int64_t> accumulator() { return acc_; }
  std::span<const int64_t> accumulator() const { return acc_; }

  /// From fixed point, after the accumulator holds the global sum. Fails
  /// with overflow when more than contributions_max contributions were
  /// summed in all or a sum does not fit in a float.
  caf::error finish(std::span<float> out) const;

  size_t count() const { return count_; }
  size_t contributions_max() const { return contributions_max_; }

private:
  /// Converts `values` and adds them at `offset` (checked, not counted).
  caf::error accumulate(size_t offset, std::span<const float> values);

  size_t count_;
  size_t contributions_max_;
  uint32_t local_max_bits_ = 0; // bits of max |x| so far (> 0x7F800000: NaN seen)
  bool scaled_ = false;
  float global_max_abs_ = 0.0f;
  int shift_ = kExactZeroShift;
  double scale_ = 1.0; // 2^shift
  size_t added_ = 0;
  caf::error sticky_; // a misuse or broken accumulator, returned from then on
  std::vector<int64_t> acc_;
};

/// Part of a micro-batch's gradient: `values` at [offset, offset + size).
struct exact_piece {
  size_t offset = 0;
  std::span<const float> values;
};

/// The whole protocol on a communicator: `contributions` are this rank's
/// micro-batch gradients (possibly none), each out.size() floats;
/// contributions_max bounds their number over all ranks together. Every
/// member must call it with the same out.size() and contributions_max.
caf::error exact_all_reduce(communicator& comm,
                            const std::vector<std::span<const float>>& contributions,
                            std::span<float> out, size_t contributions_max,
                            const op_options& o = {}, std::span<const exact_piece> pieces = {});

/// The same sum for a replica group that shards the buffer (HSDP): blocks
/// of `count` elements split by shard_counts (one per member of `group`,
/// in order), and this rank keeps block group.index() in `out`. The range
/// is agreed over `world` (every rank of every group); the integer sums are
/// reduce-scattered over `group` and each block summed over `cross` (the
/// ranks holding the same block in the other groups). The result is
/// bit-identical to exact_all_reduce's block, whatever the layout.
/// `pieces` (both): this rank's parts of micro-batches whose contribution
/// another rank holds (see Pieces above).
caf::error exact_reduce_scatter(communicator& world, communicator& group, communicator& cross,
                                const std::vector<std::span<const float>>& contributions,
                                size_t count, const std::vector<size_t>& shard_counts,
                                std::span<float> out, size_t contributions_max,
                                const op_options& o = {},
                                std::span<const exact_piece> pieces = {});

/// Elements [first, second) of a buffer.
using exact_range = std::pair<size_t, size_t>;

/// The same sum for a replica group whose ranks hold only part of the
/// buffer (resident experts): the `shared` ranges, packed in order, are
/// split by shard_counts over `group` as in exact_reduce_scatter, and this
/// rank's `own` ranges are complete here (no other member of the group
/// adds to them). out = [this rank's block of the packed shared elements |
/// the own ranges in order], summed over `cross`. Bit-identical to the same
/// elements of exact_all_reduce's result, whatever the layout.
caf::error exact_reduce_scatter_packed(communicator& world, communicator& group,
                                       communicator& cross,
                                       const std::vector<std::span<const float>>& contributions,
                                       size_t count, std::span<const exact_range> shared,
                                       const std::vector<size_t>& shard_counts,
                                       std::span<const exact_range> own, std::span<float> out,
                                       size_t contributions_max, const op_options& o = {},
                                       std::span<const exact_piece> pieces = {});

} // namespace cmesh::coll
