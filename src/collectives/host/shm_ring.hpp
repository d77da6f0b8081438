// A single-producer single-consumer ring of message slots in shared memory,
// between two processes of one host: the host backend's path from a member
// of a communicator to the next, when all are on one host (docs/design.md,
// Collectives: shared-memory ring). The reader creates the segment (memfd) and publishes where it is
// (pid, descriptor, a random nonce); the writer maps it through
// /proc/<pid>/fd/<fd> and checks the nonce, so a process of another host
// or namespace that happens to have the same pid cannot be mistaken for
// the reader. A writer killed mid-message leaves the head where it was:
// the reader sees nothing, never a torn message.
#pragma once

#include "core/error.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <sys/types.h>

namespace cmesh::coll {

/// Where a reader's segment is, as published to its writer.
struct shm_ring_locator {
  int64_t pid = 0;
  int64_t fd = -1;
  uint64_t nonce = 0;
  uint64_t slots = 0;
  uint64_t slot_bytes = 0;
};

class shm_ring {
public:
  shm_ring() = default;
  ~shm_ring();
  shm_ring(const shm_ring&) = delete;
  shm_ring& operator=(const shm_ring&) = delete;
  shm_ring(shm_ring&& o) noexcept { *this = std::move(o); }
  shm_ring& operator=(shm_ring&& o) noexcept;

  /// A fresh segment of `slots` slots of `slot_bytes`, for this process to read.
  static expected<shm_ring> create(size_t slots, size_t slot_bytes);
  /// Maps a peer's segment to write into. Errors: unreachable (no such
  /// process or descriptor, or not this host), invalid_argument (the
  /// nonce or the geometry differ).
  static expected<shm_ring> attach(const shm_ring_locator& where);

  shm_ring_locator locator() const;
  /// The reader's descriptor is closed once its writer has attached.
  void close_descriptor();
  bool valid() const { return base_ != nullptr; }
  size_t slot_bytes() const { return slot_bytes_; }

  // -- writer ----------------------------------------------------------------------
  /// A free slot's payload, or null when the ring is full.
  uint8_t* reserve();
  /// Publishes the reserved slot: `bytes` of payload under `tag`.
  void publish(uint64_t tag, size_t bytes);

  // -- reader ----------------------------------------------------------------------
  /// The oldest unread message's payload, or null when there is none.
  const uint8_t* peek(uint64_t& tag, size_t& bytes);
  /// Hands the oldest message's slot back to the writer.
  void release();

private:
  struct header;
  header* hdr() const { return reinterpret_cast<header*>(base_); }
  uint8_t* slot(uint64_t i) const;

  uint8_t* base_ = nullptr;
  size_t map_bytes_ = 0;
  size_t slots_ = 0;
  size_t slot_bytes_ = 0;
  int fd_ = -1;
  uint64_t nonce_ = 0;
  uint64_t cursor_ = 0; // writer: next to publish; reader: next to read
};

} // namespace cmesh::coll
