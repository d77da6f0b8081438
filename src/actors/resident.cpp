// Resident experts: see resident.hpp.
#include "actors/resident.hpp"
#include "core/check.hpp"

#include <algorithm>
#include <string>

namespace cmesh::actors {

namespace {

/// Appends [a, b) to `rs`, merged with the last range when adjacent.
void append(std::vector<flat_range>& rs, size_t a, size_t b) {
  if (a == b)
    return;
  if (!rs.empty() && rs.back().end == a)
    rs.back().end = b;
  else
    rs.push_back({a, b});
}

size_t blocks_in(size_t n) { return (n + norm_block - 1) / norm_block; }

} // namespace

expected<resident_layout> resident_layout::make(const std::vector<model::tensor_info>& tensors,
                                                size_t experts, size_t ranks, size_t position) {
  if (experts == 0 || ranks == 0 || experts % ranks != 0 || position >= ranks)
    return make_error(errc::invalid_argument,
                      "resident experts: " + std::to_string(experts) + " experts do not divide over "
                        + std::to_string(ranks) + " ranks (position "
                        + std::to_string(position) + ")");
  resident_layout l;
  l.ranks_ = ranks;
  l.position_ = position;
  l.experts_ = experts;
  l.units_.resize(ranks);
  // Dense ranges and the units (one expert of one layer), in flat order.
  std::vector<std::pair<flat_range, size_t>> units; // unit, host
  for (const auto& t : tensors) {
    if (t.offset != l.total_)
      return make_error(errc::invalid_argument,
                        "resident experts: tensor " + t.name + " does not follow the one before it");
    const size_t a = t.offset, b = t.offset + t.size;
    l.total_ = b;
    if (t.expert < 0) {
      append(l.dense_, a, b);
      l.dense_total_ += t.size;
      continue;
    }
    const auto e = static_cast<size_t>(t.expert);
    if (e >= experts)
      return make_error(errc::invalid_argument, "resident experts: tensor " + t.name
                                                  + " names expert " + std::to_string(e));
    const auto& before = tensors[static_cast<size_t>(&t - tensors.data()) - (a > 0 ? 1 : 0)];
    if (!units.empty() && units.back().first.end == a && before.expert == t.expert
        && before.layer == t.layer)
      units.back().first.end = b; // the same unit goes on
    else
      units.push_back({{a, b}, l.host_of(e)});
  }
  for (size_t at = 0; const auto& r : l.dense_) {
    l.dense_starts_.push_back(at);
    at += r.size();
  }
  l.dense_split_ = split_shards(l.dense_total_, ranks, norm_block);
  // The state: the dense piece (its flat ranges), then the units.
  size_t packed = 0;
  const size_t lo = l.dense_split_.offsets[position], hi = lo + l.dense_split_.counts[position];
  for (const auto& r : l.dense_) {
    const size_t a = std::max(lo, packed), b = std::min(hi, packed + r.size());
    if (a < b)
      append(l.state_ranges_, r.begin + (a - packed), r.begin + (b - packed));
    packed += r.size();
  }
  for (size_t b = 0; b < blocks_in(l.dense_split_.counts[position]); ++b) {
    l.block_ids_.push_back(lo / norm_block + b);
    l.block_lengths_.push_back(std::min(norm_block, l.dense_split_.counts[position] - b * norm_block));
  }
  size_t next_block = blocks_in(l.dense_total_);
  for (const auto& [u, host] : units) {
    l.units_[host].push_back(u);
    const size_t n = blocks_in(u.size());
    if (host == position) {
      l.state_ranges_.push_back(u); // never merged: each unit starts its own blocks
      for (size_t b = 0; b < n; ++b) {
        l.block_ids_.push_back(next_block + b);
        l.block_lengths_.push_back(std::min(norm_block, u.size() - b * norm_block));
      }
    }
    next_block += n;
  }
  l.blocks_ = next_block;
  for (size_t at = l.dense_piece(); const auto& u : l.units()) {
    l.unit_starts_.push_back(at);
    at += u.size();
  }
  for (const auto& r : l.state_ranges_) {
    l.state_starts_.push_back(l.state_size_);
    l.state_size_ += r.size();
  }
  return l;
}

size_t resident_layout::flat_of(size_t i) const {
  auto it = std::upper_bound(state_starts_.begin(), state_starts_.end(), i);
  CMESH_CHECK(it != state_starts_.begin() && i < state_size_);
  const size_t k = static_cast<size_t>(it - state_starts_.begin()) - 1;
  return state_ranges_[k].begin + (i - state_starts_[k]);
}

namespace {

/// The index, in a space where `ranges` lie back to back from `starts`, of
/// flat element `flat` (which one of the ranges holds).
size_t index_in(const std::vector<flat_range>& ranges, const std::vector<size_t>& starts,
                size_t flat) {
  auto it = std::upper_bound(ranges.begin(), ranges.end(), flat,
                             [](size_t f, const flat_range& r) { return f < r.begin; });
  CMESH_CHECK(it != ranges.begin());
  const size_t k = static_cast<size_t>(it - ranges.begin()) - 1;
  CMESH_CHECK(flat < ranges[k].end);
  return starts[k] + (flat - ranges[k].begin);
}

} // namespace

size_t resident_layout::packed_of(size_t flat) const {
  return index_in(dense_, dense_starts_, flat);
}

size_t resident_layout::state_of(size_t flat) const {
  return index_in(units(), unit_starts_, flat);
}

std::vector<flat_range> resident_layout::touched() const {
  std::vector<flat_range> all = dense_;
  all.insert(all.end(), units().begin(), units().end());
  std::sort(all.begin(), all.end(),
            [](const flat_range& a, const flat_range& b) { return a.begin < b.begin; });
  std::vector<flat_range> out;
  for (const auto& r : all)
    append(out, r.begin, r.end);
  return out;
}

namespace {

/// `ranges` of `flat` into `packed` back to back from index `at`.
void pack_ranges(const std::vector<flat_range>& ranges, std::span<const float> flat,
                 std::span<float> packed, size_t at) {
  for (const auto& r : ranges) {
    CMESH_CHECK(r.end <= flat.size() && at + r.size() <= packed.size());
    std::copy(flat.begin() + r.begin, flat.begin() + r.end, packed.begin() + at);
    at += r.size();
  }
}

/// The inverse: `packed` from index `at` back into `ranges` of `flat`.
void unpack_ranges(const std::vector<flat_range>& ranges, std::span<const float> packed,
                   std::span<float> flat, size_t at) {
  for (const auto& r : ranges) {
    CMESH_CHECK(r.end <= flat.size() && at + r.size() <= packed.size());
    std::copy(packed.begin() + at, packed.begin() + at + r.size(), flat.begin() + r.begin);
    at += r.size();
  }
}

} // namespace

void resident_layout::gather_state(std::span<const float> flat, std::span<float> state) const {
  CMESH_CHECK(flat.size() == total_ && state.size() == state_size_);
  pack_ranges(state_ranges_, flat, state, 0);
}

void resident_layout::scatter_state(std::span<const float> state, std::span<float> flat) const {
  CMESH_CHECK(flat.size() == total_ && state.size() == state_size_);
  unpack_ranges(state_ranges_, state, flat, 0);
}

void resident_layout::gather_units(std::span<const float> flat, std::span<float> state) const {
  CMESH_CHECK(flat.size() == total_ && state.size() == state_size_);
  pack_ranges(units(), flat, state, dense_piece());
}

void resident_layout::scatter_units(std::span<const float> state, std::span<float> flat) const {
  CMESH_CHECK(flat.size() == total_ && state.size() == state_size_);
  unpack_ranges(units(), state, flat, dense_piece());
}

void resident_layout::pack_dense(std::span<const float> flat, std::span<float> packed) const {
  CMESH_CHECK(flat.size() == total_ && packed.size() == dense_total_);
  pack_ranges(dense_, flat, packed, 0);
}

void resident_layout::unpack_dense(std::span<const float> packed, std::span<float> flat) const {
  CMESH_CHECK(flat.size() == total_ && packed.size() == dense_total_);
  unpack_ranges(dense_, packed, flat, 0);
}

} // namespace cmesh::actors
