#include "kernels/embedding.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

namespace {
namespace k = cmesh::kernels::cpu;
}

TEST_CASE("gather_rows: lookups, and zeros for negative indices") {
  const std::vector<float> table{0, 1, 10, 11, 20, 21}; // 3 rows of 2
  const std::vector<std::int32_t> index{2, -1, 0, 2};
  std::vector<float> out(8, 7.0f);
  k::gather_rows(table.data(), index.data(), 4, 2, out.data());
  CHECK(out == std::vector<float>{20, 21, 0, 0, 0, 1, 20, 21});
}

TEST_CASE("scatter_add_rows: the adjoint of gather_rows (repeats add up)") {
  const std::vector<double> rows{1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<std::int32_t> index{2, -1, 0, 2};
  std::vector<double> table(6, 0.5);
  k::scatter_add_rows(rows.data(), index.data(), 4, 2, table.data());
  CHECK(table == std::vector<double>{5.5, 6.5, 0.5, 0.5, 8.5, 10.5});
  // <gather(T), R> == <T, scatter(R)> for any T and R.
  const std::vector<double> t{0.3, -1.0, 2.0, 0.25, 4.0, -0.5};
  std::vector<double> g(8), s(6, 0.0);
  k::gather_rows(t.data(), index.data(), 4, 2, g.data());
  k::scatter_add_rows(rows.data(), index.data(), 4, 2, s.data());
  double lhs = 0, rhs = 0;
  for (std::size_t i = 0; i < 8; ++i)
    lhs += g[i] * rows[i];
  for (std::size_t i = 0; i < 6; ++i)
    rhs += t[i] * s[i];
  CHECK(lhs == doctest::Approx(rhs));
}
