// Bootstrap: the coordinator's TCP service (Boost.Asio) through which workers
// register, learn each other's UCP worker addresses, report results and
// receive a shutdown. Frames on the TCP stream are `u32 length (LE) | frame`,
// with frames as in wire.hpp (dst/src process = rank or wire::no_process).
//
// One connection per worker, kept open for the job: when it closes, the
// coordinator knows the worker is gone.
//
// Key/value store. The coordinator also keeps a bounded in-memory map from
// string keys to byte values: the rendezvous of each epoch's communicators
// (e.g. "epoch/7/host/3" -> a UCX worker address, "epoch/7/nccl/uid" -> an
// NCCL unique id), each epoch under a fresh prefix that is dropped when the
// epoch is over. kv_put stores or overwrites a key (a put beyond
// kv_keys_max keys or kv_value_bytes_max bytes is dropped with a warning and
// counted; the connection stays). kv_get answers at once when the key exists,
// or waits on the coordinator until the key is put or its wait (at most
// kv_wait_ms_max) passes; each connection may have kv_waits_max gets waiting,
// beyond which a get is answered "not found" at once. kv_drop erases every
// key with a prefix. A connection's waiting gets end with it. KV messages are
// served before (and without) a registration, so tools may use the store.
// Values must fit in one frame (coordinator_options::frame_bytes_max).
//
// Threads. coordinator_client is thread-safe: report(), kv_*(), and
// wait_shutdown() may be called from several threads at once (an actor
// reporting while the main thread waits for the shutdown, a communicator
// rendezvous while another thread waits). Each client runs one I/O thread
// that reads every incoming frame and files it: kv_value answers go to the
// kv_get waiting for that request id, a shutdown and the latest peer table
// are kept for whoever asks, so a message is never lost to the "wrong"
// caller. Writes are queued in call order and each caller waits for its own
// frame to be written, up to a write deadline. Every wait is bounded.
#pragma once

#include "core/error.hpp"
#include "core/job_config.hpp"
#include "transport/messages.hpp"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <variant>
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
  size_t kv_keys_max = size_t{1} << 20;        // keys in the KV store
  size_t kv_value_bytes_max = size_t{1} << 20; // bytes of one value
  size_t kv_waits_max = 1024;                  // kv_gets waiting, per connection
  /// The job's configuration (model::canonical_config). A registration
  /// that carries one with another digest is refused with `rejected`,
  /// naming every key that differs with both values. Empty: the first
  /// accepted registration that carries one sets it (and the coordinator
  /// logs whose it is), provided it agrees with `config_pinned`: the keys
  /// the coordinator fixes itself (its version and layout). A registration
  /// without a configuration (a job without training) is not checked.
  config_list job_config = {};
  config_list config_pinned = {};
};

/// The longest a kv_get waits on the coordinator (wait_ms is clamped to it);
/// coordinator_client::kv_get asks again for longer timeouts.
constexpr int64_t kv_wait_ms_max = 600000;

/// What the coordinator saw of one worker.
struct worker_event {
  enum class type { registered, report, disconnected, status, divergence } what;
  uint32_t rank = 0;
  wire::report report;        // for type::report
  wire::worker_status status; // for type::status
  uint64_t incarnation = 0;   // the registered incarnation (registered, disconnected)
  wire::replica_divergence divergence = {}; // for type::divergence
};

/// A supervision message from the coordinator to a worker.
using control_message = std::variant<wire::epoch_notice, wire::catchup_assign>;

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

  /// Sends a supervision message to `rank` (dropped when it has no live
  /// connection) or, with nullopt, to every registered connection. Any thread.
  void send_control(std::optional<uint32_t> rank, const control_message& m);

  /// Erases every key of the KV store that starts with `prefix` (all keys
  /// when it is empty). Waiting kv_gets keep waiting. Any thread.
  void kv_drop_prefix(const std::string& prefix);

  /// The value of a key of the KV store, or nullopt. Any thread.
  std::optional<wire::bytes> kv_peek(const std::string& key) const;

  /// Keys currently in the KV store.
  size_t kv_size() const;

  /// kv_puts dropped so far for exceeding kv_keys_max or kv_value_bytes_max.
  uint64_t kv_puts_dropped() const;

  /// kv_gets waiting on the coordinator for their key, over all connections.
  size_t kv_waiting() const;

  /// Called on the I/O thread for every registration, report and disconnect.
  void on_event(std::function<void(const worker_event&)> f);

  /// Stops serving and joins the I/O thread; idempotent.
  void stop();

private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

/// A worker's (or a tool's) connection to the coordinator. Thread-safe: see
/// the top of this file. Destroying or moving it while another thread uses it
/// is not allowed.
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

  /// Registers again with a coordinator that restarted (its state is gone):
  /// sends the registration and returns without waiting for a peer table.
  caf::error rejoin(const wire::register_worker& me);

  /// Sends a report (fire and forget; error if the connection is gone).
  caf::error report(const wire::report& r);

  /// Sends this worker's status beacon (fire and forget).
  caf::error send_status(const wire::worker_status& s);

  /// Reports that the replica groups' states differ (fire and forget).
  caf::error send_divergence(const wire::replica_divergence& d);

  /// Handles the coordinator's supervision messages, on the client's I/O
  /// thread (must not block). Messages that came before a handler was set
  /// (at most 64) are handed to it first, on the caller's thread.
  void on_control(std::function<void(const control_message&)> f);

  /// Waits up to `timeout` for a shutdown from the coordinator. Errors:
  /// timeout, closed (connection lost: the coordinator is gone).
  /// A shutdown that arrived earlier counts, whichever thread was waiting.
  expected<wire::shutdown> wait_shutdown(std::chrono::milliseconds timeout);

  /// The latest peer table received (tables change when a rank comes back).
  std::optional<wire::peer_table> latest_table() const;

  /// Stores `value` under `key` in the coordinator's KV store, overwriting.
  /// Returns once the frame is written (the coordinator applies puts and gets
  /// of one connection in call order). Errors: closed, timeout (write).
  caf::error kv_put(const std::string& key, const wire::bytes& value);

  /// The value of `key`, waiting up to `timeout` for it to be put. Errors:
  /// timeout (naming the key), closed (connection lost).
  expected<wire::bytes> kv_get(const std::string& key, std::chrono::milliseconds timeout);

  /// Erases every key that starts with `prefix`. Errors: closed, timeout.
  caf::error kv_drop(const std::string& prefix);

private:
  coordinator_client();
  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace cmesh
