// A bulk payload: a large buffer that travels beside a frame as a UCX
// rendezvous transfer (the receiver pulls it), never msgpack-encoded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace cmesh {

class bulk {
public:
  bulk() = default;

  /// Page-aligned, uninitialised storage of `size` bytes, recycled through a
  /// bounded pool (512 MiB) so that large payloads land in mapped memory.
  static bulk allocate(size_t size);

  /// Wraps caller-owned storage kept alive by `owner`.
  bulk(std::shared_ptr<uint8_t[]> data, size_t size) : data_(std::move(data)), size_(size) {}

  uint8_t* data() const { return data_.get(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  std::span<uint8_t> span() const { return {data_.get(), size_}; }
  const std::shared_ptr<uint8_t[]>& owner() const { return data_; }

private:
  std::shared_ptr<uint8_t[]> data_;
  size_t size_ = 0;
};

} // namespace cmesh
