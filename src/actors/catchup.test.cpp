#include "actors/catchup.hpp"

#include <doctest/doctest.h>

#include <cstring>
#include <numeric>
#include <vector>

using namespace cmesh;
using namespace cmesh::actors;

namespace {

/// A source's snapshot range of `l`, float k of array i holding 1000 i + k
/// and the padding -1.
std::vector<float> range_of(const snapshot_layout& l) {
  std::vector<float> r(l.total, -1.0f);
  for (size_t i = 0; i < 4; ++i)
    for (size_t k = 0; k < l.n[i]; ++k)
      r[l.at[i] + k] = static_cast<float>(1000 * i + k);
  return r;
}

std::span<const uint8_t> bytes_of(const float* p, size_t n) {
  return {reinterpret_cast<const uint8_t*>(p), n * sizeof(float)};
}

} // namespace

TEST_CASE("snapshot layout: arrays on 16-float boundaries, pieces cover the range") {
  snapshot_layout l(std::array<size_t, 4>{37, 37, 37, 3});
  CHECK(l.at == std::array<size_t, 4>{0, 48, 96, 144});
  CHECK(l.total == 160);
  CHECK(l.pieces(64) == 3);
  CHECK(l.pieces(160) == 1);
  CHECK(l.pieces(1) == 160);
  snapshot_layout empty(std::array<size_t, 4>{0, 0, 0, 0});
  CHECK(empty.total == 0);
  CHECK(empty.pieces(64) == 0);
}

TEST_CASE("a joiner rebuilds its arrays from pieces of any size, padding skipped") {
  const snapshot_layout l(std::array<size_t, 4>{37, 37, 37, 3});
  const auto range = range_of(l);
  for (size_t per : {size_t{1}, size_t{7}, size_t{16}, size_t{50}, size_t{160}}) {
    CAPTURE(per);
    std::vector<std::vector<float>> a;
    for (size_t i = 0; i < 4; ++i)
      a.emplace_back(l.n[i], 0.0f);
    std::array<std::span<float>, 4> arrays{a[0], a[1], a[2], a[3]};
    for (size_t k = 0; k < l.pieces(per); ++k) {
      const size_t at = k * per, n = std::min(per, l.total - at);
      REQUIRE_FALSE(place_piece(l, at, bytes_of(range.data() + at, n), arrays));
    }
    for (size_t i = 0; i < 4; ++i)
      for (size_t k = 0; k < l.n[i]; ++k)
        REQUIRE(a[i][k] == static_cast<float>(1000 * i + k));
  }
}

TEST_CASE("a malformed piece is refused and changes nothing") {
  const snapshot_layout l(std::array<size_t, 4>{8, 8, 8, 2});
  std::vector<float> p(8, 0.0f), m(8, 0.0f), v(8, 0.0f), sc(2, 0.0f);
  std::array<std::span<float>, 4> arrays{p, m, v, sc};
  const std::vector<float> ones(64, 1.0f);
  auto untouched = [&] {
    for (auto* x : {&p, &m, &v, &sc})
      for (float f : *x)
        if (f != 0.0f)
          return false;
    return true;
  };
  SUBCASE("past the end") {
    CHECK(code_of(place_piece(l, l.total - 2, bytes_of(ones.data(), 4), arrays))
          == errc::invalid_argument);
  }
  SUBCASE("an offset beyond the range") {
    CHECK(code_of(place_piece(l, l.total + 1, bytes_of(ones.data(), 0), arrays))
          == errc::invalid_argument);
  }
  SUBCASE("not whole floats") {
    std::span<const uint8_t> b(reinterpret_cast<const uint8_t*>(ones.data()), 7);
    CHECK(code_of(place_piece(l, 0, b, arrays)) == errc::invalid_argument);
  }
  SUBCASE("arrays of another shape") {
    std::vector<float> longer(9, 0.0f);
    std::array<std::span<float>, 4> other{longer, m, v, sc};
    CHECK(code_of(place_piece(l, 0, bytes_of(ones.data(), 4), other)) == errc::invalid_argument);
  }
  CHECK(untouched());
}
