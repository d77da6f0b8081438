// Exact mode: see exact.hpp for the protocol and its argument.
#include "collectives/exact.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

namespace cmesh::coll {

namespace {

constexpr uint32_t kInfBits = 0x7F800000u;

inline uint32_t abs_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u & 0x7FFFFFFFu;
}

inline float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// The largest |x| of a span as the bits of |x|: for non-negative floats the
// integer order of the bits is the numeric order, infinity is 0x7F800000 and
// every NaN is above it. An integer max, so it vectorises and sees NaNs.
uint32_t max_abs_bits(std::span<const float> xs) {
  constexpr size_t block = 16;
  const float* p = xs.data();
  size_t n = xs.size(), i = 0;
  uint32_t lane[block] = {};
  for (; i + block <= n; i += block)
    for (size_t j = 0; j < block; ++j) {
      uint32_t b = abs_bits(p[i + j]);
      lane[j] = b > lane[j] ? b : lane[j];
    }
  uint32_t m = 0;
  for (size_t j = 0; j < block; ++j)
    m = std::max(m, lane[j]);
  for (; i < n; ++i)
    m = std::max(m, abs_bits(p[i]));
  return m;
}

// Round to the nearest integer, ties to even, like std::llrint in the
// default rounding mode but inline (llrint is a library call per element).
// Below 2^52 adding and then removing 2^52 (with t's sign) rounds t at the
// units; from 2^52 up a double is already an integer. |t| < 2^63 here.
inline int64_t round_even(double t) {
  constexpr double two52 = 4503599627370496.0;
  if (std::fabs(t) < two52) {
    double big = std::copysign(two52, t);
    t = (t + big) - big;
  }
  return static_cast<int64_t>(t);
}

std::string too_many(size_t declared, uint64_t got) {
  return "exact mode: declared " + std::to_string(declared) + " contributions, got "
         + std::to_string(got);
}

std::string size_mismatch(const char* what, size_t got, size_t want) {
  return std::string("exact mode: ") + what + " has " + std::to_string(got)
         + " elements, expected " + std::to_string(want);
}

} // namespace

int exact_shift(float max_abs, size_t contributions_max) {
  if (!(max_abs > 0.0f) || !std::isfinite(max_abs))
    return kExactZeroShift;
  // N * M with N < 2^64 and M a 24-bit float needs up to 88 bits; in long
  // double (64 bits on x86, 113 on aarch64) it is exact for N < 2^40 and
  // otherwise off by an ulp, which the 2^62-vs-2^63 headroom absorbs.
  long double p = static_cast<long double>(std::max<size_t>(contributions_max, 1))
                  * static_cast<long double>(max_abs);
  int e = 0;
  std::frexp(p, &e); // p = f * 2^e, f in [0.5, 1): 2^(e-1) <= p < 2^e
  // p * 2^(62-e) < 2^62, and p * 2^(63-e) >= 2^62: 62 - e is the largest.
  return std::clamp(62 - e, kExactMinShift, kExactMaxShift);
}

float fixed_to_float(int64_t v, int shift) {
  if (v == 0)
    return 0.0f;
  bool negative = v < 0;
  uint64_t a = negative ? uint64_t{0} - static_cast<uint64_t>(v) : static_cast<uint64_t>(v);
  long bits = 64 - __builtin_clzll(a);              // a in [2^(bits-1), 2^bits)
  long exponent = bits - 1 - static_cast<long>(shift); // floor(log2(a * 2^-shift))
  long ulp = std::max(exponent, -126L) - 23;         // float ulp there is 2^ulp
  long dropped = ulp + shift;                         // low bits of a below the ulp
  uint64_t r;
  long scale;
  if (dropped <= 0) { // then a < 2^24: exact
    r = a;
    scale = -static_cast<long>(shift);
  } else if (dropped >= 64) { // a * 2^-shift is at most half an ulp: a tie with even 0
    return negative ? -0.0f : 0.0f;
  } else {
    r = a >> dropped;
    uint64_t rest = a & ((uint64_t{1} << dropped) - 1);
    uint64_t half = uint64_t{1} << (dropped - 1);
    if (rest > half || (rest == half && (r & 1u)))
      ++r; // may reach 2^24: still a float
    scale = ulp;
  }
  // r <= 2^24 and r * 2^scale lies on the float grid, so both conversions
  // below are exact, except that a value beyond FLT_MAX becomes infinity.
  float f = static_cast<float>(std::ldexp(static_cast<double>(r), static_cast<int>(scale)));
  return negative ? -f : f;
}

exact_sum::exact_sum(size_t count, size_t contributions_max)
  : count_(count), contributions_max_(contributions_max), acc_(count + 1, 0) {
}

void exact_sum::observe(std::span<const float> contribution) {
  if (contribution.size() != count_) {
    if (!sticky_)
      sticky_ = make_error(errc::invalid_argument,
                           size_mismatch("observed contribution", contribution.size(), count_));
    return;
  }
  local_max_bits_ = std::max(local_max_bits_, max_abs_bits(contribution));
}

float exact_sum::local_max_abs() const {
  if (local_max_bits_ >= kInfBits) // infinity or NaN seen
    return std::numeric_limits<float>::infinity();
  return from_bits(local_max_bits_);
}

caf::error exact_sum::set_global_max_abs(float m) {
  if (sticky_)
    return sticky_;
  if (added_ > 0)
    return make_error(errc::invalid_argument,
                      "exact mode: the scale is fixed once contributions were added");
  if (std::isnan(m) || m < 0.0f)
    return make_error(errc::invalid_argument,
                      "exact mode: global max abs " + std::to_string(m) + " is not >= 0");
  if (std::isinf(m))
    return make_error(errc::overflow,
                      "exact mode: a contribution holds a non-finite value (inf or NaN)");
  if (m < local_max_abs())
    return make_error(errc::invalid_argument,
                      "exact mode: global max abs " + std::to_string(m)
                        + " is below this rank's own max abs "
                        + std::to_string(local_max_abs()));
  global_max_abs_ = m;
  shift_ = exact_shift(m, contributions_max_);
  scale_ = std::ldexp(1.0, shift_);
  scaled_ = true;
  return {};
}

caf::error exact_sum::add(std::span<const float> contribution) {
  if (sticky_)
    return sticky_;
  if (contribution.size() != count_)
    return make_error(errc::invalid_argument,
                      size_mismatch("contribution", contribution.size(), count_));
  if (added_ >= contributions_max_)
    return make_error(errc::overflow, too_many(contributions_max_, uint64_t{added_} + 1));
  if (auto err = accumulate(0, contribution))
    return err;
  acc_[count_] += 1;
  ++added_;
  return {};
}

namespace {

/// Whether `n` values at `offset` fit a buffer of `count`, and the error when not.
caf::error piece_fits(size_t offset, size_t n, size_t count) {
  if (offset <= count && n <= count - offset)
    return {};
  return make_error(errc::invalid_argument, "exact mode: a piece of " + std::to_string(n)
                                              + " values at " + std::to_string(offset)
                                              + " runs past the buffer of "
                                              + std::to_string(count));
}

} // namespace

void exact_sum::observe_piece(size_t offset, std::span<const float> values) {
  if (auto err = piece_fits(offset, values.size(), count_)) {
    if (!sticky_)
      sticky_ = std::move(err);
    return;
  }
  local_max_bits_ = std::max(local_max_bits_, max_abs_bits(values));
}

caf::error exact_sum::add_piece(size_t offset, std::span<const float> values) {
  if (sticky_)
    return sticky_;
  if (auto err = piece_fits(offset, values.size(), count_))
    return err;
  return accumulate(offset, values);
}

caf::error exact_sum::accumulate(size_t offset, std::span<const float> values) {
  if (!scaled_)
    return make_error(errc::invalid_argument, "exact mode: add() before set_global_max_abs()");
  // Check every value against the agreed range before touching the
  // accumulator: that range is what makes the int64 sums safe.
  uint32_t m = max_abs_bits(values);
  if (m >= kInfBits)
    return make_error(errc::overflow,
                      "exact mode: a contribution holds a non-finite value (inf or NaN)");
  if (from_bits(m) > global_max_abs_)
    return make_error(errc::invalid_argument,
                      "exact mode: a contribution value " + std::to_string(from_bits(m))
                        + " exceeds the agreed global max abs "
                        + std::to_string(global_max_abs_) + " (observe() it first)");
  const float* x = values.data();
  int64_t* acc = acc_.data() + offset;
  const double scale = scale_;
  bool overflow = false;
  for (size_t i = 0; i < values.size(); ++i) {
    // Exact product (a float times a power of two), then the one rounding.
    long long v = round_even(static_cast<double>(x[i]) * scale);
    long long r;
    overflow |= __builtin_add_overflow(static_cast<long long>(acc[i]), v, &r);
    acc[i] = static_cast<int64_t>(r);
  }
  if (overflow) {
    sticky_ = make_error(errc::overflow, "exact mode: the int64 accumulator overflowed");
    return sticky_;
  }
  return {};
}

namespace {

/// fixed[i] * 2^-shift into out[i]; overflow when one does not fit a float.
caf::error fixed_to_floats(std::span<const int64_t> fixed, int shift, std::span<float> out) {
  bool too_big = false;
  for (size_t i = 0; i < out.size(); ++i) {
    float f = fixed_to_float(fixed[i], shift);
    too_big |= std::isinf(f);
    out[i] = f;
  }
  if (too_big)
    return make_error(errc::overflow, "exact mode: a sum does not fit in float32");
  return {};
}

} // namespace

caf::error exact_sum::finish(std::span<float> out) const {
  if (sticky_)
    return sticky_;
  if (!scaled_)
    return make_error(errc::invalid_argument, "exact mode: finish() before set_global_max_abs()");
  if (out.size() != count_)
    return make_error(errc::invalid_argument, size_mismatch("output", out.size(), count_));
  int64_t total = acc_[count_];
  if (total < 0 || static_cast<uint64_t>(total) > contributions_max_)
    return make_error(errc::overflow, too_many(contributions_max_, static_cast<uint64_t>(total)));
  return fixed_to_floats(std::span<const int64_t>(acc_).first(count_), shift_, out);
}

namespace {

/// Phases 1 and 2 over `comm`: agrees on the range (and on every rank's
/// local status), scales, converts and sums this rank's contributions.
caf::error exact_prepare(communicator& comm,
                         const std::vector<std::span<const float>>& contributions,
                         std::span<const exact_piece> pieces, exact_sum& sum,
                         const op_options& o) {
  enum status : int { fine = 0, non_finite = 1, too_many_here = 2, bad_sizes = 3 };
  const size_t count = sum.count();
  const size_t contributions_max = sum.contributions_max();
  // Phase 1: local checks and max; every rank takes part in the max
  // all_reduce even when its input is bad, so nobody waits for it later.
  caf::error local;
  int st = fine;
  for (size_t k = 0; k < contributions.size() && st == fine; ++k)
    if (contributions[k].size() != count) {
      st = bad_sizes;
      local = make_error(errc::invalid_argument,
                         size_mismatch(("contribution " + std::to_string(k)).c_str(),
                                       contributions[k].size(), count));
    }
  for (size_t k = 0; k < pieces.size() && st == fine; ++k)
    if (piece_fits(pieces[k].offset, pieces[k].values.size(), count)) {
      st = bad_sizes;
      local = make_error(errc::invalid_argument,
                         "exact mode: piece " + std::to_string(k) + " ("
                           + std::to_string(pieces[k].values.size()) + " values at "
                           + std::to_string(pieces[k].offset) + ") runs past the buffer of "
                           + std::to_string(count));
    }
  if (st == fine && contributions.size() > contributions_max) {
    st = too_many_here;
    local = make_error(errc::overflow, too_many(contributions_max, contributions.size()));
  }
  if (st == fine) {
    for (auto c : contributions)
      sum.observe(c);
    for (auto& p : pieces)
      sum.observe_piece(p.offset, p.values);
    if (std::isinf(sum.local_max_abs())) {
      st = non_finite;
      local = make_error(errc::overflow,
                         "exact mode: a local contribution holds a non-finite value (inf or NaN)");
    }
  }
  float agreed[2] = {st == fine ? sum.local_max_abs() : 0.0f, static_cast<float>(st)};
  if (auto err = comm.all_reduce(std::span<float>(agreed), reduce_op::max, o))
    return err;
  int global_st = static_cast<int>(agreed[1]);
  if (global_st != fine) {
    if (global_st == st) // this rank saw it: its own, precise message
      return local;
    switch (global_st) {
      case non_finite:
        return make_error(errc::overflow,
                          "exact mode: another rank's contribution holds a non-finite value");
      case too_many_here:
        return make_error(errc::overflow,
                          "exact mode: another rank has more contributions than the declared "
                            + std::to_string(contributions_max));
      default:
        return make_error(errc::invalid_argument,
                          "exact mode: another rank's contributions have the wrong size");
    }
  }

  // Phase 2: scale, convert, sum locally.
  if (auto err = sum.set_global_max_abs(agreed[0]))
    return err;
  for (auto c : contributions)
    if (auto err = sum.add(c))
      return err;
  for (auto& p : pieces)
    if (auto err = sum.add_piece(p.offset, p.values))
      return err;
  return {};
}

} // namespace

caf::error exact_all_reduce(communicator& comm,
                            const std::vector<std::span<const float>>& contributions,
                            std::span<float> out, size_t contributions_max,
                            const op_options& o, std::span<const exact_piece> pieces) {
  exact_sum sum(out.size(), contributions_max);
  if (auto err = exact_prepare(comm, contributions, pieces, sum, o))
    return err;
  // Phase 3: integer sum over the ranks (the count rides along), then back.
  if (auto err = comm.all_reduce(sum.accumulator(), reduce_op::sum, o))
    return err;
  return sum.finish(out);
}

caf::error exact_reduce_scatter(communicator& world, communicator& group, communicator& cross,
                                const std::vector<std::span<const float>>& contributions,
                                size_t count, const std::vector<size_t>& shard_counts,
                                std::span<float> out, size_t contributions_max,
                                const op_options& o, std::span<const exact_piece> pieces) {
  // The whole buffer shared, nothing of it this rank's own.
  const exact_range whole{0, count};
  return exact_reduce_scatter_packed(world, group, cross, contributions, count, {&whole, 1},
                                     shard_counts, {}, out, contributions_max, o, pieces);
}

caf::error exact_reduce_scatter_packed(communicator& world, communicator& group,
                                       communicator& cross,
                                       const std::vector<std::span<const float>>& contributions,
                                       size_t count, std::span<const exact_range> shared,
                                       const std::vector<size_t>& shard_counts,
                                       std::span<const exact_range> own, std::span<float> out,
                                       size_t contributions_max, const op_options& o,
                                       std::span<const exact_piece> pieces) {
  const size_t me = group.index(), last = shard_counts.size() - 1;
  auto total = [](std::span<const exact_range> rs) {
    size_t n = 0;
    for (auto [a, b] : rs)
      n += b - a;
    return n;
  };
  size_t split = 0;
  for (auto c : shard_counts)
    split += c;
  const size_t packed = total(shared), owned = total(own);
  if (shard_counts.size() != group.size() || split != packed
      || out.size() != shard_counts[me] + owned)
    return make_error(errc::invalid_argument,
                      "exact mode: shard counts do not split the buffer over the group");
  for (auto rs : {shared, own})
    for (auto [a, b] : rs)
      if (a > b || b > count)
        return make_error(errc::invalid_argument, "exact mode: a range runs past the buffer");
  exact_sum sum(count, contributions_max);
  if (auto err = exact_prepare(world, contributions, pieces, sum, o))
    return err;
  // Phase 3: the shared integers packed (the count of contributions at
  // their end), reduce-scattered over the group; this rank's own ones
  // appended; the block summed over the groups.
  // The whole buffer shared: the accumulator is packed already.
  const auto acc = sum.accumulator();
  std::vector<int64_t> shared_acc;
  const int64_t* send = acc.data();
  if (!(shared.size() == 1 && shared[0] == exact_range{0, count})) {
    shared_acc.reserve(packed + 1);
    for (auto [a, b] : shared)
      shared_acc.insert(shared_acc.end(), acc.begin() + a, acc.begin() + b);
    shared_acc.push_back(acc[count]);
    send = shared_acc.data();
  }
  auto counts = shard_counts;
  counts[last] += 1;
  std::vector<int64_t> block(counts[me]);
  if (auto err = group.reduce_scatter(send, block.data(), counts, dtype::int64, reduce_op::sum,
                                      o))
    return err;
  const bool tail = me == last;
  const int64_t n_here = tail ? block.back() : 0;
  if (tail)
    block.pop_back();
  for (auto [a, b] : own)
    block.insert(block.end(), acc.begin() + a, acc.begin() + b);
  if (tail)
    block.push_back(n_here); // the count rides at the end, as in exact_reduce_scatter
  if (auto err = cross.all_reduce(std::span<int64_t>(block), reduce_op::sum, o))
    return err;
  if (tail) {
    int64_t n = block.back();
    if (n < 0 || static_cast<uint64_t>(n) > contributions_max)
      return make_error(errc::overflow, too_many(contributions_max, static_cast<uint64_t>(n)));
  }
  return fixed_to_floats(std::span<const int64_t>(block).first(out.size()), sum.shift(), out);
}

} // namespace cmesh::coll
