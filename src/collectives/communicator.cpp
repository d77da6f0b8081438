#include "collectives/communicator.hpp"

#include <algorithm>

namespace cmesh::coll {

size_t membership::index_of(uint32_t rank) const {
  return static_cast<size_t>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
}

void failure_latch::request_abort(caf::error reason) {
  {
    std::lock_guard<std::mutex> g(mtx_);
    if (!abort_reason_)
      abort_reason_ = reason ? std::move(reason) : make_error(errc::aborted, "aborted");
  }
  aborted_ = true;
}

caf::error failure_latch::abort_reason() const {
  std::lock_guard<std::mutex> g(mtx_);
  return abort_reason_ ? abort_reason_ : make_error(errc::aborted, "aborted");
}

void failure_latch::poison(caf::error e) {
  std::lock_guard<std::mutex> g(mtx_);
  if (!poison_)
    poison_ = std::move(e);
}

caf::error failure_latch::poisoned() const {
  std::lock_guard<std::mutex> g(mtx_);
  return poison_;
}

} // namespace cmesh::coll
