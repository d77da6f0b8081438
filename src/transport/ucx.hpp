// The UCX boundary: status codes become cmesh errors here, and the context
// and worker are owned by small RAII types.
#pragma once

#include "core/error.hpp"

#include <ucp/api/ucp.h>

#include <string>
#include <utility>
#include <vector>

namespace cmesh::ucx {

/// transport_failure error naming the call and UCX's status text.
caf::error status_error(ucs_status_t st, const char* what);

/// Evaluates a ucs_status_t expression and returns its error from the
/// enclosing function when it is not UCS_OK.
#define UCS_CHECK(expr)                                                        \
  do {                                                                         \
    ucs_status_t ucs_check_st_ = (expr);                                       \
    if (ucs_check_st_ != UCS_OK)                                               \
      return ::cmesh::ucx::status_error(ucs_check_st_, #expr);                 \
  } while (false)

/// One UCP context and worker, tag matching and wakeup enabled.
class worker_handle {
public:
  worker_handle() = default;
  ~worker_handle();
  worker_handle(const worker_handle&) = delete;
  worker_handle& operator=(const worker_handle&) = delete;

  /// Creates context and worker for single-threaded use (one progress thread).
  /// `config` sets UCP options (name without the UCX_ prefix, value) that
  /// the environment does not set already.
  caf::error init(const std::string& name,
                  const std::vector<std::pair<std::string, std::string>>& config = {});

  ucp_context_h context() const { return context_; }
  ucp_worker_h worker() const { return worker_; }

  /// The worker's address blob, for the bootstrap's peer table.
  const std::string& address() const { return address_; }

  /// File descriptor that becomes readable when the worker has events.
  int event_fd() const { return efd_; }

private:
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  int efd_ = -1;
};

} // namespace cmesh::ucx
