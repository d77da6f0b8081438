#include "collectives/exact.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace cmesh;
using namespace cmesh::coll;

namespace {

// -- A fake in-process communicator -------------------------------------------
//
// local_group holds N members, each a communicator, meant to run on its own
// thread. all_reduce on a member publishes its buffer and waits until all N
// members did; then each member reduces all buffers in member order into a
// private copy, waits again (so no buffer changes while someone reads it),
// and writes the result back. Only all_reduce and barrier work.
class local_group {
public:
  class member;

  explicit local_group(size_t n) : sync_(static_cast<std::ptrdiff_t>(n)), slots_(n) {
    membership m;
    m.epoch = 1;
    for (size_t i = 0; i < n; ++i)
      m.ranks.push_back(static_cast<uint32_t>(100 + i));
    for (size_t i = 0; i < n; ++i)
      members_.push_back(std::make_unique<member>(*this, m, i));
  }

  size_t size() const { return members_.size(); }
  member& operator[](size_t i) { return *members_[i]; }

  class member : public communicator {
  public:
    member(local_group& g, membership m, size_t index)
      : group_(g), members_(std::move(m)), index_(index) {
    }

    using communicator::all_reduce; // keep the typed helper visible

    const membership& members() const override { return members_; }
    size_t index() const override { return index_; }

    caf::error all_reduce(void* buf, size_t count, dtype t, reduce_op op,
                          const op_options& = {}) override {
      auto& slots = group_.slots_;
      slots[index_] = slot{buf, count, t, op};
      group_.sync_.arrive_and_wait(); // every buffer is published
      caf::error err;
      std::vector<std::byte> result(count * size_of(t));
      for (auto& s : slots)
        if (s.count != count || s.t != t || s.op != op)
          err = make_error(errc::invalid_argument, "members disagree on the all_reduce");
      if (!err && count > 0) {
        std::memcpy(result.data(), slots[0].buf, result.size());
        for (size_t k = 1; k < slots.size(); ++k)
          if (!reduce_into(result.data(), slots[k].buf, count, t, op)) {
            err = make_error(errc::overflow, "int64 sum overflowed");
            break;
          }
        if (op == reduce_op::avg)
          scale_down(result.data(), count, t, slots.size());
      }
      group_.sync_.arrive_and_wait(); // everyone has read every buffer
      if (err)
        return err;
      if (count > 0)
        std::memcpy(buf, result.data(), result.size());
      calls_++;
      return {};
    }

    caf::error reduce_scatter(const void*, void*, const std::vector<size_t>&, dtype, reduce_op,
                              const op_options& = {}) override {
      return unsupported();
    }
    caf::error all_gather(const void*, void*, const std::vector<size_t>&, dtype,
                          const op_options& = {}) override {
      return unsupported();
    }
    caf::error broadcast(void*, size_t, dtype, size_t, const op_options& = {}) override {
      return unsupported();
    }
    caf::error all_to_allv(const void*, const std::vector<size_t>&, void*,
                           const std::vector<size_t>&, dtype, const op_options& = {}) override {
      return unsupported();
    }
    caf::error barrier(const op_options& = {}) override {
      group_.sync_.arrive_and_wait();
      return {};
    }
    void abort(caf::error) override {}
    caf::error poisoned() const override { return {}; }

    size_t calls() const { return calls_; }

  private:
    static caf::error unsupported() {
      return make_error(errc::invalid_argument, "not supported by the test communicator");
    }

    local_group& group_;
    membership members_;
    size_t index_;
    size_t calls_ = 0;
  };

private:
  struct slot {
    const void* buf = nullptr;
    size_t count = 0;
    dtype t = dtype::float32;
    reduce_op op = reduce_op::sum;
  };

  std::barrier<> sync_;
  std::vector<slot> slots_;
  std::vector<std::unique_ptr<member>> members_;
};

using contribution_set = std::vector<std::vector<float>>;

struct rank_result {
  caf::error err;
  std::vector<float> out;
};

// Runs exact_all_reduce on `per_rank.size()` ranks, rank r contributing
// per_rank[r] (indices into `data`).
std::vector<rank_result> run_exact(const contribution_set& data,
                                   const std::vector<std::vector<size_t>>& per_rank,
                                   size_t count, size_t contributions_max) {
  local_group group(per_rank.size());
  std::vector<rank_result> results(per_rank.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < per_rank.size(); ++r)
    threads.emplace_back([&, r] {
      std::vector<std::span<const float>> mine;
      for (size_t k : per_rank[r])
        mine.emplace_back(data[k]);
      results[r].out.assign(count, -1.0f);
      results[r].err = exact_all_reduce(group[r], mine, results[r].out, contributions_max);
    });
  for (auto& t : threads)
    t.join();
  return results;
}

// Splits contributions order[0..] over `ranks` ranks, as evenly as possible.
std::vector<std::vector<size_t>> spread(const std::vector<size_t>& order, size_t ranks) {
  std::vector<std::vector<size_t>> out(ranks);
  size_t per = order.size() / ranks, extra = order.size() % ranks, k = 0;
  for (size_t r = 0; r < ranks; ++r)
    for (size_t i = 0; i < per + (r < extra ? 1 : 0); ++i)
      out[r].push_back(order[k++]);
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Contributions of very different magnitudes, signs, and a few fixed values.
contribution_set make_data(uint64_t seed, size_t contributions, size_t count) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> mant(1.0f, 10.0f);
  std::uniform_int_distribution<int> decade(-8, 3);
  std::bernoulli_distribution negative(0.5);
  contribution_set data(contributions, std::vector<float>(count));
  for (auto& c : data)
    for (auto& x : c) {
      x = mant(rng) * std::pow(10.0f, static_cast<float>(decade(rng)));
      if (negative(rng))
        x = -x;
    }
  const float fixed[] = {1e-8f, -1e-8f, 1e3f, -1e3f, 0.1f, -0.3f, 7.0f, 1.0f};
  for (size_t k = 0; k < contributions; ++k) {
    data[k][0] = fixed[k % 8];
    data[k][1] = (k % 2 ? -1 : 1) * 1e3f; // a column that cancels
    data[k][2] = 1e-8f;                     // a column of tiny values
  }
  return data;
}

long double reference_sum(const contribution_set& data, size_t i) {
  long double s = 0;
  for (auto& c : data)
    s += c[i];
  return s;
}

} // namespace

TEST_CASE("the fake communicator reduces float32 max and int64 sum") {
  local_group g(3);
  std::vector<std::thread> threads;
  std::vector<caf::error> errs(3);
  std::vector<std::vector<float>> f(3);
  std::vector<std::vector<int64_t>> q(3);
  for (size_t r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      f[r] = {static_cast<float>(r), -static_cast<float>(r)};
      q[r] = {static_cast<int64_t>(r + 1), -10};
      errs[r] = g[r].all_reduce(std::span<float>(f[r]), reduce_op::max);
      if (!errs[r])
        errs[r] = g[r].all_reduce(std::span<int64_t>(q[r]), reduce_op::sum);
      if (!errs[r])
        errs[r] = g[r].barrier();
    });
  for (auto& t : threads)
    t.join();
  for (size_t r = 0; r < 3; ++r) {
    CHECK(!errs[r]);
    CHECK(f[r] == std::vector<float>{2.0f, 0.0f});
    CHECK(q[r] == std::vector<int64_t>{6, -30});
    CHECK(g[r].index() == r);
    CHECK(g[r].members().index_of(static_cast<uint32_t>(100 + r)) == r);
  }
  CHECK(g[0].members().index_of(7) == 3);
  CHECK(code_of(g[0].broadcast(nullptr, 0, dtype::float32, 0)) == errc::invalid_argument);
}

TEST_CASE("exact_shift: the largest power of two with N * M * 2^shift < 2^62") {
  CHECK(exact_shift(1.0f, 1) == 61);
  CHECK(exact_shift(1.0f, 0) == 61); // counts as 1
  CHECK(exact_shift(1.0f, 2) == 60);
  CHECK(exact_shift(1.0f, 3) == 60);
  CHECK(exact_shift(0.75f, 4) == 60);
  CHECK(exact_shift(0.0f, 8) == kExactZeroShift);
  CHECK(exact_shift(std::numeric_limits<float>::max(), 1) == 62 - 128);
  CHECK(exact_shift(std::numeric_limits<float>::denorm_min(), 1) == 62 + 148);
  std::mt19937_64 rng(5);
  for (int i = 0; i < 10000; ++i) {
    float m = std::ldexp(std::uniform_real_distribution<float>(0.5f, 1.0f)(rng),
                         std::uniform_int_distribution<int>(-140, 120)(rng));
    size_t n = std::uniform_int_distribution<size_t>(1, 1u << 20)(rng);
    int s = exact_shift(m, n);
    long double p = static_cast<long double>(n) * m; // exact: 24 + 20 bits
    CHECK(std::ldexp(p, s) < std::ldexp(1.0L, 62));
    CHECK(std::ldexp(p, s + 1) >= std::ldexp(1.0L, 62));
  }
}

TEST_CASE("fixed_to_float rounds once, to nearest even") {
  CHECK(fixed_to_float(0, 10) == 0.0f);
  CHECK(fixed_to_float(1, 0) == 1.0f);
  CHECK(fixed_to_float(-3, 1) == -1.5f);
  CHECK(fixed_to_float((int64_t{1} << 24) + 1, 0) == 16777216.0f); // tie to even, down
  CHECK(fixed_to_float((int64_t{1} << 24) + 3, 0) == 16777220.0f); // tie to even, up
  CHECK(fixed_to_float(std::numeric_limits<int64_t>::min(), 63) == -1.0f);
  CHECK(fixed_to_float(1, 149) == std::numeric_limits<float>::denorm_min());
  CHECK(fixed_to_float(1, 150) == 0.0f); // exactly half the smallest subnormal: even
  CHECK(fixed_to_float(3, 151) == std::numeric_limits<float>::denorm_min());
  CHECK(std::isinf(fixed_to_float(1, -128)));
  CHECK(fixed_to_float(1, -127) == std::ldexp(1.0f, 127));
  if constexpr (std::numeric_limits<long double>::digits >= 64) {
    // Compare with one rounding of the exact value (exact in long double).
    std::mt19937_64 rng(6);
    size_t bad = 0;
    for (int i = 0; i < 200000; ++i) {
      int64_t v = static_cast<int64_t>(rng()) >> (rng() % 63);
      int shift = std::uniform_int_distribution<int>(-80, 220)(rng);
      float want = static_cast<float>(std::ldexp(static_cast<long double>(v), -shift));
      float got = fixed_to_float(v, shift);
      if (std::memcmp(&want, &got, sizeof want) != 0 && bad++ < 5)
        MESSAGE("v=" << v << " shift=" << shift << " got " << got << " want " << want);
    }
    CHECK(bad == 0);
  }
}

TEST_CASE("exact_sum converts with one round to nearest even") {
  const size_t n = 1000;
  std::mt19937_64 rng(7);
  std::vector<float> x(n);
  for (auto& v : x)
    v = std::ldexp(std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng),
                   std::uniform_int_distribution<int>(-60, 9)(rng)); // |v| < 512
  x[0] = 1000.0f;
  exact_sum s(n, 3);
  s.observe(x);
  CHECK(s.local_max_abs() == 1000.0f);
  REQUIRE(!s.set_global_max_abs(1000.0f));
  CHECK(s.shift() == exact_shift(1000.0f, 3));
  REQUIRE(!s.add(x));
  CHECK(s.added() == 1);
  auto acc = s.accumulator();
  REQUIRE(acc.size() == n + 1);
  CHECK(acc[n] == 1); // the contribution count rides along
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i)
    bad += acc[i] != std::llrint(std::ldexp(static_cast<double>(x[i]), s.shift()));
  CHECK(bad == 0);
  // Ties: with shift 0, 0.5 -> 0, 1.5 -> 2, -2.5 -> -2.
  exact_sum t(3, 1);
  std::vector<float> ties{0.5f, 1.5f, -2.5f};
  t.observe(ties);
  REQUIRE(!t.set_global_max_abs(std::ldexp(1.0f, 61))); // shift 0
  CHECK(t.shift() == 0);
  REQUIRE(!t.add(ties));
  CHECK(t.accumulator()[0] == 0);
  CHECK(t.accumulator()[1] == 2);
  CHECK(t.accumulator()[2] == -2);
}

TEST_CASE("exact mode: bit-identical whatever the spread and order") {
  // A fresh seed each run; CMESH_TEST_SEED=<n> replays one.
  uint64_t seed = std::random_device{}();
  if (const char* env = std::getenv("CMESH_TEST_SEED"))
    seed = std::strtoull(env, nullptr, 10);
  MESSAGE("seed " << seed << " (replay with CMESH_TEST_SEED=" << seed << ")");
  const size_t count = 4099, contributions = 8;
  auto data = make_data(seed, contributions, count);

  std::vector<size_t> order(contributions);
  std::iota(order.begin(), order.end(), 0);
  auto first = run_exact(data, spread(order, 4), count, contributions);
  for (auto& r : first)
    REQUIRE(!r.err);
  const auto& ref = first[0].out;

  std::mt19937_64 rng(seed);
  size_t runs = 0;
  for (int shuffled = 0; shuffled < 4; ++shuffled) {
    if (shuffled > 0)
      std::shuffle(order.begin(), order.end(), rng);
    for (size_t ranks : {4, 2, 8, 1, 3, 5}) {
      CAPTURE(ranks);
      CAPTURE(shuffled);
      auto results = run_exact(data, spread(order, ranks), count, contributions);
      for (auto& r : results) {
        CHECK_MESSAGE(!r.err, describe(r.err));
        CHECK(same_bits(r.out, ref));
      }
      ++runs;
    }
  }
  // A rank with no contribution at all is fine too.
  auto with_empty = run_exact(data, {{0, 1, 2, 3}, {}, {4, 5, 6, 7}}, count, contributions);
  for (auto& r : with_empty) {
    CHECK(!r.err);
    CHECK(same_bits(r.out, ref));
  }
  MESSAGE(runs << " spreads and orders gave the same bits");

  // Close to the exact sum: each contribution is rounded to a multiple of
  // 2^-shift, then the sum once to float.
  float max_abs = 0;
  for (auto& c : data)
    for (float x : c)
      max_abs = std::max(max_abs, std::fabs(x));
  int shift = exact_shift(max_abs, contributions);
  long double resolution = std::ldexp(1.0L, -shift);
  size_t bad = 0;
  long double worst = 0;
  for (size_t i = 0; i < count; ++i) {
    long double exact = reference_sum(data, i);
    float rounded = static_cast<float>(exact);
    long double ulp = rounded == 0.0f ? 0.0L : std::ldexp(1.0L, std::ilogb(rounded) - 23);
    long double tol = contributions * resolution / 2 + ulp;
    long double err = std::fabs(static_cast<long double>(ref[i]) - exact);
    worst = std::max(worst, err / tol);
    bad += err > tol;
  }
  MESSAGE("shift " << shift << ", worst error / tolerance " << static_cast<double>(worst));
  CHECK(bad == 0);
  CHECK(ref[1] == 0.0f);                     // +1e3 - 1e3 ... cancels exactly
  CHECK(ref[2] == static_cast<float>(8 * std::ldexp(std::nearbyint(std::ldexp(static_cast<double>(1e-8f), shift)),
                                                   -shift)));

  // The motivation: plain float sums of the same data in different orders.
  std::vector<float> forward(count, 0.0f), backward(count, 0.0f), paired(count, 0.0f);
  for (size_t i = 0; i < count; ++i) {
    for (size_t k = 0; k < contributions; ++k)
      forward[i] += data[k][i];
    for (size_t k = contributions; k-- > 0;)
      backward[i] += data[k][i];
    float a = data[0][i] + data[1][i], b = data[2][i] + data[3][i];
    float c = data[4][i] + data[5][i], d = data[6][i] + data[7][i];
    paired[i] = (a + b) + (c + d); // what 4 ranks x 2 then a tree would do
  }
  size_t differ_fb = 0, differ_fp = 0;
  for (size_t i = 0; i < count; ++i) {
    differ_fb += std::memcmp(&forward[i], &backward[i], sizeof(float)) != 0;
    differ_fp += std::memcmp(&forward[i], &paired[i], sizeof(float)) != 0;
  }
  MESSAGE("plain float sums: forward vs backward differ in " << differ_fb << " of " << count
          << " elements, forward vs pairwise in " << differ_fp);
}

TEST_CASE("exact mode: non-finite input fails on every rank with overflow") {
  const size_t count = 33;
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    CAPTURE(bad);
    auto data = make_data(11, 4, count);
    data[2][17] = bad;
    auto results = run_exact(data, {{0, 1}, {2, 3}}, count, 4);
    for (auto& r : results) {
      CHECK(code_of(r.err) == errc::overflow);
      CHECK_MESSAGE(describe(r.err).find("non-finite") != std::string::npos, describe(r.err));
    }
    // The same through exact_sum directly.
    exact_sum s(count, 4);
    s.observe(data[2]);
    CHECK(std::isinf(s.local_max_abs()));
    CHECK(code_of(s.set_global_max_abs(s.local_max_abs())) == errc::overflow);
    exact_sum t(count, 4);
    REQUIRE(!t.set_global_max_abs(1e4f));
    CHECK(code_of(t.add(data[2])) == errc::overflow);
    CHECK(t.added() == 0);
  }
}

TEST_CASE("exact mode: more contributions than declared is an overflow") {
  const size_t count = 10;
  auto data = make_data(12, 5, count);
  SUBCASE("on one rank") {
    auto results = run_exact(data, {{0, 1, 2}, {3}}, count, 2);
    CHECK(describe(results[0].err) == "overflow: exact mode: declared 2 contributions, got 3");
    CHECK(code_of(results[1].err) == errc::overflow);
  }
  SUBCASE("only in total") {
    auto results = run_exact(data, {{0, 1}, {2, 3}, {4}}, count, 4);
    for (auto& r : results)
      CHECK(describe(r.err) == "overflow: exact mode: declared 4 contributions, got 5");
  }
  SUBCASE("exact_sum::add") {
    exact_sum s(count, 2);
    for (auto& c : data)
      s.observe(c);
    REQUIRE(!s.set_global_max_abs(s.local_max_abs()));
    CHECK(!s.add(data[0]));
    CHECK(!s.add(data[1]));
    CHECK(describe(s.add(data[2])) == "overflow: exact mode: declared 2 contributions, got 3");
  }
}

TEST_CASE("exact mode: misuse is invalid_argument") {
  const size_t count = 10;
  auto data = make_data(13, 2, count);
  std::vector<float> short_one(count - 1, 1.0f);
  std::vector<float> out(count);
  exact_sum s(count, 2);
  CHECK(code_of(s.add(data[0])) == errc::invalid_argument); // no scale yet
  CHECK(code_of(s.finish(out)) == errc::invalid_argument);
  s.observe(data[0]);
  CHECK(code_of(s.set_global_max_abs(-1.0f)) == errc::invalid_argument);
  CHECK(code_of(s.set_global_max_abs(std::numeric_limits<float>::quiet_NaN()))
        == errc::invalid_argument);
  CHECK(code_of(s.set_global_max_abs(s.local_max_abs() / 2)) == errc::invalid_argument);
  REQUIRE(!s.set_global_max_abs(s.local_max_abs()));
  CHECK(code_of(s.add(short_one)) == errc::invalid_argument);
  std::vector<float> too_big = data[0];
  too_big[3] = s.local_max_abs() * 2; // not observed: outside the agreed range
  CHECK(code_of(s.add(too_big)) == errc::invalid_argument);
  REQUIRE(!s.add(data[0]));
  CHECK(code_of(s.set_global_max_abs(1.0f)) == errc::invalid_argument); // scale is fixed now
  std::vector<float> wrong_out(count + 1);
  CHECK(code_of(s.finish(wrong_out)) == errc::invalid_argument);
  REQUIRE(!s.finish(out));
  CHECK(same_bits(out, [&] {
    std::vector<float> v(count);
    for (size_t i = 0; i < count; ++i)
      v[i] = fixed_to_float(s.accumulator()[i], s.shift());
    return v;
  }()));

  exact_sum u(count, 2);
  u.observe(short_one);
  CHECK(code_of(u.set_global_max_abs(1.0f)) == errc::invalid_argument);

  // Through the protocol: every rank fails, with the same code.
  contribution_set mixed = {data[0], short_one};
  auto results = run_exact(mixed, {{0}, {1}}, count, 2);
  CHECK(describe(results[0].err)
        == "invalid_argument: exact mode: another rank's contributions have the wrong size");
  CHECK(describe(results[1].err)
        == "invalid_argument: exact mode: contribution 0 has 9 elements, expected 10");
}

TEST_CASE("exact mode: a sum beyond the float range is an overflow") {
  float big = std::numeric_limits<float>::max();
  contribution_set data = {{big, 1.0f}, {big, 1.0f}};
  auto results = run_exact(data, {{0}, {1}}, 2, 2);
  for (auto& r : results)
    CHECK(describe(r.err) == "overflow: exact mode: a sum does not fit in float32");
  // Cancelling is fine; at that range (shift -67) a 1.0 is below the
  // fixed-point resolution and is lost, the price of order independence.
  contribution_set cancel = {{big, 1.0f}, {-big, 1.0f}};
  results = run_exact(cancel, {{0}, {1}}, 2, 2);
  for (auto& r : results) {
    CHECK(!r.err);
    CHECK(r.out == std::vector<float>{0.0f, 0.0f});
  }
}

TEST_CASE("exact mode: empty and zero inputs") {
  // No elements at all.
  contribution_set none = {{}, {}, {}};
  auto results = run_exact(none, {{0, 1}, {2}}, 0, 3);
  for (auto& r : results) {
    CHECK(!r.err);
    CHECK(r.out.empty());
  }
  // All zeros: the max is 0, a fixed shift, and zeros come out.
  contribution_set zeros(4, std::vector<float>(17, 0.0f));
  zeros[1][3] = -0.0f;
  results = run_exact(zeros, {{0, 1}, {2, 3}}, 17, 8);
  for (auto& r : results) {
    CHECK(!r.err);
    CHECK(r.out == std::vector<float>(17, 0.0f));
    CHECK(!std::signbit(r.out[3]));
  }
  // No contributions anywhere: zeros.
  results = run_exact(zeros, {{}, {}}, 17, 8);
  for (auto& r : results) {
    CHECK(!r.err);
    CHECK(r.out == std::vector<float>(17, 0.0f));
  }
  // A single rank, a single contribution: the value comes back unchanged
  // when it fits the fixed-point grid (here every value is a multiple of
  // 2^-shift).
  contribution_set one = {{1.0f, -2.5f, 0.75f, 1000.0f}};
  results = run_exact(one, {{0}}, 4, 1);
  REQUIRE(!results[0].err);
  CHECK(results[0].out == one[0]);
}

TEST_CASE("exact mode: a contribution split into pieces held by other ranks gives the same bits") {
  // Expert parallelism computes part of a micro-batch's gradient where the
  // expert lives: that part travels as a piece, the rest of the buffer as
  // the contribution (zero where the pieces are).
  const uint64_t seed = 20261207;
  const size_t count = 1031, contributions = 4;
  auto data = make_data(seed, contributions, count);
  auto whole = run_exact(data, {{0, 1}, {2, 3}}, count, contributions);
  for (auto& r : whole)
    REQUIRE(!r.err);

  // Contribution k keeps all but [100 + 50k, 300 + 50k) and [900, 1000),
  // which rank (k + 1) % 2 holds as two pieces.
  contribution_set holes = data;
  std::vector<std::vector<std::pair<size_t, std::vector<float>>>> parts(2);
  for (size_t k = 0; k < contributions; ++k)
    for (auto [a, b] : {std::pair<size_t, size_t>{100 + 50 * k, 300 + 50 * k}, {900, 1000}}) {
      parts[(k + 1) % 2].emplace_back(a, std::vector<float>(data[k].begin() + a,
                                                            data[k].begin() + b));
      std::fill(holes[k].begin() + a, holes[k].begin() + b, 0.0f);
    }
  std::vector<std::vector<exact_piece>> pieces(2);
  for (size_t r = 0; r < 2; ++r)
    for (auto& [at, values] : parts[r])
      pieces[r].push_back({at, values});

  local_group group(2);
  std::vector<rank_result> split(2);
  std::vector<std::thread> threads;
  for (size_t r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      std::vector<std::span<const float>> mine{holes[2 * r], holes[2 * r + 1]};
      split[r].out.assign(count, -1.0f);
      split[r].err = exact_all_reduce(group[r], mine, split[r].out, contributions, {}, pieces[r]);
    });
  for (auto& t : threads)
    t.join();
  for (auto& r : split) {
    CHECK_MESSAGE(!r.err, describe(r.err));
    CHECK(same_bits(r.out, whole[0].out));
  }
}

TEST_CASE("exact mode: a piece past the buffer fails on every rank and adds nothing") {
  const size_t count = 64;
  auto data = make_data(7, 2, count);
  std::vector<float> tail(10, 1.0f);
  std::vector<exact_piece> bad{{60, tail}};
  local_group group(2);
  std::vector<rank_result> out(2);
  std::vector<std::thread> threads;
  for (size_t r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      std::vector<std::span<const float>> mine{data[r]};
      out[r].out.assign(count, -1.0f);
      out[r].err = exact_all_reduce(group[r], mine, out[r].out, 2, {},
                                    r == 0 ? std::span<const exact_piece>(bad)
                                           : std::span<const exact_piece>{});
    });
  for (auto& t : threads)
    t.join();
  CHECK(describe(out[0].err)
        == "invalid_argument: exact mode: piece 0 (10 values at 60) runs past the buffer of 64");
  CHECK(describe(out[1].err)
        == "invalid_argument: exact mode: another rank's contributions have the wrong size");
  for (auto& r : out)
    CHECK(std::all_of(r.out.begin(), r.out.end(), [](float x) { return x == -1.0f; }));
}
