// A flat array whose memory can be handed back to the operating system in
// pieces while the array stays valid: fully sharded training keeps a whole
// parameter (and gradient) buffer's address range, but only the tensors in
// use are resident.
//
// The memory is an anonymous private mapping: untouched pages cost nothing
// and read as zero; discard_pages() returns the whole pages inside a range
// (madvise MADV_DONTNEED) and zeroes the rest of the range, so afterwards
// the range reads as zero and only its edges (at most two pages) stay
// resident.
#pragma once

#include <cstddef>
#include <span>

namespace cmesh {

class page_array {
public:
  /// Transparent huge pages (Linux, "madvise" mode): a 2 MiB page is one
  /// fault instead of 512. Filling a fresh 100 MB buffer took 260 ms of
  /// faults on 4 KiB pages on these virtual machines, 30 ms on huge pages.
  /// A huge array is mapped in whole 2 MiB pages on a 2 MiB boundary (up to
  /// 2 MiB more than it needs): keep several small ones in one.
  enum class pages { normal, huge };

  page_array() = default;
  /// `n` floats, all zero, none resident yet. Aborts when the mapping fails.
  explicit page_array(size_t n, pages kind = pages::normal);
  ~page_array();
  page_array(page_array&& other) noexcept;
  page_array& operator=(page_array&& other) noexcept;
  page_array(const page_array&) = delete;
  page_array& operator=(const page_array&) = delete;

  float* data() { return data_; }
  const float* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<float> span() { return {data_, size_}; }
  float& operator[](size_t i) { return data_[i]; }
  const float& operator[](size_t i) const { return data_[i]; }
  float* begin() { return data_; }
  float* end() { return data_ + size_; }

private:
  float* data_ = nullptr;
  size_t size_ = 0;
  size_t bytes_ = 0; // mapped
};

/// Elements [p, p + n) read as zero afterwards and the whole pages inside
/// them go back to the operating system. For private anonymous memory only
/// (a page_array, or any heap memory).
void discard_pages(float* p, size_t n);

/// This process's resident memory now, in bytes (0 where unknown).
size_t resident_bytes();

/// The bytes of the pages holding [p, p + n) that are resident now
/// (mincore; whole pages, so a range's edge pages count whole; 0 where
/// unknown).
size_t resident_bytes_in(const float* p, size_t n);

} // namespace cmesh
