#include "actors/catchup.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

namespace cmesh::actors {

snapshot_layout::snapshot_layout(const std::array<size_t, 4>& sizes) : n(sizes) {
  constexpr size_t align = 16; // floats
  for (size_t i = 0; i < n.size(); ++i) {
    at[i] = total;
    total += (n[i] + align - 1) / align * align;
  }
}

size_t snapshot_layout::pieces(size_t piece_floats) const {
  return piece_floats == 0 ? 0 : (total + piece_floats - 1) / piece_floats;
}

caf::error place_piece(const snapshot_layout& l, uint64_t offset, std::span<const uint8_t> bytes,
                       const std::array<std::span<float>, 4>& arrays) {
  const size_t count = bytes.size() / sizeof(float);
  if (bytes.size() % sizeof(float) != 0 || offset > l.total || count > l.total - offset)
    return make_error(errc::invalid_argument,
                      fmt::format("a catch-up piece of {} bytes at float {} does not fit a "
                                  "snapshot of {} floats",
                                  bytes.size(), offset, l.total));
  for (size_t i = 0; i < arrays.size(); ++i)
    if (arrays[i].size() != l.n[i])
      return make_error(errc::invalid_argument, "the arrays do not match the snapshot's layout");
  const auto* from = bytes.data();
  for (size_t i = 0; i < arrays.size(); ++i) {
    const size_t lo = std::max<size_t>(offset, l.at[i]);
    const size_t hi = std::min<size_t>(offset + count, l.at[i] + l.n[i]);
    if (lo < hi)
      std::memcpy(arrays[i].data() + (lo - l.at[i]), from + (lo - offset) * sizeof(float),
                  (hi - lo) * sizeof(float));
  }
  return {};
}

} // namespace cmesh::actors
