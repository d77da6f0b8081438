#include "core/pages.hpp"

#include "core/check.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sys/mman.h>
#include <unistd.h>
#include <utility>
#include <vector>

namespace cmesh {

namespace {

size_t page_size() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

constexpr size_t huge_page = size_t{2} << 20; // x86-64 and aarch64 with 4 KiB pages

} // namespace

page_array::page_array(size_t n, pages kind) : size_(n) {
  if (n == 0)
    return;
  const size_t want = n * sizeof(float);
#ifdef MADV_HUGEPAGE
  if (kind == pages::huge) {
    // Whole 2 MiB pages on a 2 MiB boundary: transparent huge pages back
    // only aligned 2 MiB ranges, so an array smaller than one, or placed
    // off the boundary by mmap, would still fault in 4 KiB at a time (2 MB
    // of catch-up buffers: 512 faults, 5.5 ms on these virtual machines,
    // against 0.1 ms for one huge page, or 3.6 the first time the host
    // hands over its memory). Map a huge page more, then give back the
    // edges.
    bytes_ = (want + huge_page - 1) / huge_page * huge_page;
    void* p = mmap(nullptr, bytes_ + huge_page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CMESH_CHECK(p != MAP_FAILED);
    auto* lo = static_cast<uint8_t*>(p);
    auto* start = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(lo) + huge_page - 1) / huge_page * huge_page);
    if (start > lo)
      munmap(lo, static_cast<size_t>(start - lo));
    if (auto tail = static_cast<size_t>(lo + huge_page - start); tail > 0)
      munmap(start + bytes_, tail);
    (void) madvise(start, bytes_, MADV_HUGEPAGE); // a hint: without THP it changes nothing
    data_ = reinterpret_cast<float*>(start);
    return;
  }
#else
  (void) kind;
#endif
  bytes_ = (want + page_size() - 1) / page_size() * page_size();
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CMESH_CHECK(p != MAP_FAILED);
  data_ = static_cast<float*>(p);
}

page_array::~page_array() {
  if (data_)
    munmap(data_, bytes_);
}

page_array::page_array(page_array&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)),
      bytes_(std::exchange(other.bytes_, 0)) {}

page_array& page_array::operator=(page_array&& other) noexcept {
  if (this != &other) {
    if (data_)
      munmap(data_, bytes_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void discard_pages(float* p, size_t n) {
  if (n == 0)
    return;
  auto* lo = reinterpret_cast<uint8_t*>(p);
  auto* hi = reinterpret_cast<uint8_t*>(p + n);
  const auto ps = static_cast<uintptr_t>(page_size());
  auto* a = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(lo) + ps - 1) / ps * ps);
  auto* b = reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(hi) / ps * ps);
  if (a < b && madvise(a, static_cast<size_t>(b - a), MADV_DONTNEED) == 0) {
    std::memset(lo, 0, static_cast<size_t>(a - lo));
    std::memset(b, 0, static_cast<size_t>(hi - b));
  } else {
    std::memset(lo, 0, static_cast<size_t>(hi - lo));
  }
}

size_t resident_bytes() {
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f)
    return 0;
  unsigned long size = 0, resident = 0;
  const int got = std::fscanf(f, "%lu %lu", &size, &resident);
  std::fclose(f);
  return got == 2 ? static_cast<size_t>(resident) * page_size() : 0;
}

size_t resident_bytes_in(const float* p, size_t n) {
  if (n == 0)
    return 0;
  const size_t page = page_size();
  const auto a = reinterpret_cast<uintptr_t>(p) / page * page;
  const auto b = (reinterpret_cast<uintptr_t>(p + n) + page - 1) / page * page;
  std::vector<unsigned char> in((b - a) / page);
  if (::mincore(reinterpret_cast<void*>(a), b - a, in.data()) != 0)
    return 0;
  size_t pages = 0;
  for (unsigned char c : in)
    pages += c & 1;
  return pages * page;
}

} // namespace cmesh
