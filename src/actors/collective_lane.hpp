#pragma once

#include <caf/error.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace cmesh::actors {

/// Runs a trainer's collectives on a thread of their own, one at a time and
/// in the order they were submitted, so the trainer's thread computes while
/// they move. Every rank of a communicator submits the same collectives in
/// the same order (as it would call them), so the order on the wire is the
/// program order. The first failure latches: later jobs are not run, and
/// every wait reports it until drain() hands it over. At most `depth` jobs
/// wait at a time (submit blocks beyond). A job's buffers belong to it until
/// its wait returns.
///
/// Waits have no deadline of their own: every job is a collective with its
/// own timeout, and an abort of its communicator ends it. A wait still
/// running after `warn_after` logs a warning each time that passes.
class collective_lane {
public:
  using job = std::function<caf::error()>;
  using ticket = uint64_t;

  explicit collective_lane(size_t depth = 4,
                           std::chrono::milliseconds warn_after = std::chrono::seconds(30));
  ~collective_lane();
  collective_lane(const collective_lane&) = delete;
  collective_lane& operator=(const collective_lane&) = delete;

  /// Queues `j` (the thread starts on the first call).
  ticket submit(job j);
  /// Until job `t` has run (or been skipped): the latched error, if any.
  caf::error wait(ticket t);
  /// submit, then wait; on the caller's thread when nothing is queued or
  /// running (no hand-over to pay for: the order is the same).
  caf::error run(job j);
  /// Until every job submitted has run; hands over the latched error and
  /// clears it (the next job runs again).
  caf::error drain();
  /// Jobs run (not skipped) since construction.
  uint64_t jobs_run() const;

private:
  void loop();
  void wait_until(std::unique_lock<std::mutex>& lk, ticket t);

  const size_t depth_;
  const std::chrono::milliseconds warn_after_;
  mutable std::mutex mu_;
  std::condition_variable queued_; // to the thread: a job, or stop
  std::condition_variable done_;   // to waiters: a job finished, or room
  std::deque<std::pair<ticket, job>> queue_;
  ticket next_ = 1;     // the ticket of the next job submitted
  ticket finished_ = 0; // every job up to this one has run
  uint64_t ran_ = 0;
  caf::error latched_;
  bool stop_ = false;
  bool inline_ = false; // a job runs on a caller's thread: the lane's waits
  std::thread thread_;
};

} // namespace cmesh::actors
