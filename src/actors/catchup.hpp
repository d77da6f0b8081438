// The catch-up snapshot's shape on the wire: where a rank's params, AdamW
// moments and scalars lie in the one range of floats a source sends in
// pieces (wire::catchup_piece), and how a joiner puts a piece back into its
// arrays. The conversation itself is the supervisor's (actors/supervisor).
#pragma once

#include "core/error.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace cmesh::actors {

/// params, adam_m, adam_v and scalars (train_state's order) one after the
/// other, each starting on a multiple of 16 floats (a cache line).
struct snapshot_layout {
  std::array<size_t, 4> at{}, n{};
  size_t total = 0; // floats, with the padding

  explicit snapshot_layout(const std::array<size_t, 4>& sizes);

  /// The pieces of `piece_floats` floats each (the last one shorter) that
  /// the range is sent in.
  size_t pieces(size_t piece_floats) const;
};

/// Copies a piece (the floats [offset, offset + bytes / 4) of the layout's
/// range) into `arrays` (sized as the layout's n); the padding between them
/// is skipped. invalid_argument, and nothing copied, when the piece is not
/// whole floats or does not lie within the range.
caf::error place_piece(const snapshot_layout& l, uint64_t offset, std::span<const uint8_t> bytes,
                       const std::array<std::span<float>, 4>& arrays);

} // namespace cmesh::actors
