#include "core/pages.hpp"

#include "core/check.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sys/mman.h>
#include <unistd.h>
#include <utility>

namespace cmesh {

namespace {

size_t page_size() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

} // namespace

page_array::page_array(size_t n, pages kind) : size_(n) {
  if (n == 0)
    return;
  bytes_ = (n * sizeof(float) + page_size() - 1) / page_size() * page_size();
  void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CMESH_CHECK(p != MAP_FAILED);
  data_ = static_cast<float*>(p);
#ifdef MADV_HUGEPAGE
  if (kind == pages::huge)
    (void) madvise(p, bytes_, MADV_HUGEPAGE); // a hint: without THP it changes nothing
#else
  (void) kind;
#endif
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

} // namespace cmesh
