// The collectives' one interface, over an explicit membership.
//
// State after failure: any error (peer_lost naming the rank, timeout,
// aborted) POISONS the communicator. Every later operation returns
// errc::poisoned at once, without touching the network, until the caller
// builds a new communicator for the next epoch's membership. Building one
// without the dead ranks needs nothing from them and no process restart.
//
// Threads: operations are called by one thread at a time. abort() may be
// called from any thread (or actor) while an operation runs; it makes the
// running operation, and every later one, return errc::aborted promptly.
#pragma once

#include "collectives/dtype.hpp"
#include "core/error.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace cmesh::coll {

/// Who takes part: the epoch id and the ordered global ranks. A member's
/// index in `ranks` is its position in every algorithm.
struct membership {
  uint64_t epoch = 0;
  std::vector<uint32_t> ranks;

  size_t size() const { return ranks.size(); }
  /// Index of `rank`, or size() when it is not a member.
  size_t index_of(uint32_t rank) const;
};

struct op_options {
  std::chrono::milliseconds timeout{30000};
  /// A bulk transfer the peers are already in: the host backend polls
  /// without sleeping on its worker's events, whatever its
  /// host_options::sleep_when_idle (a nap stalls the stream for its length).
  bool transfer = false;
};

/// A communicator's abort request and poisoning error, for backends to
/// share; thread-safe.
class failure_latch {
public:
  /// Records an abort request; the first reason wins (errc::aborted if none).
  void request_abort(caf::error reason);
  bool abort_requested() const { return aborted_.load(std::memory_order_relaxed); }
  /// The abort's reason (errc::aborted when none was given).
  caf::error abort_reason() const;
  /// Records the error that poisons the communicator; the first one wins.
  void poison(caf::error e);
  caf::error poisoned() const;

private:
  std::atomic<bool> aborted_{false};
  mutable std::mutex mtx_;
  caf::error abort_reason_;
  caf::error poison_;
};

class communicator {
public:
  virtual ~communicator() = default;

  virtual const membership& members() const = 0;
  /// This process's index in members().ranks.
  virtual size_t index() const = 0;
  size_t size() const { return members().size(); }

  /// In place: every member ends with the reduction of all members' buffers.
  virtual caf::error all_reduce(void* buf, size_t count, dtype t, reduce_op op,
                                const op_options& o = {}) = 0;

  /// `in` holds sum(counts) elements; member i gets the reduction of block i
  /// (counts[i] elements, blocks in order) into `out`. In place: `out` may
  /// be this member's own block of `in` (no other overlap).
  virtual caf::error reduce_scatter(const void* in, void* out, const std::vector<size_t>& counts,
                                    dtype t, reduce_op op, const op_options& o = {}) = 0;

  /// Member i contributes counts[i] elements from `in`; `out` receives all
  /// blocks in member order (sum(counts) elements). In place: `in` may be
  /// this member's own block of `out` (no other overlap).
  virtual caf::error all_gather(const void* in, void* out, const std::vector<size_t>& counts,
                                dtype t, const op_options& o = {}) = 0;

  /// The root's buffer (root is an index into members) reaches every member.
  virtual caf::error broadcast(void* buf, size_t count, dtype t, size_t root,
                               const op_options& o = {}) = 0;

  /// send_counts[j] elements go to member j (blocks of `in` in order);
  /// recv_counts[j] elements come from member j (blocks of `out` in order).
  virtual caf::error all_to_allv(const void* in, const std::vector<size_t>& send_counts, void* out,
                                 const std::vector<size_t>& recv_counts, dtype t,
                                 const op_options& o = {}) = 0;

  /// Equal blocks of `count` elements to and from every member.
  caf::error all_to_all(const void* in, void* out, size_t count, dtype t, const op_options& o = {}) {
    std::vector<size_t> counts(size(), count);
    return all_to_allv(in, counts, out, counts, t, o);
  }

  virtual caf::error barrier(const op_options& o = {}) = 0;

  /// Makes the running operation and all later ones fail with `reason`
  /// (errc::aborted unless given). Safe from any thread.
  virtual void abort(caf::error reason = {}) = 0;

  /// The error that poisoned this communicator, or none.
  virtual caf::error poisoned() const = 0;

  // -- typed helpers ---------------------------------------------------------
  template <class T>
  caf::error all_reduce(std::span<T> buf, reduce_op op, const op_options& o = {}) {
    return all_reduce(buf.data(), buf.size(), dtype_of<T>(), op, o);
  }
};

} // namespace cmesh::coll
