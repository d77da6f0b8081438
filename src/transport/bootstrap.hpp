// Bootstrap: the coordinator's TCP service (Boost.Asio) through which workers
// register, learn each other's UCP worker addresses, report results and
// receive a shutdown. Frames on the TCP stream are `u32 length (LE) | frame`,
// with frames as in wire.hpp (dst/src process = rank or wire::no_process).
//
// One connection per worker, kept open for the job: when it closes, the
// coordinator knows the worker is gone.
#pragma once

#include "core/error.hpp"
#include "transport/messages.hpp"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace cmesh {

struct host_port {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  std::string to_string() const { return host + ":" + std::to_string(port); }
};

/// Parses "host:port" (the form of CMESH_COORDINATOR). Error: invalid_argument.
expected<host_port> parse_host_port(const std::string& text);

struct coordinator_options {
  std::string bind_host = "127.0.0.1";
  uint16_t port = 0;            // 0: an ephemeral port, see coordinator::port()
  uint32_t world_size = 1;      // workers expected before the peer table goes out
  size_t frame_bytes_max = 1 << 20;
  size_t reports_max = 100000;  // bound on reports kept for wait_report()
};

/// What the coordinator saw of one worker.
struct worker_event {
  enum class type { registered, report, disconnected } what;
  uint32_t rank = 0;
  wire::report report; // for type::report
};

/// The coordinator's bootstrap service; runs its own I/O thread.
class coordinator {
public:
  explicit coordinator(coordinator_options opts);
  ~coordinator();
  coordinator(const coordinator&) = delete;
  coordinator& operator=(const coordinator&) = delete;

  /// Binds and starts serving. Error: unreachable (cannot bind).
  caf::error start();

  /// The bound port (after start()).
  uint16_t port() const;

  /// Waits for a report matching `pred`; reports that arrived earlier count.
  /// Returns nullopt after `timeout`.
  std::optional<wire::report> wait_report(const std::function<bool(const wire::report&)>& pred,
                                          std::chrono::milliseconds timeout);

  /// All reports so far, in arrival order.
  std::vector<wire::report> reports() const;

  /// Ranks registered so far / currently disconnected after registering.
  std::vector<uint32_t> registered() const;
  std::vector<uint32_t> disconnected() const;

  /// Sends a shutdown to every connected worker.
  void broadcast_shutdown(int32_t exit_code, const std::string& reason);

  /// Called on the I/O thread for every registration, report and disconnect.
  void on_event(std::function<void(const worker_event&)> f);

  /// Stops serving and joins the I/O thread; idempotent.
  void stop();

private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

/// A worker's connection to the coordinator.
class coordinator_client {
public:
  ~coordinator_client();
  coordinator_client(coordinator_client&&) noexcept;
  coordinator_client& operator=(coordinator_client&&) noexcept;

  /// Connects, retrying refused connections until `timeout`.
  /// Error: unreachable, naming the address and the last failure.
  static expected<coordinator_client> connect(const host_port& where,
                                              std::chrono::milliseconds timeout);

  /// Registers and waits for the peer table. Errors: timeout, closed,
  /// invalid_argument (the coordinator's rejected message), malformed_frame.
  expected<wire::peer_table> register_and_wait(const wire::register_worker& me,
                                               std::chrono::milliseconds timeout);

  /// Sends a report (fire and forget; error if the connection is gone).
  caf::error report(const wire::report& r);

  /// Waits up to `timeout` for a shutdown from the coordinator. Errors:
  /// timeout, closed (connection lost: the coordinator is gone).
  expected<wire::shutdown> wait_shutdown(std::chrono::milliseconds timeout);

private:
  coordinator_client();
  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace cmesh
