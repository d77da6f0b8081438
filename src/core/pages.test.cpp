#include "core/pages.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>

using cmesh::page_array;

TEST_CASE("a page array starts zero and costs nothing until touched") {
  const size_t n = 16u << 20; // 64 MiB
  const size_t before = cmesh::resident_bytes();
  page_array a(n);
  REQUIRE(a.size() == n);
  CHECK(cmesh::resident_bytes() < before + (8u << 20));
  CHECK(std::all_of(a.begin() + (n / 2), a.begin() + (n / 2) + 1024, [](float x) { return x == 0; }));
}

TEST_CASE("discard zeroes the range, keeps the rest and returns whole pages") {
  const size_t n = 16u << 20;
  page_array a(n);
  std::fill(a.begin(), a.end(), 1.5f);
  const size_t full = cmesh::resident_bytes();
  // An unaligned range: its edges are zeroed by hand, the pages between
  // handed back.
  const size_t first = 1001, count = n - 3000;
  cmesh::discard_pages(a.data() + first, count);
  CHECK(cmesh::resident_bytes() + (48u << 20) < full);
  CHECK(a[first - 1] == 1.5f);
  CHECK(a[first] == 0.0f);
  CHECK(a[first + count - 1] == 0.0f);
  CHECK(a[first + count] == 1.5f);
  CHECK(std::count(a.begin(), a.end(), 0.0f) == static_cast<std::ptrdiff_t>(count));
  // Still usable: written again, it reads back.
  std::fill(a.begin() + first, a.begin() + first + count, 2.0f);
  CHECK(a[first + count / 2] == 2.0f);
  // A range inside one page: zeroed by hand.
  cmesh::discard_pages(a.data() + 10, 5);
  CHECK(a[9] == 1.5f);
  CHECK(a[10] == 0.0f);
  CHECK(a[14] == 0.0f);
  CHECK(a[15] == 1.5f);
}

TEST_CASE("page arrays move") {
  page_array a(100);
  a[3] = 7;
  page_array b(std::move(a));
  CHECK(b[3] == 7);
  CHECK(a.data() == nullptr);
  a = std::move(b);
  CHECK(a[3] == 7);
  page_array empty(0);
  CHECK(empty.size() == 0);
  cmesh::discard_pages(empty.data(), empty.size());
}

TEST_CASE("huge page arrays sit on a 2 MiB boundary, start zero and hold their values") {
  for (size_t n : {size_t{1}, size_t{170000}, (size_t{2} << 20) / sizeof(float), size_t{1} << 22}) {
    CAPTURE(n);
    page_array a(n, page_array::pages::huge);
    REQUIRE(a.size() == n);
    CHECK(reinterpret_cast<uintptr_t>(a.data()) % (uintptr_t{2} << 20) == 0);
    CHECK(std::all_of(a.begin(), a.end(), [](float x) { return x == 0; }));
    std::fill(a.begin(), a.end(), 3.0f);
    page_array b(std::move(a));
    CHECK(b[0] == 3.0f);
    CHECK(b[n - 1] == 3.0f);
  }
}
