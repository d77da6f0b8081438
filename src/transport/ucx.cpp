#include "transport/ucx.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>

namespace cmesh::ucx {

caf::error status_error(ucs_status_t st, const char* what) {
  return make_error(errc::transport_failure,
                    std::string(what) + ": " + ucs_status_string(st));
}

namespace {

/// Receives and drops what waits in the worker's unexpected-message queue:
/// fragments an aborted epoch's peers sent that no receive will ever match.
/// Destroying the worker would otherwise warn once for each. Bounded in
/// messages and time; a message that does not land within the bound (a
/// rendezvous whose sender died) is cancelled.
void drop_unexpected(ucp_worker_h worker) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::milliseconds(200);
  std::vector<char> scratch;
  for (int n = 0; n < 100000 && clock::now() < deadline; ++n) {
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h msg = ucp_tag_probe_nb(worker, 0, 0, 1, &info);
    if (msg == nullptr) {
      if (ucp_worker_progress(worker) == 0)
        return;
      continue;
    }
    scratch.resize(std::max<size_t>(info.length, 1));
    ucp_request_param_t param{};
    void* req = ucp_tag_msg_recv_nbx(worker, scratch.data(), info.length, msg, &param);
    if (UCS_PTR_IS_ERR(req))
      return;
    if (req == nullptr)
      continue;
    while (ucp_request_check_status(req) == UCS_INPROGRESS && clock::now() < deadline)
      ucp_worker_progress(worker);
    if (ucp_request_check_status(req) == UCS_INPROGRESS) {
      ucp_request_cancel(worker, req);
      ucp_worker_progress(worker);
    }
    ucp_request_free(req);
  }
}

} // namespace

worker_handle::~worker_handle() {
  if (worker_ != nullptr) {
    drop_unexpected(worker_);
    ucp_worker_destroy(worker_);
  }
  if (context_ != nullptr)
    ucp_cleanup(context_);
}

caf::error worker_handle::init(const std::string& name,
                               const std::vector<std::pair<std::string, std::string>>& options) {
  ucp_config_t* config = nullptr;
  UCS_CHECK(ucp_config_read(nullptr, nullptr, &config));
  for (auto& [key, value] : options) {
    if (std::getenv(("UCX_" + key).c_str()) != nullptr)
      continue; // the user's setting wins
    if (auto st = ucp_config_modify(config, key.c_str(), value.c_str()); st != UCS_OK) {
      ucp_config_release(config);
      return status_error(st, "ucp_config_modify");
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME
                      | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.name = name.c_str();
  params.mt_workers_shared = 0;
  auto st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  UCS_CHECK(st);

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  UCS_CHECK(ucp_worker_create(context_, &wp, &worker_));

  ucp_address_t* addr = nullptr;
  size_t len = 0;
  UCS_CHECK(ucp_worker_get_address(worker_, &addr, &len));
  address_.assign(reinterpret_cast<const char*>(addr), len);
  ucp_worker_release_address(worker_, addr);
  UCS_CHECK(ucp_worker_get_efd(worker_, &efd_));
  return {};
}

} // namespace cmesh::ucx
