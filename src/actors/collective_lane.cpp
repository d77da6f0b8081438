#include "actors/collective_lane.hpp"

#include "core/error.hpp"

#include <spdlog/spdlog.h>

namespace cmesh::actors {

namespace {
/// A job's error; an exception it throws as a typed error.
caf::error call(collective_lane::job& j) {
  try {
    return j();
  } catch (const std::exception& ex) {
    return make_error(errc::aborted, std::string("collective lane: a job threw: ") + ex.what());
  }
}
} // namespace

collective_lane::collective_lane(size_t depth, std::chrono::milliseconds warn_after)
    : depth_(depth == 0 ? 1 : depth), warn_after_(warn_after) {}

collective_lane::~collective_lane() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  queued_.notify_all();
  if (thread_.joinable())
    thread_.join();
}

collective_lane::ticket collective_lane::submit(job j) {
  std::unique_lock lk(mu_);
  if (!thread_.joinable())
    thread_ = std::thread([this] { loop(); });
  // Room in the queue: the job at its head is running or about to.
  while (queue_.size() >= depth_)
    if (done_.wait_for(lk, warn_after_) == std::cv_status::timeout)
      spdlog::warn("collective lane: a job has been running for over {} ms (queue full)",
                   warn_after_.count());
  const ticket t = next_++;
  queue_.emplace_back(t, std::move(j));
  lk.unlock();
  queued_.notify_one();
  return t;
}

void collective_lane::wait_until(std::unique_lock<std::mutex>& lk, ticket t) {
  while (finished_ < t)
    if (done_.wait_for(lk, warn_after_) == std::cv_status::timeout)
      spdlog::warn("collective lane: waited over {} ms for job {} (job {} done)",
                   warn_after_.count(), t, finished_);
}

caf::error collective_lane::wait(ticket t) {
  std::unique_lock lk(mu_);
  wait_until(lk, t);
  return latched_;
}

caf::error collective_lane::run(job j) {
  std::unique_lock lk(mu_);
  if (!queue_.empty() || finished_ + 1 != next_ || inline_) {
    lk.unlock();
    return wait(submit(std::move(j)));
  }
  // Idle: run it here, as the lane would, holding the lane meanwhile.
  const ticket t = next_++;
  caf::error e = latched_;
  if (!e) {
    inline_ = true;
    lk.unlock();
    e = call(j);
    lk.lock();
    inline_ = false;
    ++ran_;
    if (e && !latched_)
      latched_ = e;
    e = latched_;
  }
  finished_ = t;
  lk.unlock();
  done_.notify_all();
  queued_.notify_one(); // a job submitted meanwhile by another thread
  return e;
}

caf::error collective_lane::drain() {
  std::unique_lock lk(mu_);
  wait_until(lk, next_ - 1);
  return std::exchange(latched_, caf::error{});
}

uint64_t collective_lane::jobs_run() const {
  std::lock_guard lk(mu_);
  return ran_;
}

void collective_lane::loop() {
  std::unique_lock lk(mu_);
  for (;;) {
    queued_.wait(lk, [&] { return (stop_ || !queue_.empty()) && !inline_; });
    if (queue_.empty())
      return; // stop_, and nothing left
    auto [t, j] = std::move(queue_.front());
    queue_.pop_front();
    if (!latched_) {
      lk.unlock();
      caf::error e = call(j);
      j = nullptr; // the job's captures go before its waiter wakes
      lk.lock();
      ++ran_;
      if (e && !latched_)
        latched_ = std::move(e);
    }
    finished_ = t;
    done_.notify_all();
  }
}

} // namespace cmesh::actors
