// CUDA gather_rows / scatter_add_rows against the CPU oracle.
#include "kernels/cuda/ops.hpp"
#include "kernels/cuda/test_support.hpp"
#include "kernels/embedding.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace {

namespace cpu = cmesh::kernels::cpu;
namespace gpu = cmesh::kernels::cuda;
using namespace cmesh::kernels::cuda_test;

struct shape {
  std::size_t count, width, table_rows;
};

// Few table rows for many indices: lots of repeats for the scatter.
constexpr shape shapes[] = {{1, 1, 1},      {7, 3, 5},     {100, 33, 10}, {1000, 257, 50},
                            {4097, 64, 3},  {513, 1, 1000}, {300, 1031, 7}};

// Indices in [-1, table_rows): about one in table_rows + 1 is negative.
std::vector<std::int32_t> make_index(const shape& sh, std::mt19937& rng) {
  return uniform_int(sh.count, rng, -1, static_cast<std::int32_t>(sh.table_rows) - 1);
}

} // namespace

TEST_CASE("cuda gather_rows: bit-identical to the cpu oracle, zeros for negative indices") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(1);
  for (const shape sh : shapes) {
    CAPTURE(sh.count);
    CAPTURE(sh.width);
    const auto table = uniform(sh.table_rows * sh.width, rng, -1.0f, 1.0f);
    const auto index = make_index(sh, rng);
    device_vector<float> dtable(table), dout(uniform(sh.count * sh.width, rng, 5.0f, 6.0f));
    device_vector<std::int32_t> dindex(index);
    gpu::gather_rows(dtable.get(), dindex.get(), sh.count, sh.width, dout.get(), s);
    s.sync();
    std::vector<float> want(sh.count * sh.width);
    cpu::gather_rows(table.data(), index.data(), sh.count, sh.width, want.data());
    CHECK(count_different(dout.download(), want, "gather_rows") == 0);
  }
}

TEST_CASE("cuda scatter_add_rows: deterministic, bit-identical to the cpu oracle") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(2);
  for (const shape sh : shapes) {
    CAPTURE(sh.count);
    CAPTURE(sh.width);
    const auto rows = uniform(sh.count * sh.width, rng, -1.0f, 1.0f);
    const auto table0 = uniform(sh.table_rows * sh.width, rng, -1.0f, 1.0f);
    const auto index = make_index(sh, rng);
    device_vector<float> drows(rows), dtable(table0);
    device_vector<std::int32_t> dindex(index);
    gpu::scatter_add_rows(drows.get(), dindex.get(), sh.count, sh.width, dtable.get(), s);
    s.sync();
    auto want = table0;
    cpu::scatter_add_rows(rows.data(), index.data(), sh.count, sh.width, want.data());
    CHECK(count_different(dtable.download(), want, "scatter_add_rows") == 0);
  }
}

TEST_CASE("cuda scatter_add_rows_atomic: equal to the cpu oracle up to summation order") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(3);
  for (const shape sh : shapes) {
    CAPTURE(sh.count);
    CAPTURE(sh.width);
    const auto rows = uniform(sh.count * sh.width, rng, -1.0f, 1.0f);
    const auto table0 = uniform(sh.table_rows * sh.width, rng, -1.0f, 1.0f);
    const auto index = make_index(sh, rng);
    device_vector<float> drows(rows), dtable(table0);
    device_vector<std::int32_t> dindex(index);
    gpu::scatter_add_rows_atomic(drows.get(), dindex.get(), sh.count, sh.width, dtable.get(), s);
    s.sync();
    auto want = table0;
    cpu::scatter_add_rows(rows.data(), index.data(), sh.count, sh.width, want.data());
    // Each float addition rounds: bound by (terms) * eps * (sum of |terms|).
    std::vector<double> abs_sum(table0.size()), terms(table0.size(), 1.0);
    for (std::size_t e = 0; e < table0.size(); ++e)
      abs_sum[e] = std::fabs(table0[e]);
    for (std::size_t i = 0; i < sh.count; ++i) {
      if (index[i] < 0)
        continue;
      for (std::size_t j = 0; j < sh.width; ++j) {
        const std::size_t e = static_cast<std::size_t>(index[i]) * sh.width + j;
        abs_sum[e] += std::fabs(rows[i * sh.width + j]);
        terms[e] += 1.0;
      }
    }
    std::vector<double> tol(table0.size());
    for (std::size_t e = 0; e < tol.size(); ++e)
      tol[e] = 2.0 * terms[e] * 1.2e-7 * abs_sum[e] + 1e-37;
    CHECK(count_outside(dtable.download(), want, tol, "scatter_add_rows_atomic") == 0);
  }
}

TEST_CASE("cuda gather/scatter: count == 0 or width == 0 touches nothing") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  device_vector<float> dtable(std::vector<float>{1.0f, 2.0f});
  gpu::gather_rows(dtable.get(), nullptr, 0, 2, nullptr, s);
  gpu::scatter_add_rows(nullptr, nullptr, 0, 2, dtable.get(), s);
  gpu::scatter_add_rows(nullptr, nullptr, 5, 0, dtable.get(), s);
  gpu::scatter_add_rows_atomic(nullptr, nullptr, 0, 2, dtable.get(), s);
  s.sync();
  CHECK(dtable.download() == std::vector<float>{1.0f, 2.0f});
}
