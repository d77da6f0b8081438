// Bootstrap over TCP with Boost.Asio.
//
// The coordinator owns one I/O thread and keeps all connection state on it
// (waiting kv_gets included); only what callers' threads query (ranks,
// reports, the KV map, the event callback) sits behind a mutex.
//
// The client connects synchronously, driving its private io_context with
// run_one_for so that every wait has a deadline. Once connected, it hands
// the io_context to its own I/O thread: that thread owns the socket, reads
// every frame and files it into mutex-guarded state (condition variable),
// and writes the frames callers queue. Callers only ever wait on the
// condition variable, with a deadline.
#include "transport/bootstrap.hpp"

#include "transport/wire.hpp"

#include <boost/asio.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <span>
#include <string_view>
#include <thread>
#include <variant>

namespace cmesh {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using error_code = boost::system::error_code;
using clock_type = std::chrono::steady_clock;
using namespace std::chrono_literals;

namespace {

constexpr size_t length_bytes = 4;
/// Frames queued for one connection before the coordinator gives up on it:
/// a worker that stops reading must not grow the coordinator's memory.
constexpr size_t write_queue_max = 1024;
/// How long stop() lets queued frames (a broadcast shutdown) drain.
constexpr auto close_linger = 500ms;
/// Accept failures (out of descriptors) back off instead of spinning.
constexpr auto accept_retry_interval = 100ms;
/// The client's frame bound: peer tables grow with the world size, and they
/// come from the coordinator, which a worker trusts more than the reverse.
constexpr size_t client_frame_bytes_max = size_t{64} << 20;
/// report() has no timeout of its own; a small frame that cannot be written
/// within this long means the coordinator stopped reading.
constexpr auto client_write_timeout = 10s;
constexpr auto connect_retry_interval = 50ms;
/// Bound on draining an operation that was just cancelled.
constexpr auto cancel_drain = 1s;
/// How long kv_get waits for the coordinator's answer beyond the wait it asked
/// the coordinator for (the coordinator answers "not found" when that passes).
constexpr auto kv_answer_margin = 2s;
/// Peer tables and rejections kept for register_and_wait (later tables only
/// replace latest_table()).
constexpr size_t client_answers_max = 16;
/// Supervision messages kept until a handler is set.
constexpr size_t client_control_backlog_max = 64;

/// now + timeout, clamped so that no caller's timeout overflows the clock.
clock_type::time_point deadline_after(std::chrono::milliseconds timeout) {
  constexpr std::chrono::milliseconds far = std::chrono::hours(24 * 365);
  return clock_type::now() + std::clamp(timeout, std::chrono::milliseconds(0), far);
}

using packet = std::vector<uint8_t>;

/// `u32 length (LE) | frame` for one message.
template <class T>
packet make_packet(const wire::frame_header& h, const T& msg) {
  auto frame = wire::encode(h, msg);
  auto n = static_cast<uint32_t>(frame.size());
  packet out;
  out.reserve(length_bytes + frame.size());
  for (size_t i = 0; i < length_bytes; ++i)
    out.push_back(static_cast<uint8_t>(n >> (8 * i)));
  out.insert(out.end(), frame.begin(), frame.end());
  return out;
}

uint32_t decode_length(const std::array<uint8_t, length_bytes>& b) {
  return uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
}

caf::error oversized_frame(size_t n, size_t max) {
  return make_error(errc::malformed_frame, "frame of " + std::to_string(n)
                                             + " bytes exceeds the limit of " + std::to_string(max));
}

wire::frame_header header(uint32_t src, uint32_t dst, uint64_t epoch = 0) {
  wire::frame_header h;
  h.src_process = src;
  h.dst_process = dst;
  h.epoch = epoch;
  return h;
}

/// Read or write errors that only mean the peer went away (no warning).
bool is_disconnect(const error_code& ec) {
  return ec == asio::error::eof || ec == asio::error::connection_reset
         || ec == asio::error::broken_pipe || ec == asio::error::operation_aborted;
}

std::string endpoint_text(const tcp::socket& s) {
  error_code ec;
  auto ep = s.remote_endpoint(ec);
  return ec ? "an unknown peer" : ep.address().to_string() + ":" + std::to_string(ep.port());
}

/// Completion of one asynchronous operation the client waits for. Handlers
/// hold it by shared_ptr, so a wait that gives up never leaves them dangling.
struct op_state {
  bool done = false;
  error_code ec;
};

} // namespace

// -- parse_host_port -----------------------------------------------------------

expected<host_port> parse_host_port(const std::string& text) {
  auto bad = [&](const std::string& why) {
    return make_error(errc::invalid_argument,
                      "bad address \"" + text + "\": " + why + " (expected host:port)");
  };
  auto colon = text.rfind(':');
  if (colon == std::string::npos)
    return bad("no port");
  host_port out;
  out.host = text.substr(0, colon);
  if (out.host.size() >= 2 && out.host.front() == '[' && out.host.back() == ']')
    out.host = out.host.substr(1, out.host.size() - 2); // "[::1]:5555"
  if (out.host.empty())
    return bad("empty host");
  std::string_view digits(text.data() + colon + 1, text.size() - colon - 1);
  unsigned long port = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), port);
  if (digits.empty() || end != digits.data() + digits.size()
      || (ec != std::errc{} && ec != std::errc::result_out_of_range))
    return bad("port is not a number");
  if (ec == std::errc::result_out_of_range || port == 0 || port > 65535)
    return bad("port out of range 1-65535");
  out.port = static_cast<uint16_t>(port);
  return out;
}

// -- coordinator ---------------------------------------------------------------

struct coordinator::impl {
  struct parked_get;
  using parked_ptr = std::shared_ptr<parked_get>;
  using parked_map = std::multimap<std::string, parked_ptr>; // by key

  struct connection {
    explicit connection(tcp::socket s)
      : sock(std::move(s)), linger(sock.get_executor()), peer(endpoint_text(sock)) {}
    tcp::socket sock;
    asio::steady_timer linger;
    std::string peer; // for logs
    std::array<uint8_t, length_bytes> length{};
    std::vector<uint8_t> frame;
    std::deque<packet> out; // front is being written; deque keeps it in place
    std::optional<uint32_t> rank;
    std::set<parked_ptr> parked; // its kv_gets waiting for a key
    bool closing = false; // stop(): close once `out` drains
    bool closed = false;
  };
  using conn_ptr = std::shared_ptr<connection>;

  /// A kv_get waiting for its key to be put, or for its timer. Owned by
  /// `waiting` and its connection's `parked` until finished.
  struct parked_get {
    explicit parked_get(asio::io_context& io) : timer(io) {}
    conn_ptr conn; // null once finished
    uint64_t request_id = 0;
    std::string key;
    asio::steady_timer timer;
    parked_map::iterator at; // its entry in `waiting`
  };

  struct rank_state {
    wire::peer_entry entry;
    conn_ptr conn; // null while the rank is disconnected
  };

  explicit impl(coordinator_options o)
    : opts(std::move(o)), job_config(opts.job_config),
      job_digest(job_config.empty() ? 0 : config_digest(job_config)) {}

  coordinator_options opts;
  // Declared first so it is destroyed last: sockets must go before it.
  asio::io_context ioc;
  tcp::acceptor acceptor{ioc};
  asio::steady_timer accept_retry{ioc};
  std::thread thread;
  uint16_t bound_port = 0;
  bool started = false; // callers' thread

  // I/O thread only.
  std::set<conn_ptr> conns;
  parked_map waiting;
  bool stopping = false;
  bool table_sent = false;
  std::optional<wire::shutdown> shutdown_sent; // I/O thread: the job is over
  uint64_t epoch = 0;
  config_list job_config; // the job's (opts.job_config, or the first worker's)
  uint64_t job_digest = 0;

  // Shared with callers' threads.
  mutable std::mutex mu;
  std::condition_variable reports_cv;
  std::map<uint32_t, rank_state> ranks; // sorted, as the peer table wants
  std::deque<wire::report> reports;
  uint64_t first_report_seq = 0; // arrival number of reports.front()
  std::function<void(const worker_event&)> on_event;

  // The KV store, shared with callers' threads (kv_peek, kv_drop_prefix).
  mutable std::mutex kv_mu;
  std::map<std::string, wire::bytes> kv; // ordered: prefixes are ranges
  std::atomic<uint64_t> kv_dropped{0};
  std::atomic<size_t> kv_parked{0}; // waiting.size(), for callers' threads

  caf::error start();
  caf::error bind(tcp::endpoint ep);
  void run_io();
  void shut_down();

  void accept_next();
  void on_accept(const error_code& ec, tcp::socket s);
  void read_length(const conn_ptr& c);
  void read_frame(const conn_ptr& c);
  void on_read_error(const conn_ptr& c, const error_code& ec);
  void on_frame(const conn_ptr& c);
  caf::error dispatch(const conn_ptr& c, const wire::frame_view& v);

  void on_register(const conn_ptr& c, const wire::register_worker& m);
  std::string registration_problem(const conn_ptr& c, const wire::register_worker& m) const;
  std::string config_problem(const wire::register_worker& m) const;
  void adopt_config(const wire::register_worker& m);
  size_t live_ranks() const;
  void publish_table();
  void on_report(const conn_ptr& c, const wire::report& r);
  void on_disconnect(const conn_ptr& c);
  void emit(const worker_event& ev);

  void on_kv_put(const conn_ptr& c, wire::kv_put m);
  void on_kv_get(const conn_ptr& c, wire::kv_get m);
  void drop_prefix(const std::string& prefix);
  void park(const conn_ptr& c, const wire::kv_get& m, int64_t wait_ms);
  conn_ptr finish(parked_ptr p); // by value: callers pass map and set elements
  void cancel_parked(const conn_ptr& c);

  template <class T>
  void send(const conn_ptr& c, const T& msg, uint64_t frame_epoch = 0) {
    send_packet(c, make_packet(header(wire::no_process, c->rank.value_or(wire::no_process),
                                      frame_epoch),
                               msg));
  }
  void send_packet(const conn_ptr& c, packet p);
  void write_next(const conn_ptr& c);
  void close_after_flush(const conn_ptr& c);
  void close(const conn_ptr& c);
};

caf::error coordinator::impl::start() {
  if (started)
    return make_error(errc::invalid_argument, "coordinator already started");
  error_code ec;
  auto addr = asio::ip::make_address(opts.bind_host, ec);
  if (ec) {
    // A host name: resolving it once at start-up may block briefly.
    tcp::resolver resolver(ioc);
    auto found = resolver.resolve(opts.bind_host, std::to_string(opts.port), ec);
    if (ec || found.empty())
      return make_error(errc::unreachable, "cannot resolve coordinator bind host "
                                             + opts.bind_host + ": " + ec.message());
    addr = found.begin()->endpoint().address();
  }
  if (auto err = bind(tcp::endpoint(addr, opts.port)))
    return err;
  started = true;
  accept_next();
  thread = std::thread([this] { run_io(); });
  spdlog::info("coordinator: listening on {}:{} for {} workers", opts.bind_host, bound_port,
               opts.world_size);
  return {};
}

caf::error coordinator::impl::bind(tcp::endpoint ep) {
  error_code ec;
  acceptor.open(ep.protocol(), ec);
  if (!ec)
    acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec)
    acceptor.bind(ep, ec);
  if (!ec)
    acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (!ec)
    bound_port = acceptor.local_endpoint(ec).port();
  if (ec) {
    error_code ignored;
    acceptor.close(ignored);
    return make_error(errc::unreachable, "cannot listen on " + opts.bind_host + ":"
                                           + std::to_string(opts.port) + ": " + ec.message());
  }
  return {};
}

void coordinator::impl::run_io() {
  // Handlers do not throw, but a bug must not take the process down with an
  // exception escaping a thread: log it and keep serving.
  for (;;) {
    try {
      ioc.run();
      return;
    } catch (const std::exception& e) {
      spdlog::error("coordinator: I/O handler threw: {}", e.what());
    } catch (...) {
      spdlog::error("coordinator: I/O handler threw an unknown exception");
    }
  }
}

void coordinator::impl::shut_down() {
  if (stopping)
    return;
  stopping = true;
  error_code ignored;
  acceptor.close(ignored);
  accept_retry.cancel();
  // Waiting kv_gets end without an answer: their connections close below.
  while (!waiting.empty())
    finish(waiting.begin()->second);
  // Once every operation completes, ioc.run() returns and the thread ends.
  for (auto& c : std::vector<conn_ptr>(conns.begin(), conns.end()))
    close_after_flush(c);
}

void coordinator::impl::accept_next() {
  acceptor.async_accept(
    [this](const error_code& ec, tcp::socket s) { on_accept(ec, std::move(s)); });
}

void coordinator::impl::on_accept(const error_code& ec, tcp::socket s) {
  if (stopping || ec == asio::error::operation_aborted)
    return;
  if (ec) {
    spdlog::warn("coordinator: accept failed: {}", ec.message());
    accept_retry.expires_after(accept_retry_interval);
    accept_retry.async_wait([this](const error_code& e) {
      if (!e && !stopping)
        accept_next();
    });
    return;
  }
  error_code ignored;
  s.set_option(tcp::no_delay(true), ignored);
  auto c = std::make_shared<connection>(std::move(s));
  conns.insert(c);
  read_length(c);
  accept_next();
}

void coordinator::impl::read_length(const conn_ptr& c) {
  if (c->closed || c->closing)
    return;
  asio::async_read(c->sock, asio::buffer(c->length), [this, c](const error_code& ec, size_t) {
    if (ec)
      return on_read_error(c, ec);
    size_t n = decode_length(c->length);
    if (n > opts.frame_bytes_max) {
      wire::note_reject(oversized_frame(n, opts.frame_bytes_max), "coordinator");
      return close(c);
    }
    c->frame.resize(n);
    read_frame(c);
  });
}

void coordinator::impl::read_frame(const conn_ptr& c) {
  asio::async_read(c->sock, asio::buffer(c->frame), [this, c](const error_code& ec, size_t) {
    if (ec)
      return on_read_error(c, ec);
    on_frame(c);
  });
}

void coordinator::impl::on_read_error(const conn_ptr& c, const error_code& ec) {
  if (!c->closed && !is_disconnect(ec))
    spdlog::warn("coordinator: read from {} failed: {}", c->peer, ec.message());
  close(c);
}

void coordinator::impl::on_frame(const conn_ptr& c) {
  if (c->closed || c->closing)
    return; // stopping: nothing new is accepted
  auto view = wire::decode_frame(c->frame);
  auto err = view ? dispatch(c, *view) : view.error();
  if (err) {
    // A peer that sends one bad frame cannot be trusted to be in sync with
    // the stream any more: drop it, keep serving everyone else.
    wire::note_reject(err, "coordinator");
    return close(c);
  }
  read_length(c);
}

caf::error coordinator::impl::dispatch(const conn_ptr& c, const wire::frame_view& v) {
  switch (v.header.kind) {
    case wire::register_worker::kind: {
      auto m = wire::decode_body<wire::register_worker>(v.body);
      if (!m)
        return m.error();
      on_register(c, *m);
      return {};
    }
    case wire::report::kind: {
      auto m = wire::decode_body<wire::report>(v.body);
      if (!m)
        return m.error();
      on_report(c, *m);
      return {};
    }
    case wire::kv_put::kind: {
      auto m = wire::decode_body<wire::kv_put>(v.body);
      if (!m)
        return m.error();
      on_kv_put(c, std::move(*m));
      return {};
    }
    case wire::kv_get::kind: {
      auto m = wire::decode_body<wire::kv_get>(v.body);
      if (!m)
        return m.error();
      on_kv_get(c, std::move(*m));
      return {};
    }
    case wire::kv_drop::kind: {
      auto m = wire::decode_body<wire::kv_drop>(v.body);
      if (!m)
        return m.error();
      drop_prefix(m->prefix);
      return {};
    }
    case wire::worker_status::kind: {
      auto m = wire::decode_body<wire::worker_status>(v.body);
      if (!m)
        return m.error();
      if (!c->rank) {
        spdlog::warn("coordinator: dropped a status from unregistered {}", c->peer);
        return {};
      }
      worker_event ev{worker_event::type::status, *c->rank, {}, *m, m->incarnation};
      emit(ev);
      return {};
    }
    case wire::replica_divergence::kind: {
      auto m = wire::decode_body<wire::replica_divergence>(v.body);
      if (!m)
        return m.error();
      if (!c->rank) {
        spdlog::warn("coordinator: dropped a divergence report from unregistered {}", c->peer);
        return {};
      }
      worker_event ev{worker_event::type::divergence, *c->rank, {}, {}, m->incarnation};
      ev.divergence = std::move(*m);
      emit(ev);
      return {};
    }
    default: {
      const char* name = wire::kind_name(v.header.kind);
      return make_error(errc::unknown_kind, std::string(name ? name : "unknown kind")
                                              + " is not a message for the coordinator");
    }
  }
}

void coordinator::impl::on_register(const conn_ptr& c, const wire::register_worker& m) {
  if (shutdown_sent) {
    // A worker (re)started after the job ended: it has nothing to do.
    spdlog::info("coordinator: rank {} registered after the shutdown; telling it", m.rank);
    return send(c, *shutdown_sent);
  }
  std::string problem;
  size_t live = 0;
  {
    std::lock_guard lk(mu);
    problem = registration_problem(c, m);
    if (problem.empty()) {
      c->rank = m.rank;
      ranks[m.rank] = rank_state{{m.rank, m.incarnation, m.pid, m.host, m.ucx_address}, c};
      live = live_ranks();
    }
  }
  if (problem.empty() && job_config.empty() && !m.config.empty())
    adopt_config(m);
  if (!problem.empty()) {
    spdlog::warn("coordinator: rejected registration from {}: {}", c->peer, problem);
    return send(c, wire::rejected{problem});
  }
  spdlog::info("coordinator: rank {} registered from {} (host {}, pid {}, incarnation {}); {}/{} live",
               m.rank, c->peer, m.host, m.pid, m.incarnation, live, opts.world_size);
  emit(worker_event{worker_event::type::registered, m.rank, {}, {}, m.incarnation});
  if (table_sent || live == opts.world_size)
    publish_table();
}

/// Why a registration is refused, or empty. Called with `mu` held.
std::string coordinator::impl::registration_problem(const conn_ptr& c,
                                                    const wire::register_worker& m) const {
  if (c->rank)
    return "this connection already registered rank " + std::to_string(*c->rank);
  if (m.rank >= opts.world_size)
    return "rank " + std::to_string(m.rank) + " is outside world size "
           + std::to_string(opts.world_size);
  if (m.world_size != opts.world_size)
    return "world size " + std::to_string(m.world_size) + " differs from the coordinator's "
           + std::to_string(opts.world_size);
  if (auto why = config_problem(m); !why.empty())
    return why;
  auto it = ranks.find(m.rank);
  if (it == ranks.end())
    return {};
  if (it->second.conn)
    return "rank " + std::to_string(m.rank) + " is already registered (pid "
           + std::to_string(it->second.entry.pid) + ")";
  // An older incarnation is a stale process that outlived its replacement.
  if (m.incarnation < it->second.entry.incarnation)
    return "rank " + std::to_string(m.rank) + " incarnation " + std::to_string(m.incarnation)
           + " is older than the registered " + std::to_string(it->second.entry.incarnation);
  return {};
}

/// Why a worker's configuration is not the job's, or empty: one line that
/// names every key that differs, with the worker's value and the job's.
std::string coordinator::impl::config_problem(const wire::register_worker& m) const {
  if (m.config.empty())
    return {}; // a job without a training configuration: nothing to compare
  std::vector<std::string> diffs;
  std::string what = "configuration mismatch with the job";
  if (job_config.empty()) {
    // This worker's configuration would become the job's: only what the
    // coordinator fixed itself (its version, the layout it supervises)
    // must agree.
    config_list pinned_keys;
    for (const auto& e : m.config)
      for (const auto& p : opts.config_pinned)
        if (e.first == p.first)
          pinned_keys.push_back(e);
    diffs = config_differences(opts.config_pinned, pinned_keys);
    what = "configuration mismatch with the coordinator (give it the workers' --config and "
           "job flags)";
  } else if (m.config_digest != job_digest) {
    diffs = config_differences(job_config, m.config);
    if (diffs.empty()) // the same pairs: the digest itself is wrong
      diffs.push_back(fmt::format("digest {:016x} (the job's: {:016x})", m.config_digest,
                                  job_digest));
  }
  if (diffs.empty())
    return {};
  std::string out = what + ": ";
  for (size_t i = 0; i < diffs.size(); ++i)
    out += (i ? "; " : "") + diffs[i];
  return out;
}

/// The first training worker's configuration becomes the job's (the
/// coordinator was given none). I/O thread.
void coordinator::impl::adopt_config(const wire::register_worker& m) {
  job_config = m.config;
  job_digest = config_digest(job_config);
  spdlog::info("coordinator: the job's configuration (digest {:016x}) is rank {}'s (host {}, "
               "pid {}): the coordinator was given none; workers that differ are refused",
               job_digest, m.rank, m.host, m.pid);
}

/// Ranks with a live connection. Called with `mu` held.
size_t coordinator::impl::live_ranks() const {
  size_t n = 0;
  for (auto& [rank, st] : ranks)
    n += st.conn ? 1 : 0;
  return n;
}

void coordinator::impl::publish_table() {
  // Epoch 1 is the first complete table; each later change (a rank that came
  // back) gets a new epoch so workers can tell tables apart.
  epoch = table_sent ? epoch + 1 : 1;
  table_sent = true;
  wire::peer_table table;
  table.epoch = epoch;
  table.world_size = opts.world_size;
  std::vector<conn_ptr> live;
  {
    std::lock_guard lk(mu);
    for (auto& [rank, st] : ranks) {
      table.peers.push_back(st.entry);
      if (st.conn)
        live.push_back(st.conn);
    }
  }
  spdlog::info("coordinator: peer table epoch {} ({} peers) to {} workers", epoch,
               table.peers.size(), live.size());
  for (auto& c : live)
    send(c, table, epoch);
}

void coordinator::impl::on_report(const conn_ptr& c, const wire::report& r) {
  if (!c->rank) {
    spdlog::warn("coordinator: dropped a report from unregistered {}", c->peer);
    return;
  }
  {
    std::lock_guard lk(mu);
    reports.push_back(r);
    while (reports.size() > opts.reports_max) {
      reports.pop_front();
      ++first_report_seq;
    }
  }
  reports_cv.notify_all();
  emit(worker_event{worker_event::type::report, *c->rank, r, {}, 0});
}

void coordinator::impl::on_disconnect(const conn_ptr& c) {
  uint32_t rank = *c->rank;
  uint64_t incarnation = 0;
  {
    std::lock_guard lk(mu);
    auto it = ranks.find(rank);
    if (it == ranks.end() || it->second.conn != c)
      return;
    it->second.conn = nullptr;
    incarnation = it->second.entry.incarnation;
  }
  if (stopping)
    spdlog::info("coordinator: closed the connection of rank {}", rank);
  else if (shutdown_sent) // the job is over: leaving is what it was told to do
    spdlog::info("coordinator: rank {} left after the shutdown ({})", rank, c->peer);
  else
    spdlog::warn("coordinator: rank {} disconnected ({})", rank, c->peer);
  emit(worker_event{worker_event::type::disconnected, rank, {}, {}, incarnation});
}

void coordinator::impl::emit(const worker_event& ev) {
  std::function<void(const worker_event&)> f;
  {
    std::lock_guard lk(mu);
    f = on_event;
  }
  if (!f)
    return;
  // The callback is the caller's code: it must not take the I/O thread down.
  try {
    f(ev);
  } catch (const std::exception& e) {
    spdlog::error("coordinator: on_event callback threw: {}", e.what());
  } catch (...) {
    spdlog::error("coordinator: on_event callback threw an unknown exception");
  }
}

// -- the KV store (I/O thread, except what kv_mu guards) -------------------------

void coordinator::impl::on_kv_put(const conn_ptr& c, wire::kv_put m) {
  std::string problem;
  {
    std::lock_guard lk(kv_mu);
    if (m.value.size() > opts.kv_value_bytes_max)
      problem = "value of " + std::to_string(m.value.size()) + " bytes exceeds the limit of "
                + std::to_string(opts.kv_value_bytes_max);
    else if (kv.size() >= opts.kv_keys_max && !kv.contains(m.key))
      problem = "the store is full (" + std::to_string(opts.kv_keys_max) + " keys)";
    else
      kv.insert_or_assign(m.key, m.value);
  }
  if (!problem.empty()) {
    // Log the first few and then every power of two: a flood cannot drown the log.
    auto n = ++kv_dropped;
    if (n <= 10 || (n & (n - 1)) == 0)
      spdlog::warn("coordinator: dropped kv_put of \"{}\" from {} ({} dropped so far): {}",
                   m.key, c->peer, n, problem);
    return;
  }
  // Answer every kv_get waiting for this key. finish() before send(): a send
  // may close a connection, which finishes that connection's other gets.
  auto [first, last] = waiting.equal_range(m.key);
  std::vector<parked_ptr> ready;
  for (auto it = first; it != last; ++it)
    ready.push_back(it->second);
  for (auto& p : ready)
    if (auto to = finish(p))
      send(to, wire::kv_value{p->request_id, m.key, true, m.value});
}

void coordinator::impl::on_kv_get(const conn_ptr& c, wire::kv_get m) {
  auto wait_ms = std::clamp<int64_t>(m.wait_ms, 0, kv_wait_ms_max);
  std::optional<wire::bytes> value;
  {
    std::lock_guard lk(kv_mu);
    if (auto it = kv.find(m.key); it != kv.end())
      value = it->second;
  }
  if (value)
    return send(c, wire::kv_value{m.request_id, std::move(m.key), true, std::move(*value)});
  if (wait_ms > 0 && c->parked.size() < opts.kv_waits_max)
    return park(c, m, wait_ms);
  if (wait_ms > 0)
    spdlog::debug("coordinator: {} has {} kv_gets waiting; \"{}\" is answered at once",
                  c->peer, c->parked.size(), m.key);
  send(c, wire::kv_value{m.request_id, std::move(m.key), false, {}});
}

void coordinator::impl::park(const conn_ptr& c, const wire::kv_get& m, int64_t wait_ms) {
  auto p = std::make_shared<parked_get>(ioc);
  p->conn = c;
  p->request_id = m.request_id;
  p->key = m.key;
  p->at = waiting.emplace(m.key, p);
  c->parked.insert(p);
  kv_parked = waiting.size();
  p->timer.expires_after(std::chrono::milliseconds(wait_ms));
  p->timer.async_wait([this, p](const error_code& ec) {
    // A timer cancelled after it expired still runs with success: the
    // get is finished then, and finish() says so.
    if (ec)
      return;
    if (auto to = finish(p))
      send(to, wire::kv_value{p->request_id, p->key, false, {}});
  });
}

/// Takes a waiting get out of every index; its connection, or null when it
/// was finished already.
auto coordinator::impl::finish(parked_ptr p) -> conn_ptr {
  if (!p->conn)
    return nullptr;
  auto c = std::move(p->conn);
  p->conn = nullptr;
  waiting.erase(p->at);
  kv_parked = waiting.size();
  c->parked.erase(p);
  p->timer.cancel();
  return c;
}

void coordinator::impl::cancel_parked(const conn_ptr& c) {
  while (!c->parked.empty())
    finish(*c->parked.begin());
}

void coordinator::impl::drop_prefix(const std::string& prefix) {
  std::lock_guard lk(kv_mu);
  auto it = kv.lower_bound(prefix);
  while (it != kv.end() && it->first.starts_with(prefix))
    it = kv.erase(it);
}

void coordinator::impl::send_packet(const conn_ptr& c, packet p) {
  if (c->closed)
    return;
  if (c->out.size() >= write_queue_max) {
    spdlog::warn("coordinator: {} does not read its frames ({} queued); closing it", c->peer,
                 c->out.size());
    return close(c);
  }
  c->out.push_back(std::move(p));
  if (c->out.size() == 1)
    write_next(c);
}

void coordinator::impl::write_next(const conn_ptr& c) {
  asio::async_write(c->sock, asio::buffer(c->out.front()), [this, c](const error_code& ec, size_t) {
    if (c->closed)
      return;
    if (ec) {
      if (!is_disconnect(ec))
        spdlog::warn("coordinator: write to {} failed: {}", c->peer, ec.message());
      return close(c);
    }
    c->out.pop_front();
    if (!c->out.empty())
      write_next(c);
    else if (c->closing)
      close(c);
  });
}

void coordinator::impl::close_after_flush(const conn_ptr& c) {
  if (c->closed)
    return;
  c->closing = true;
  if (c->out.empty())
    return close(c);
  // Let queued frames (a broadcast shutdown) go out, but not forever.
  c->linger.expires_after(close_linger);
  c->linger.async_wait([this, c](const error_code& ec) {
    if (!ec)
      close(c);
  });
}

void coordinator::impl::close(const conn_ptr& c) {
  if (c->closed)
    return;
  c->closed = true;
  error_code ignored;
  c->sock.shutdown(tcp::socket::shutdown_both, ignored);
  c->sock.close(ignored);
  c->linger.cancel();
  cancel_parked(c);
  conns.erase(c);
  if (c->rank)
    on_disconnect(c);
}

coordinator::coordinator(coordinator_options opts)
  : impl_(std::make_unique<impl>(std::move(opts))) {}

coordinator::~coordinator() {
  stop();
}

caf::error coordinator::start() {
  return impl_->start();
}

uint16_t coordinator::port() const {
  return impl_->bound_port;
}

std::optional<wire::report>
coordinator::wait_report(const std::function<bool(const wire::report&)>& pred,
                         std::chrono::milliseconds timeout) {
  auto deadline = clock_type::now() + timeout;
  auto& s = *impl_;
  // `pred` runs under the lock: it sees a stable deque and must not call
  // back into the coordinator.
  std::unique_lock lk(s.mu);
  uint64_t next = s.first_report_seq; // arrival number of the next report to test
  for (;;) {
    next = std::max(next, s.first_report_seq);
    for (; next < s.first_report_seq + s.reports.size(); ++next)
      if (const auto& r = s.reports[next - s.first_report_seq]; pred(r))
        return r;
    if (clock_type::now() >= deadline)
      return std::nullopt;
    s.reports_cv.wait_until(lk, deadline);
  }
}

std::vector<wire::report> coordinator::reports() const {
  std::lock_guard lk(impl_->mu);
  return {impl_->reports.begin(), impl_->reports.end()};
}

std::vector<uint32_t> coordinator::registered() const {
  std::lock_guard lk(impl_->mu);
  std::vector<uint32_t> out;
  for (auto& [rank, st] : impl_->ranks)
    out.push_back(rank);
  return out;
}

std::vector<uint32_t> coordinator::disconnected() const {
  std::lock_guard lk(impl_->mu);
  std::vector<uint32_t> out;
  for (auto& [rank, st] : impl_->ranks)
    if (!st.conn)
      out.push_back(rank);
  return out;
}

void coordinator::broadcast_shutdown(int32_t exit_code, const std::string& reason) {
  auto* s = impl_.get();
  asio::post(s->ioc, [s, msg = wire::shutdown{exit_code, reason}] {
    spdlog::info("coordinator: shutdown (exit code {}: {}) to {} connections", msg.exit_code,
                 msg.reason, s->conns.size());
    s->shutdown_sent = msg; // late registrations are told too
    for (auto& c : std::vector<impl::conn_ptr>(s->conns.begin(), s->conns.end()))
      s->send(c, msg);
  });
}

void coordinator::send_control(std::optional<uint32_t> rank, const control_message& m) {
  auto* s = impl_.get();
  asio::post(s->ioc, [s, rank, m] {
    std::vector<impl::conn_ptr> to;
    {
      std::lock_guard lk(s->mu);
      for (auto& [r, st] : s->ranks)
        if (st.conn && (!rank || r == *rank))
          to.push_back(st.conn);
    }
    for (auto& c : to)
      std::visit([&](const auto& msg) { s->send(c, msg); }, m);
  });
}

void coordinator::on_event(std::function<void(const worker_event&)> f) {
  std::lock_guard lk(impl_->mu);
  impl_->on_event = std::move(f);
}

void coordinator::kv_drop_prefix(const std::string& prefix) {
  impl_->drop_prefix(prefix);
}

std::optional<wire::bytes> coordinator::kv_peek(const std::string& key) const {
  std::lock_guard lk(impl_->kv_mu);
  auto it = impl_->kv.find(key);
  if (it == impl_->kv.end())
    return std::nullopt;
  return it->second;
}

size_t coordinator::kv_size() const {
  std::lock_guard lk(impl_->kv_mu);
  return impl_->kv.size();
}

uint64_t coordinator::kv_puts_dropped() const {
  return impl_->kv_dropped.load();
}

size_t coordinator::kv_waiting() const {
  return impl_->kv_parked.load();
}

void coordinator::stop() {
  auto& s = *impl_;
  if (!s.thread.joinable())
    return;
  auto* p = impl_.get();
  asio::post(s.ioc, [p] { p->shut_down(); });
  // From an on_event callback the I/O thread cannot join itself; the
  // destructor, on the owner's thread, joins it later.
  if (std::this_thread::get_id() == s.thread.get_id())
    return;
  s.thread.join();
}

// -- coordinator_client --------------------------------------------------------

struct coordinator_client::impl {
  /// One frame a caller queued; `done` and `ec` are guarded by `mu`.
  struct write_op {
    packet bytes;
    bool done = false;
    error_code ec;
  };
  using write_ptr = std::shared_ptr<write_op>;
  using answer = std::variant<wire::peer_table, wire::rejected>;

  ~impl();

  // Declared first so it is destroyed last: the socket must go before it.
  asio::io_context ioc;
  tcp::socket sock{ioc};
  std::string where;                         // "host:port", set by connect()
  std::atomic<uint32_t> rank{wire::no_process}; // src of our frames

  // Connecting (caller's thread, before the I/O thread exists).
  template <class Pred>
  bool run_until(Pred done, clock_type::time_point deadline);
  caf::error connect(const host_port& hp, clock_type::time_point deadline);
  error_code resolve(const host_port& hp, clock_type::time_point deadline,
                     std::vector<tcp::endpoint>& out);
  error_code try_connect(const std::vector<tcp::endpoint>& eps, clock_type::time_point deadline);

  // The I/O thread and what only it touches.
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::thread io;
  std::array<uint8_t, length_bytes> length{};
  std::vector<uint8_t> frame;
  std::deque<write_ptr> writes; // front is being written
  bool broken = false;          // the socket is closed

  void start_io();
  void run_io();
  void read_length();
  caf::error deliver(std::span<const uint8_t> bytes);
  void start_write(const write_ptr& op);
  void write_next();
  void complete(const write_ptr& op, const error_code& ec);
  void fail(caf::error e);
  void fail_io(const error_code& ec);

  // Shared between the I/O thread and callers.
  mutable std::mutex mu;
  std::condition_variable cv;
  caf::error failure;                          // set once the connection is unusable
  std::deque<answer> answers;                  // for register_and_wait, oldest first
  std::optional<wire::peer_table> table;       // the latest one
  std::optional<wire::shutdown> shutdown_seen; // kept for wait_shutdown()
  uint64_t next_request = 1;
  std::map<uint64_t, std::optional<wire::kv_value>> kv_waiters; // by request id
  std::function<void(const control_message&)> on_control;       // guarded by control_mu
  std::deque<control_message> control_backlog;                   // before a handler was set
  std::mutex control_mu; // held while the handler runs, so it is never replaced mid-call

  // Callers' threads.
  caf::error send(packet p);
  caf::error explain(caf::error e, const char* awaited, std::chrono::milliseconds timeout) const;
  expected<wire::bytes> kv_get(const std::string& key, std::chrono::milliseconds timeout);
};

coordinator_client::impl::~impl() {
  if (!io.joinable())
    return;
  work.reset();
  ioc.stop();
  io.join();
  // Handlers still queued are destroyed with the io_context; none runs.
}

/// Runs handlers until `done()` or the deadline; false on the deadline.
/// Only while connecting: afterwards the I/O thread runs `ioc`.
template <class Pred>
bool coordinator_client::impl::run_until(Pred done, clock_type::time_point deadline) {
  while (!done()) {
    auto now = clock_type::now();
    if (now >= deadline)
      return false;
    if (ioc.stopped())
      ioc.restart();
    // Nothing outstanding and still not done: waiting cannot help.
    if (ioc.run_one_for(deadline - now) == 0 && ioc.stopped())
      return done();
  }
  return true;
}

caf::error coordinator_client::impl::connect(const host_port& hp,
                                             clock_type::time_point deadline) {
  where = hp.to_string();
  auto unreachable = [&](const std::string& why) {
    return make_error(errc::unreachable, "cannot reach coordinator at " + where + ": " + why);
  };
  std::vector<tcp::endpoint> eps;
  if (auto ec = resolve(hp, deadline, eps))
    return unreachable(ec.message());
  // The coordinator may not listen yet (workers start beside it): retry.
  for (;;) {
    auto ec = try_connect(eps, deadline);
    if (!ec) {
      error_code ignored;
      sock.set_option(tcp::no_delay(true), ignored);
      return {};
    }
    if (deadline - clock_type::now() <= connect_retry_interval)
      return unreachable(ec.message());
    std::this_thread::sleep_for(connect_retry_interval);
  }
}

error_code coordinator_client::impl::resolve(const host_port& hp, clock_type::time_point deadline,
                                             std::vector<tcp::endpoint>& out) {
  error_code ec;
  auto addr = asio::ip::make_address(hp.host, ec);
  if (!ec) {
    out = {tcp::endpoint(addr, hp.port)};
    return {};
  }
  auto st = std::make_shared<op_state>();
  auto found = std::make_shared<std::vector<tcp::endpoint>>();
  tcp::resolver resolver(ioc); // cancels on destruction; the handler holds only `st`
  resolver.async_resolve(hp.host, std::to_string(hp.port),
                         [st, found](const error_code& e, tcp::resolver::results_type r) {
                           st->ec = e;
                           st->done = true;
                           for (auto& entry : r)
                             found->push_back(entry.endpoint());
                         });
  if (!run_until([&] { return st->done; }, deadline))
    return asio::error::timed_out;
  if (!st->ec && found->empty())
    return asio::error::host_not_found;
  out = *found;
  return st->ec;
}

error_code coordinator_client::impl::try_connect(const std::vector<tcp::endpoint>& eps,
                                                 clock_type::time_point deadline) {
  error_code ignored;
  sock.close(ignored);
  auto st = std::make_shared<op_state>();
  asio::async_connect(sock, eps, [st](const error_code& ec, const tcp::endpoint&) {
    st->ec = ec;
    st->done = true;
  });
  if (run_until([&] { return st->done; }, deadline))
    return st->ec;
  sock.close(ignored); // the attempt completes with operation_aborted
  run_until([&] { return st->done; }, clock_type::now() + cancel_drain);
  return asio::error::timed_out;
}

// -- the client's I/O thread ---------------------------------------------------

void coordinator_client::impl::start_io() {
  work.emplace(ioc.get_executor());
  ioc.restart(); // run_one_for may have left it stopped
  asio::post(ioc, [this] { read_length(); });
  io = std::thread([this] { run_io(); });
}

void coordinator_client::impl::run_io() {
  // Handlers do not throw; should one, the connection is unusable (a half
  // handled frame), so fail it rather than take the process down.
  for (;;) {
    try {
      ioc.run();
      return;
    } catch (const std::exception& e) {
      spdlog::error("coordinator client: I/O handler threw: {}", e.what());
      fail(make_error(errc::closed, std::string("internal error: ") + e.what()));
    } catch (...) {
      spdlog::error("coordinator client: I/O handler threw an unknown exception");
      fail(make_error(errc::closed, "internal error"));
    }
  }
}

void coordinator_client::impl::read_length() {
  asio::async_read(sock, asio::buffer(length), [this](const error_code& ec, size_t) {
    if (ec)
      return fail_io(ec);
    size_t n = decode_length(length);
    if (n > client_frame_bytes_max) {
      auto err = oversized_frame(n, client_frame_bytes_max);
      wire::note_reject(err, "coordinator");
      return fail(err);
    }
    frame.resize(n);
    asio::async_read(sock, asio::buffer(frame), [this](const error_code& e, size_t) {
      if (e)
        return fail_io(e);
      if (auto err = deliver(frame)) {
        // The stream cannot be trusted past a bad frame.
        wire::note_reject(err, "coordinator");
        return fail(err);
      }
      read_length();
    });
  });
}

/// Files one frame where its waiter finds it.
caf::error coordinator_client::impl::deliver(std::span<const uint8_t> bytes) {
  auto v = wire::decode_frame(bytes);
  if (!v)
    return v.error();
  switch (v->header.kind) {
    case wire::peer_table::kind: {
      auto m = wire::decode_body<wire::peer_table>(v->body);
      if (!m)
        return m.error();
      std::lock_guard lk(mu);
      table = *m;
      answers.emplace_back(std::move(*m));
      if (answers.size() > client_answers_max)
        answers.pop_front();
      break;
    }
    case wire::rejected::kind: {
      auto m = wire::decode_body<wire::rejected>(v->body);
      if (!m)
        return m.error();
      std::lock_guard lk(mu);
      answers.emplace_back(std::move(*m));
      if (answers.size() > client_answers_max)
        answers.pop_front();
      break;
    }
    case wire::shutdown::kind: {
      auto m = wire::decode_body<wire::shutdown>(v->body);
      if (!m)
        return m.error();
      std::lock_guard lk(mu);
      shutdown_seen = std::move(*m);
      break;
    }
    case wire::kv_value::kind: {
      auto m = wire::decode_body<wire::kv_value>(v->body);
      if (!m)
        return m.error();
      std::lock_guard lk(mu);
      // No waiter: it gave up before the answer came; drop it.
      if (auto it = kv_waiters.find(m->request_id); it != kv_waiters.end() && !it->second)
        it->second = std::move(*m);
      break;
    }
    case wire::epoch_notice::kind:
    case wire::catchup_assign::kind: {
      control_message msg;
      if (v->header.kind == wire::epoch_notice::kind) {
        auto m = wire::decode_body<wire::epoch_notice>(v->body);
        if (!m)
          return m.error();
        msg = std::move(*m);
      } else {
        auto m = wire::decode_body<wire::catchup_assign>(v->body);
        if (!m)
          return m.error();
        msg = std::move(*m);
      }
      std::lock_guard lk(control_mu);
      if (on_control) {
        on_control(msg);
      } else {
        control_backlog.push_back(std::move(msg));
        if (control_backlog.size() > client_control_backlog_max)
          control_backlog.pop_front();
      }
      return {};
    }
    default:
      return {}; // a kind a client has no use for
  }
  cv.notify_all();
  return {};
}

void coordinator_client::impl::start_write(const write_ptr& op) {
  if (broken)
    return complete(op, asio::error::not_connected);
  writes.push_back(op);
  if (writes.size() == 1)
    write_next();
}

void coordinator_client::impl::write_next() {
  asio::async_write(sock, asio::buffer(writes.front()->bytes), [this](const error_code& ec, size_t) {
    if (ec) {
      // The frame may be half on the wire: nothing queued can follow it.
      auto failed = std::move(writes);
      writes.clear();
      for (auto& op : failed)
        complete(op, ec);
      return fail_io(ec);
    }
    auto op = std::move(writes.front());
    writes.pop_front();
    complete(op, {});
    if (!writes.empty())
      write_next();
  });
}

void coordinator_client::impl::complete(const write_ptr& op, const error_code& ec) {
  {
    std::lock_guard lk(mu);
    op->done = true;
    op->ec = ec;
  }
  cv.notify_all();
}

void coordinator_client::impl::fail(caf::error e) {
  {
    std::lock_guard lk(mu);
    if (!failure)
      failure = std::move(e);
  }
  cv.notify_all();
  broken = true;
  error_code ignored;
  sock.close(ignored); // pending reads and writes complete with operation_aborted
}

void coordinator_client::impl::fail_io(const error_code& ec) {
  if (ec == asio::error::eof)
    fail(make_error(errc::closed, "the coordinator at " + where + " closed the connection"));
  else
    fail(make_error(errc::closed, "lost the connection to the coordinator at " + where + ": "
                                    + ec.message()));
}

// -- callers' side -------------------------------------------------------------

/// Queues a frame and waits until it is written.
caf::error coordinator_client::impl::send(packet p) {
  {
    std::lock_guard lk(mu);
    if (failure)
      return failure;
  }
  auto op = std::make_shared<write_op>();
  op->bytes = std::move(p);
  asio::post(ioc, [this, op] { start_write(op); });
  std::unique_lock lk(mu);
  if (!cv.wait_until(lk, clock_type::now() + client_write_timeout, [&] { return op->done; })) {
    lk.unlock();
    // Half a frame may be on the wire: the stream is unusable from here on.
    auto why = make_error(errc::closed, "a write to the coordinator at " + where + " timed out");
    asio::post(ioc, [this, why] { fail(why); });
    return make_error(errc::timeout, "cannot write to the coordinator at " + where);
  }
  if (!op->ec)
    return {};
  if (failure)
    return failure;
  return make_error(errc::closed, "cannot write to the coordinator at " + where + ": "
                                    + op->ec.message());
}

/// Gives a bare timeout its meaning for the caller.
caf::error coordinator_client::impl::explain(caf::error e, const char* awaited,
                                             std::chrono::milliseconds timeout) const {
  if (code_of(e) != errc::timeout)
    return e;
  return make_error(errc::timeout, std::string("no ") + awaited + " from the coordinator at "
                                     + where + " within " + std::to_string(timeout.count())
                                     + " ms");
}

expected<wire::bytes> coordinator_client::impl::kv_get(const std::string& key,
                                                       std::chrono::milliseconds timeout) {
  auto deadline = deadline_after(timeout);
  auto not_found = [&](const std::string& why) {
    return make_error(errc::timeout, "key \"" + key + "\" " + why + " at the coordinator at "
                                       + where + " within " + std::to_string(timeout.count())
                                       + " ms");
  };
  // The coordinator waits at most kv_wait_ms_max per request: ask again
  // until our own deadline.
  for (;;) {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock_type::now());
    auto wait_ms = std::clamp<int64_t>(left.count(), 0, kv_wait_ms_max);
    uint64_t id = 0;
    {
      std::lock_guard lk(mu);
      if (failure)
        return failure;
      id = next_request++;
      kv_waiters.emplace(id, std::nullopt);
    }
    auto forget = [&] {
      std::lock_guard lk(mu);
      kv_waiters.erase(id);
    };
    auto sent_at = clock_type::now();
    if (auto err = send(make_packet(header(rank, wire::no_process), wire::kv_get{id, key, wait_ms}))) {
      forget();
      return err;
    }
    std::unique_lock lk(mu);
    auto answer_by = sent_at + std::chrono::milliseconds(wait_ms) + kv_answer_margin;
    cv.wait_until(lk, answer_by, [&] { return kv_waiters.at(id) || failure; });
    auto got = std::move(kv_waiters.at(id));
    kv_waiters.erase(id);
    if (got && got->found)
      return std::move(got->value);
    if (!got && failure)
      return failure;
    if (!got)
      return not_found("got no answer");
    if (wait_ms >= left.count())
      return not_found("was not put");
    // The coordinator's wait was clamped; ours goes on.
  }
}

// -- coordinator_client --------------------------------------------------------

namespace {

caf::error moved_from() {
  return make_error(errc::closed, "coordinator_client was moved from");
}

} // namespace

coordinator_client::coordinator_client() : impl_(std::make_unique<impl>()) {}
coordinator_client::~coordinator_client() = default;
coordinator_client::coordinator_client(coordinator_client&&) noexcept = default;
coordinator_client& coordinator_client::operator=(coordinator_client&&) noexcept = default;

expected<coordinator_client> coordinator_client::connect(const host_port& where,
                                                         std::chrono::milliseconds timeout) {
  coordinator_client c;
  if (auto err = c.impl_->connect(where, deadline_after(timeout)))
    return err;
  c.impl_->start_io();
  spdlog::debug("connected to the coordinator at {}", where.to_string());
  return expected<coordinator_client>(std::move(c));
}

expected<wire::peer_table>
coordinator_client::register_and_wait(const wire::register_worker& me,
                                      std::chrono::milliseconds timeout) {
  if (!impl_)
    return moved_from();
  auto& s = *impl_;
  auto deadline = deadline_after(timeout);
  s.rank = me.rank;
  if (auto err = s.send(make_packet(header(me.rank, wire::no_process), me)))
    return err;
  std::unique_lock lk(s.mu);
  s.cv.wait_until(lk, deadline,
                  [&] { return !s.answers.empty() || s.shutdown_seen || s.failure; });
  // Answers that arrived before a failure or a shutdown come first.
  if (!s.answers.empty()) {
    auto a = std::move(s.answers.front());
    s.answers.pop_front();
    if (auto* t = std::get_if<wire::peer_table>(&a))
      return std::move(*t);
    return make_error(errc::invalid_argument, "the coordinator rejected rank "
                                                + std::to_string(me.rank) + ": "
                                                + std::get<wire::rejected>(a).reason);
  }
  if (s.shutdown_seen)
    return make_error(errc::closed, "the coordinator shut down before the peer table: "
                                      + s.shutdown_seen->reason);
  if (s.failure)
    return s.failure;
  return s.explain(make_error(errc::timeout), "peer table", timeout);
}

caf::error coordinator_client::rejoin(const wire::register_worker& me) {
  if (!impl_)
    return moved_from();
  impl_->rank = me.rank;
  return impl_->send(make_packet(header(me.rank, wire::no_process), me));
}

caf::error coordinator_client::send_divergence(const wire::replica_divergence& d) {
  if (!impl_)
    return moved_from();
  return impl_->send(make_packet(header(impl_->rank, wire::no_process), d));
}

caf::error coordinator_client::report(const wire::report& r) {
  if (!impl_)
    return moved_from();
  return impl_->send(make_packet(header(impl_->rank, wire::no_process), r));
}

caf::error coordinator_client::send_status(const wire::worker_status& st) {
  if (!impl_)
    return moved_from();
  return impl_->send(make_packet(header(impl_->rank, wire::no_process), st));
}

void coordinator_client::on_control(std::function<void(const control_message&)> f) {
  if (!impl_)
    return;
  std::lock_guard lk(impl_->control_mu);
  impl_->on_control = std::move(f);
  if (impl_->on_control)
    for (auto& m : impl_->control_backlog)
      impl_->on_control(m);
  impl_->control_backlog.clear();
}

expected<wire::shutdown> coordinator_client::wait_shutdown(std::chrono::milliseconds timeout) {
  if (!impl_)
    return moved_from();
  auto& s = *impl_;
  std::unique_lock lk(s.mu);
  // Peer table updates and late rejections do not end the wait; only a
  // shutdown or the end of the connection do.
  s.cv.wait_until(lk, deadline_after(timeout), [&] { return s.shutdown_seen || s.failure; });
  if (s.shutdown_seen)
    return *s.shutdown_seen;
  if (s.failure)
    return s.failure;
  return s.explain(make_error(errc::timeout), "shutdown", timeout);
}

std::optional<wire::peer_table> coordinator_client::latest_table() const {
  if (!impl_)
    return std::nullopt;
  std::lock_guard lk(impl_->mu);
  return impl_->table;
}

caf::error coordinator_client::kv_put(const std::string& key, const wire::bytes& value) {
  if (!impl_)
    return moved_from();
  return impl_->send(make_packet(header(impl_->rank, wire::no_process), wire::kv_put{key, value}));
}

expected<wire::bytes> coordinator_client::kv_get(const std::string& key,
                                                 std::chrono::milliseconds timeout) {
  if (!impl_)
    return moved_from();
  return impl_->kv_get(key, timeout);
}

caf::error coordinator_client::kv_drop(const std::string& prefix) {
  if (!impl_)
    return moved_from();
  return impl_->send(make_packet(header(impl_->rank, wire::no_process), wire::kv_drop{prefix}));
}

} // namespace cmesh
