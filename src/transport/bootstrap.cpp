// Bootstrap over TCP with Boost.Asio.
//
// The coordinator owns one I/O thread and keeps all connection state on it;
// only what callers' threads query (ranks, reports, the event callback) sits
// behind a mutex. The client is synchronous: it drives a private io_context
// with run_one_for so that every wait has a deadline, and an operation that
// outlives a deadline stays armed, so the next call picks up where it left.
#include "transport/bootstrap.hpp"

#include "transport/wire.hpp"

#include <boost/asio.hpp>
#include <spdlog/spdlog.h>

#include <array>
#include <charconv>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
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
    bool closing = false; // stop(): close once `out` drains
    bool closed = false;
  };
  using conn_ptr = std::shared_ptr<connection>;

  struct rank_state {
    wire::peer_entry entry;
    conn_ptr conn; // null while the rank is disconnected
  };

  explicit impl(coordinator_options o) : opts(std::move(o)) {}

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
  bool stopping = false;
  bool table_sent = false;
  uint64_t epoch = 0;

  // Shared with callers' threads.
  mutable std::mutex mu;
  std::condition_variable reports_cv;
  std::map<uint32_t, rank_state> ranks; // sorted, as the peer table wants
  std::deque<wire::report> reports;
  uint64_t first_report_seq = 0; // arrival number of reports.front()
  std::function<void(const worker_event&)> on_event;

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
  size_t live_ranks() const;
  void publish_table();
  void on_report(const conn_ptr& c, const wire::report& r);
  void on_disconnect(const conn_ptr& c);
  void emit(const worker_event& ev);

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
    default: {
      const char* name = wire::kind_name(v.header.kind);
      return make_error(errc::unknown_kind, std::string(name ? name : "unknown kind")
                                              + " is not a message for the coordinator");
    }
  }
}

void coordinator::impl::on_register(const conn_ptr& c, const wire::register_worker& m) {
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
  if (!problem.empty()) {
    spdlog::warn("coordinator: rejected registration from {}: {}", c->peer, problem);
    return send(c, wire::rejected{problem});
  }
  spdlog::info("coordinator: rank {} registered from {} (host {}, pid {}, incarnation {}); {}/{} live",
               m.rank, c->peer, m.host, m.pid, m.incarnation, live, opts.world_size);
  emit(worker_event{worker_event::type::registered, m.rank, {}});
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
  emit(worker_event{worker_event::type::report, *c->rank, r});
}

void coordinator::impl::on_disconnect(const conn_ptr& c) {
  uint32_t rank = *c->rank;
  {
    std::lock_guard lk(mu);
    auto it = ranks.find(rank);
    if (it == ranks.end() || it->second.conn != c)
      return;
    it->second.conn = nullptr;
  }
  if (stopping)
    spdlog::info("coordinator: closed the connection of rank {}", rank);
  else
    spdlog::warn("coordinator: rank {} disconnected ({})", rank, c->peer);
  emit(worker_event{worker_event::type::disconnected, rank, {}});
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
    for (auto& c : std::vector<impl::conn_ptr>(s->conns.begin(), s->conns.end()))
      s->send(c, msg);
  });
}

void coordinator::on_event(std::function<void(const worker_event&)> f) {
  std::lock_guard lk(impl_->mu);
  impl_->on_event = std::move(f);
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
  /// What a worker can receive; monostate: a kind it has no use for.
  using inbound = std::variant<std::monostate, wire::peer_table, wire::rejected, wire::shutdown>;

  // Declared first so it is destroyed last: the socket must go before it.
  asio::io_context ioc;
  tcp::socket sock{ioc};
  std::string where; // "host:port" for messages
  uint32_t rank = wire::no_process;

  std::array<uint8_t, length_bytes> length{};
  std::vector<uint8_t> frame;
  bool reading = false;
  std::deque<std::vector<uint8_t>> inbox; // whole frames, not yet looked at
  packet out;
  caf::error failure; // set once the connection is unusable

  std::optional<wire::peer_table> table;       // the latest one
  std::optional<wire::shutdown> shutdown_seen; // kept for wait_shutdown()

  template <class Pred>
  bool run_until(Pred done, clock_type::time_point deadline);
  caf::error connect(const host_port& hp, clock_type::time_point deadline);
  error_code resolve(const host_port& hp, clock_type::time_point deadline,
                     std::vector<tcp::endpoint>& out);
  error_code try_connect(const std::vector<tcp::endpoint>& eps, clock_type::time_point deadline);

  caf::error send(packet p);
  void arm_read();
  void on_length(const error_code& ec);
  void on_frame(const error_code& ec);
  void fail(caf::error e);
  void fail_io(const error_code& ec);
  expected<std::vector<uint8_t>> next_frame(clock_type::time_point deadline);
  expected<inbound> next_message(clock_type::time_point deadline);
  caf::error explain(caf::error e, const char* awaited, std::chrono::milliseconds timeout) const;
};

/// Runs handlers until `done()` or the deadline; false on the deadline.
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

caf::error coordinator_client::impl::send(packet p) {
  if (failure)
    return failure;
  out = std::move(p);
  auto st = std::make_shared<op_state>();
  asio::async_write(sock, asio::buffer(out), [st](const error_code& ec, size_t) {
    st->ec = ec;
    st->done = true;
  });
  if (!run_until([&] { return st->done; }, clock_type::now() + client_write_timeout)) {
    // Half a frame may be on the wire: the stream is unusable from here on.
    fail(make_error(errc::closed, "a write to the coordinator at " + where + " timed out"));
    run_until([&] { return st->done; }, clock_type::now() + cancel_drain);
    return make_error(errc::timeout, "cannot write to the coordinator at " + where);
  }
  if (st->ec) {
    fail_io(st->ec);
    return failure;
  }
  return {};
}

void coordinator_client::impl::arm_read() {
  if (reading || failure)
    return;
  reading = true;
  asio::async_read(sock, asio::buffer(length),
                   [this](const error_code& ec, size_t) { on_length(ec); });
}

void coordinator_client::impl::on_length(const error_code& ec) {
  if (ec) {
    reading = false;
    return fail_io(ec);
  }
  size_t n = decode_length(length);
  if (n > client_frame_bytes_max) {
    reading = false;
    auto err = oversized_frame(n, client_frame_bytes_max);
    wire::note_reject(err, "coordinator");
    return fail(err);
  }
  frame.resize(n);
  asio::async_read(sock, asio::buffer(frame),
                   [this](const error_code& e, size_t) { on_frame(e); });
}

void coordinator_client::impl::on_frame(const error_code& ec) {
  reading = false;
  if (ec)
    return fail_io(ec);
  inbox.push_back(std::move(frame));
  frame = {};
}

void coordinator_client::impl::fail(caf::error e) {
  if (!failure)
    failure = std::move(e);
  error_code ignored;
  sock.close(ignored);
}

void coordinator_client::impl::fail_io(const error_code& ec) {
  if (ec == asio::error::eof)
    fail(make_error(errc::closed, "the coordinator at " + where + " closed the connection"));
  else
    fail(make_error(errc::closed, "lost the connection to the coordinator at " + where + ": "
                                    + ec.message()));
}

expected<std::vector<uint8_t>> coordinator_client::impl::next_frame(clock_type::time_point deadline) {
  if (inbox.empty() && !failure) {
    arm_read();
    run_until([&] { return !inbox.empty() || failure; }, deadline);
  }
  // Frames that arrived before a failure are still delivered first.
  if (!inbox.empty()) {
    auto f = std::move(inbox.front());
    inbox.pop_front();
    return f;
  }
  if (failure)
    return failure;
  return make_error(errc::timeout);
}

namespace {

template <class T, class Variant>
expected<Variant> body_as(const wire::frame_view& v) {
  auto m = wire::decode_body<T>(v.body);
  if (!m)
    return m.error();
  return Variant{std::move(*m)};
}

} // namespace

auto coordinator_client::impl::next_message(clock_type::time_point deadline) -> expected<inbound> {
  auto bytes = next_frame(deadline);
  if (!bytes)
    return bytes.error();
  auto v = wire::decode_frame(*bytes);
  expected<inbound> msg = inbound{};
  if (!v)
    msg = v.error();
  else if (v->header.kind == wire::peer_table::kind)
    msg = body_as<wire::peer_table, inbound>(*v);
  else if (v->header.kind == wire::rejected::kind)
    msg = body_as<wire::rejected, inbound>(*v);
  else if (v->header.kind == wire::shutdown::kind)
    msg = body_as<wire::shutdown, inbound>(*v);
  if (!msg) {
    wire::note_reject(msg.error(), "coordinator");
    fail(msg.error());
    return msg;
  }
  if (auto* t = std::get_if<wire::peer_table>(&*msg))
    table = *t;
  if (auto* s = std::get_if<wire::shutdown>(&*msg))
    shutdown_seen = *s;
  return msg;
}

/// Gives a bare timeout from next_frame() its meaning for the caller.
caf::error coordinator_client::impl::explain(caf::error e, const char* awaited,
                                             std::chrono::milliseconds timeout) const {
  if (code_of(e) != errc::timeout)
    return e;
  return make_error(errc::timeout, std::string("no ") + awaited + " from the coordinator at "
                                     + where + " within " + std::to_string(timeout.count())
                                     + " ms");
}

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
  if (auto err = c.impl_->connect(where, clock_type::now() + timeout))
    return err;
  spdlog::debug("connected to the coordinator at {}", where.to_string());
  return expected<coordinator_client>(std::move(c));
}

expected<wire::peer_table>
coordinator_client::register_and_wait(const wire::register_worker& me,
                                      std::chrono::milliseconds timeout) {
  if (!impl_)
    return moved_from();
  auto deadline = clock_type::now() + timeout;
  impl_->rank = me.rank;
  if (auto err = impl_->send(make_packet(header(me.rank, wire::no_process), me)))
    return err;
  for (;;) {
    auto msg = impl_->next_message(deadline);
    if (!msg)
      return impl_->explain(msg.error(), "peer table", timeout);
    if (auto* t = std::get_if<wire::peer_table>(&*msg))
      return *t;
    if (auto* r = std::get_if<wire::rejected>(&*msg))
      return make_error(errc::invalid_argument, "the coordinator rejected rank "
                                                  + std::to_string(me.rank) + ": " + r->reason);
    if (auto* s = std::get_if<wire::shutdown>(&*msg))
      return make_error(errc::closed, "the coordinator shut down before the peer table: "
                                        + s->reason);
  }
}

caf::error coordinator_client::report(const wire::report& r) {
  if (!impl_)
    return moved_from();
  return impl_->send(make_packet(header(impl_->rank, wire::no_process), r));
}

expected<wire::shutdown> coordinator_client::wait_shutdown(std::chrono::milliseconds timeout) {
  if (!impl_)
    return moved_from();
  auto deadline = clock_type::now() + timeout;
  // Peer table updates and late rejections are skipped (next_message keeps
  // the latest table); only a shutdown or the end of the connection count.
  while (!impl_->shutdown_seen) {
    auto msg = impl_->next_message(deadline);
    if (!msg)
      return impl_->explain(msg.error(), "shutdown", timeout);
  }
  return *impl_->shutdown_seen;
}

} // namespace cmesh
