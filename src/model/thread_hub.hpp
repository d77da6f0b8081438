// An all-to-all between models in threads of one process, for tests and
// benchmarks that run a group's ranks side by side without communicators.
#pragma once

#include "core/check.hpp"

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

namespace cmesh::model {

/// The all-to-all between models in threads of one process: every call is
/// a barrier at which each rank's send blocks are copied to their
/// receivers (what the group communicator's all_to_allv does across
/// processes).
class thread_hub {
public:
  explicit thread_hub(size_t ranks) : n_(ranks), in_(ranks), sends_(ranks) {}

  void all_to_all(size_t me, const char* in, const std::vector<size_t>& send_bytes, char* out,
                  const std::vector<size_t>& recv_bytes) {
    std::unique_lock lk(mu_);
    in_[me] = in;
    sends_[me] = send_bytes;
    barrier(lk, arrived_, round_);
    size_t at = 0; // everyone's inputs are published: copy mine out of each
    for (size_t j = 0; j < n_; ++j) {
      size_t off = 0;
      for (size_t q = 0; q < me; ++q)
        off += sends_[j][q];
      CMESH_CHECK_EQ(sends_[j][me], recv_bytes[j]); // the sizes the sender sends
      if (recv_bytes[j] > 0) // a rank receiving nothing may pass null
        std::memcpy(out + at, in_[j] + off, recv_bytes[j]);
      at += recv_bytes[j];
    }
    barrier(lk, done_, done_round_); // nobody reuses its input before all have copied
  }

private:
  void barrier(std::unique_lock<std::mutex>& lk, size_t& count, uint64_t& round) {
    const uint64_t mine = round;
    if (++count == n_) {
      count = 0;
      ++round;
      cv_.notify_all();
    } else {
      cv_.wait(lk, [&] { return round != mine; });
    }
  }

  size_t n_;
  std::mutex mu_;
  std::condition_variable cv_;
  size_t arrived_ = 0, done_ = 0;
  uint64_t round_ = 0, done_round_ = 0;
  std::vector<const char*> in_;
  std::vector<std::vector<size_t>> sends_;
};

} // namespace cmesh::model
