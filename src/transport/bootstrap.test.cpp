#include "transport/bootstrap.hpp"

#include "transport/wire.hpp"

#include <boost/asio.hpp>
#include <doctest/doctest.h>

#include <atomic>
#include <future>
#include <random>
#include <thread>

using namespace cmesh;
using namespace std::chrono_literals;
namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

// Hang guards only: every wait below normally ends in milliseconds.
constexpr auto guard = 5000ms;

std::unique_ptr<coordinator> start_coordinator(coordinator_options opts) {
  auto c = std::make_unique<coordinator>(opts);
  REQUIRE(!c->start());
  REQUIRE(c->port() != 0);
  return c;
}

std::unique_ptr<coordinator> start_coordinator(uint32_t world_size, size_t reports_max = 100000) {
  coordinator_options opts;
  opts.world_size = world_size;
  opts.reports_max = reports_max;
  return start_coordinator(opts);
}

host_port address_of(const coordinator& c) {
  return host_port{"127.0.0.1", c.port()};
}

coordinator_client connect_to(const coordinator& c) {
  auto client = coordinator_client::connect(address_of(c), guard);
  REQUIRE(client);
  return std::move(*client);
}

wire::register_worker worker(uint32_t rank, uint32_t world_size, uint64_t incarnation = 1) {
  wire::register_worker w;
  w.rank = rank;
  w.world_size = world_size;
  w.incarnation = incarnation;
  w.pid = 1000 + rank;
  w.host = "host" + std::to_string(rank);
  w.ucx_address = {static_cast<unsigned char>(rank), 0xab, 0xcd};
  return w;
}

/// Polls `cond` until it holds or the guard runs out.
template <class F>
bool eventually(F cond) {
  auto deadline = std::chrono::steady_clock::now() + guard;
  while (!cond()) {
    if (std::chrono::steady_clock::now() > deadline)
      return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

/// A port on which nothing listens (bound once, then released).
uint16_t unused_port() {
  asio::io_context io;
  tcp::acceptor a(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  return a.local_endpoint().port();
}

/// Writes raw bytes to the coordinator and waits for it to hang up on us.
/// Returns the error that ended the read (eof or a reset), or success if the
/// coordinator answered with data instead or did not hang up in time.
boost::system::error_code send_raw_and_wait_close(uint16_t port, const std::vector<uint8_t>& bytes) {
  asio::io_context io;
  tcp::socket s(io);
  s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  asio::write(s, asio::buffer(bytes));
  std::array<char, 64> buf{};
  boost::system::error_code result;
  s.async_read_some(asio::buffer(buf), [&](const boost::system::error_code& ec, size_t) {
    result = ec;
  });
  io.run_for(guard);
  return result;
}

bool is_hang_up(const boost::system::error_code& ec) {
  return ec == asio::error::eof || ec == asio::error::connection_reset;
}

wire::bytes bytes_of(const std::string& s) {
  return wire::bytes(s.begin(), s.end());
}

using std::chrono::steady_clock;

} // namespace

TEST_CASE("parse_host_port accepts host:port and rejects the rest") {
  auto ok = parse_host_port("127.0.0.1:5555");
  REQUIRE(ok);
  CHECK(ok->host == "127.0.0.1");
  CHECK(ok->port == 5555);
  CHECK(ok->to_string() == "127.0.0.1:5555");

  auto named = parse_host_port("node-7.cluster:65535");
  REQUIRE(named);
  CHECK(named->host == "node-7.cluster");
  CHECK(named->port == 65535);

  auto v6 = parse_host_port("[::1]:80");
  REQUIRE(v6);
  CHECK(v6->host == "::1");

  for (auto bad : {"", "127.0.0.1", "127.0.0.1:", ":5555", "host:abc", "host:55x", "host:0",
                   "host:65536", "host:99999999999999999999", "host:-1", "host:+5", "host: 5"}) {
    CAPTURE(bad);
    auto r = parse_host_port(bad);
    REQUIRE(!r);
    CHECK(code_of(r.error()) == errc::invalid_argument);
    CHECK(describe(r.error()).find("host:port") != std::string::npos);
  }
}

TEST_CASE("three workers register and all receive the same sorted peer table") {
  auto coord = start_coordinator(3);
  std::atomic<int> registrations{0};
  coord->on_event([&](const worker_event& ev) {
    if (ev.what == worker_event::type::registered)
      ++registrations;
  });
  std::vector<std::future<expected<wire::peer_table>>> tables;
  for (uint32_t rank : {2u, 0u, 1u}) // out of order on purpose
    tables.push_back(std::async(std::launch::async, [&, rank] {
      auto client = connect_to(*coord);
      return client.register_and_wait(worker(rank, 3), guard);
    }));
  std::vector<wire::peer_table> got;
  for (auto& f : tables) {
    auto t = f.get();
    REQUIRE(t);
    got.push_back(*t);
  }
  CHECK(got[0] == got[1]);
  CHECK(got[1] == got[2]);
  const auto& t = got[0];
  CHECK(t.epoch == 1);
  CHECK(t.world_size == 3);
  REQUIRE(t.peers.size() == 3);
  for (uint32_t r = 0; r < 3; ++r) {
    CHECK(t.peers[r].rank == r);
    CHECK(t.peers[r].pid == 1000 + r);
    CHECK(t.peers[r].host == "host" + std::to_string(r));
    CHECK(t.peers[r].ucx_address == wire::bytes{static_cast<unsigned char>(r), 0xab, 0xcd});
  }
  CHECK(registrations == 3);
  CHECK(coord->registered() == std::vector<uint32_t>{0, 1, 2});
}

TEST_CASE("bad ranks, wrong world sizes and duplicates are rejected") {
  auto coord = start_coordinator(2);
  auto first = std::async(std::launch::async, [&] {
    auto client = connect_to(*coord);
    auto t = client.register_and_wait(worker(0, 2), guard);
    return std::make_pair(std::move(client), std::move(t));
  });
  REQUIRE(eventually([&] { return coord->registered() == std::vector<uint32_t>{0}; }));

  auto outside = connect_to(*coord).register_and_wait(worker(5, 2), guard);
  REQUIRE(!outside);
  CHECK(code_of(outside.error()) == errc::invalid_argument);
  CHECK(describe(outside.error()).find("outside world size") != std::string::npos);

  auto wrong_size = connect_to(*coord).register_and_wait(worker(1, 3), guard);
  REQUIRE(!wrong_size);
  CHECK(code_of(wrong_size.error()) == errc::invalid_argument);

  auto duplicate = connect_to(*coord).register_and_wait(worker(0, 2, 2), guard);
  REQUIRE(!duplicate);
  CHECK(code_of(duplicate.error()) == errc::invalid_argument);
  CHECK(describe(duplicate.error()).find("already registered") != std::string::npos);

  // The rejected ones left no trace; the job still completes.
  auto second = connect_to(*coord).register_and_wait(worker(1, 2), guard);
  REQUIRE(second);
  CHECK(second->peers.size() == 2);
  auto [client0, table0] = first.get();
  REQUIRE(table0);
  CHECK(*table0 == *second);
}

TEST_CASE("a rank that disconnected may register again with a new incarnation") {
  auto coord = start_coordinator(2);
  std::atomic<int> disconnects{0};
  coord->on_event([&](const worker_event& ev) {
    if (ev.what == worker_event::type::disconnected)
      ++disconnects;
  });
  auto first = std::async(std::launch::async, [&] {
    auto client = connect_to(*coord);
    auto t = client.register_and_wait(worker(0, 2), guard);
    return std::make_pair(std::move(client), std::move(t));
  });
  {
    auto client1 = connect_to(*coord);
    REQUIRE(client1.register_and_wait(worker(1, 2, 1), guard));
  } // rank 1 goes away
  auto [client0, table0] = first.get();
  REQUIRE(table0);
  REQUIRE(eventually([&] { return coord->disconnected() == std::vector<uint32_t>{1}; }));
  CHECK(eventually([&] { return disconnects == 1; }));

  auto stale = connect_to(*coord).register_and_wait(worker(1, 2, 0), guard);
  REQUIRE(!stale);
  CHECK(code_of(stale.error()) == errc::invalid_argument);

  auto again = connect_to(*coord);
  auto t = again.register_and_wait(worker(1, 2, 2), guard);
  REQUIRE(t);
  CHECK(t->epoch == 2);
  REQUIRE(t->peers.size() == 2);
  CHECK(t->peers[1].incarnation == 2);
  CHECK(coord->disconnected().empty());
  CHECK(coord->registered() == std::vector<uint32_t>{0, 1});

  // rank 0 got the update too, and skips it while waiting for the shutdown.
  coord->broadcast_shutdown(0, "done");
  auto s = client0.wait_shutdown(guard);
  REQUIRE(s);
  CHECK(s->reason == "done");
}

TEST_CASE("reports reach wait_report, in order and bounded") {
  auto coord = start_coordinator(1, 3);
  std::atomic<int> report_events{0};
  coord->on_event([&](const worker_event& ev) {
    if (ev.what == worker_event::type::report)
      ++report_events;
  });
  auto client = connect_to(*coord);
  REQUIRE(client.register_and_wait(worker(0, 1), guard));
  for (int i = 0; i < 5; ++i)
    REQUIRE(!client.report(wire::report{0, "step", std::to_string(i), i}));
  REQUIRE(!client.report(wire::report{0, "done", "ok", 5}));

  auto done = coord->wait_report([](const wire::report& r) { return r.key == "done"; }, guard);
  REQUIRE(done);
  CHECK(done->value == "ok");
  // Reports that arrived before the call count too.
  auto step = coord->wait_report([](const wire::report& r) { return r.value == "4"; }, guard);
  REQUIRE(step);
  auto kept = coord->reports();
  REQUIRE(kept.size() == 3); // reports_max drops the oldest
  CHECK(kept[0].value == "3");
  CHECK(kept[1].value == "4");
  CHECK(kept[2].key == "done");
  CHECK(eventually([&] { return report_events == 6; })); // events fire just after storing
}

TEST_CASE("wait_report returns nullopt after its timeout") {
  auto coord = start_coordinator(1);
  auto start = std::chrono::steady_clock::now();
  auto r = coord->wait_report([](const wire::report&) { return true; }, 100ms);
  auto took = std::chrono::steady_clock::now() - start;
  CHECK(!r);
  CHECK(took >= 50ms);
  CHECK(took < guard);
  CHECK(coord->kv_waiting() == 0);
}

TEST_CASE("connecting where nothing listens is unreachable within the timeout") {
  auto port = unused_port();
  auto start = std::chrono::steady_clock::now();
  auto c = coordinator_client::connect({"127.0.0.1", port}, 300ms);
  auto took = std::chrono::steady_clock::now() - start;
  REQUIRE(!c);
  CHECK(code_of(c.error()) == errc::unreachable);
  auto text = describe(c.error());
  CHECK(text.find("127.0.0.1:" + std::to_string(port)) != std::string::npos);
  CHECK(text.find("Connection refused") != std::string::npos);
  CHECK(took >= 200ms); // it kept retrying
  CHECK(took < 3s);
}

TEST_CASE("the coordinator cannot bind a port in use") {
  auto coord = start_coordinator(1);
  coordinator_options opts;
  opts.port = coord->port();
  coordinator second(opts);
  auto err = second.start();
  CHECK(code_of(err) == errc::unreachable);
}

TEST_CASE("a client that connects late still gets in: connect retries until the coordinator listens") {
  auto port = unused_port();
  auto late = std::async(std::launch::async, [port] {
    std::this_thread::sleep_for(200ms);
    coordinator_options opts;
    opts.port = port;
    auto c = std::make_unique<coordinator>(opts);
    REQUIRE(!c->start());
    return c;
  });
  auto client = coordinator_client::connect({"127.0.0.1", port}, guard);
  auto coord = late.get();
  REQUIRE(client);
  CHECK(client->register_and_wait(worker(0, 1), guard));
}

TEST_CASE("garbage and oversized frames are rejected; the coordinator keeps serving") {
  auto coord = start_coordinator(1);
  auto before = wire::rejects().total();

  std::mt19937 rng(42);
  std::vector<uint8_t> garbage = {64, 0, 0, 0};
  for (int i = 0; i < 64; ++i)
    garbage.push_back(static_cast<uint8_t>(rng()));
  CHECK(is_hang_up(send_raw_and_wait_close(coord->port(), garbage)));

  std::vector<uint8_t> huge = {0xff, 0xff, 0xff, 0xff, 1, 2, 3};
  CHECK(is_hang_up(send_raw_and_wait_close(coord->port(), huge)));

  // A well-formed frame of a kind workers do not send is refused too.
  auto frame = wire::encode(wire::frame_header{}, wire::shutdown{1, "not yours"});
  std::vector<uint8_t> wrong_kind = {static_cast<uint8_t>(frame.size()), 0, 0, 0};
  wrong_kind.insert(wrong_kind.end(), frame.begin(), frame.end());
  CHECK(is_hang_up(send_raw_and_wait_close(coord->port(), wrong_kind)));

  CHECK(wire::rejects().total() >= before + 3);
  auto client = connect_to(*coord);
  auto t = client.register_and_wait(worker(0, 1), guard);
  REQUIRE(t);
  CHECK(t->peers.size() == 1);
}

TEST_CASE("broadcast_shutdown reaches every worker's wait_shutdown") {
  auto coord = start_coordinator(2);
  auto other = std::async(std::launch::async, [&] {
    auto client = connect_to(*coord);
    REQUIRE(client.register_and_wait(worker(1, 2), guard));
    return client.wait_shutdown(guard);
  });
  auto client = connect_to(*coord);
  REQUIRE(client.register_and_wait(worker(0, 2), guard));

  auto early = client.wait_shutdown(50ms);
  REQUIRE(!early);
  CHECK(code_of(early.error()) == errc::timeout);

  coord->broadcast_shutdown(3, "job done");
  coord->stop(); // queued shutdowns still go out before the sockets close
  for (auto s : {client.wait_shutdown(guard), other.get()}) {
    REQUIRE(s);
    CHECK(s->exit_code == 3);
    CHECK(s->reason == "job done");
  }
}

TEST_CASE("a worker that registers after the shutdown is told the job is over") {
  auto coord = start_coordinator(2);
  auto a = std::async(std::launch::async, [&] {
    auto client = connect_to(*coord);
    return static_cast<bool>(client.register_and_wait(worker(1, 2), guard));
  });
  auto client = connect_to(*coord);
  REQUIRE(client.register_and_wait(worker(0, 2), guard));
  REQUIRE(a.get());
  coord->broadcast_shutdown(0, "job done");
  REQUIRE(client.wait_shutdown(guard));
  // A replacement started just as the job ended: no peer table, a shutdown.
  auto late = connect_to(*coord);
  auto t = late.register_and_wait(worker(1, 2, 2), guard);
  REQUIRE_FALSE(t);
  CHECK(code_of(t.error()) == errc::closed);
  CHECK(describe(t.error()).find("job done") != std::string::npos);
}

TEST_CASE("stopping the coordinator makes wait_shutdown return closed") {
  auto coord = start_coordinator(1);
  auto client = connect_to(*coord);
  REQUIRE(client.register_and_wait(worker(0, 1), guard));
  coord->stop();
  coord->stop(); // idempotent
  auto s = client.wait_shutdown(guard);
  REQUIRE(!s);
  CHECK(code_of(s.error()) == errc::closed);
  CHECK(code_of(client.report(wire::report{})) == errc::closed);
}

TEST_CASE("coordinator_client moves") {
  auto coord = start_coordinator(1);
  auto a = connect_to(*coord);
  coordinator_client b = std::move(a);
  CHECK(code_of(a.report(wire::report{})) == errc::closed); // NOLINT: moved-from on purpose
  auto c = connect_to(*coord);
  c = std::move(b);
  CHECK(c.register_and_wait(worker(0, 1), guard));
}

// -- the KV store ----------------------------------------------------------------

TEST_CASE("kv_put then kv_get returns the value, before any registration") {
  auto coord = start_coordinator(1);
  auto client = connect_to(*coord); // a tool: never registers
  REQUIRE(!client.kv_put("epoch/7/host/3", bytes_of("ucx-address-3")));
  auto v = client.kv_get("epoch/7/host/3", guard);
  REQUIRE(v);
  CHECK(*v == bytes_of("ucx-address-3"));
  CHECK(coord->kv_peek("epoch/7/host/3") == bytes_of("ucx-address-3"));
  CHECK(!coord->kv_peek("epoch/7/host/4"));

  // Overwrites win; an empty value is a value.
  REQUIRE(!client.kv_put("epoch/7/host/3", bytes_of("second")));
  REQUIRE(!client.kv_put("empty", {}));
  CHECK(client.kv_get("epoch/7/host/3", guard) == bytes_of("second"));
  auto empty = client.kv_get("empty", 0ms);
  REQUIRE(empty);
  CHECK(empty->empty());
  CHECK(coord->kv_size() == 2);

  // Another connection sees the same store; registering changes nothing.
  auto other = connect_to(*coord);
  REQUIRE(other.register_and_wait(worker(0, 1), guard));
  CHECK(other.kv_get("epoch/7/host/3", guard) == bytes_of("second"));
}

TEST_CASE("a waiting kv_get is answered by a later put from another client") {
  auto coord = start_coordinator(2);
  auto waiter = connect_to(*coord);
  auto start = steady_clock::now();
  auto got = std::async(std::launch::async, [&] { return waiter.kv_get("epoch/1/nccl/uid", guard); });
  REQUIRE(eventually([&] { return coord->kv_waiting() == 1; }));
  std::this_thread::sleep_for(50ms);
  CHECK(got.wait_for(0ms) == std::future_status::timeout); // still waiting

  auto putter = connect_to(*coord);
  REQUIRE(!putter.kv_put("epoch/1/nccl/other", bytes_of("not this one")));
  REQUIRE(!putter.kv_put("epoch/1/nccl/uid", bytes_of("uid-bytes")));
  auto v = got.get();
  auto took = steady_clock::now() - start;
  REQUIRE(v);
  CHECK(*v == bytes_of("uid-bytes"));
  CHECK(took >= 50ms);
  CHECK(took < guard);
  CHECK(coord->kv_waiting() == 0);
}

TEST_CASE("kv_get of a key nobody puts times out, naming the key") {
  auto coord = start_coordinator(1);
  auto client = connect_to(*coord);
  auto start = steady_clock::now();
  auto v = client.kv_get("epoch/3/missing", 200ms);
  auto took = steady_clock::now() - start;
  REQUIRE(!v);
  CHECK(code_of(v.error()) == errc::timeout);
  CHECK(describe(v.error()).find("epoch/3/missing") != std::string::npos);
  CHECK(took >= 190ms);
  CHECK(took < 2s); // answered by the coordinator, not by the margin

  auto now = client.kv_get("epoch/3/missing", 0ms); // no wait at all
  REQUIRE(!now);
  CHECK(code_of(now.error()) == errc::timeout);
  // The connection is still fine.
  REQUIRE(!client.kv_put("epoch/3/missing", bytes_of("late")));
  CHECK(client.kv_get("epoch/3/missing", guard) == bytes_of("late"));
}

TEST_CASE("kv_drop and kv_drop_prefix erase a namespace and nothing else") {
  auto coord = start_coordinator(1);
  auto client = connect_to(*coord);
  for (auto key : {"epoch/1/a", "epoch/1/b", "epoch/10/a", "epoch/2/a", "epoch/2/b", "other"})
    REQUIRE(!client.kv_put(key, bytes_of(key)));
  REQUIRE(!client.kv_drop("epoch/1/"));
  // Frames of one connection are applied in order: the drop came first.
  auto gone = client.kv_get("epoch/1/a", 0ms);
  REQUIRE(!gone);
  CHECK(code_of(gone.error()) == errc::timeout);
  CHECK(!coord->kv_peek("epoch/1/b"));
  CHECK(coord->kv_peek("epoch/10/a") == bytes_of("epoch/10/a")); // "epoch/1/" is no prefix of it
  CHECK(client.kv_get("epoch/2/a", 0ms) == bytes_of("epoch/2/a"));
  CHECK(coord->kv_size() == 4);

  coord->kv_drop_prefix("epoch/");
  CHECK(coord->kv_size() == 1);
  CHECK(coord->kv_peek("other") == bytes_of("other"));
  CHECK(!client.kv_get("epoch/2/b", 0ms));
  coord->kv_drop_prefix("");
  CHECK(coord->kv_size() == 0);
}

TEST_CASE("puts beyond the store's limits are dropped and counted; the connection stays") {
  coordinator_options opts;
  opts.kv_value_bytes_max = 1000;
  opts.kv_keys_max = 2;
  auto coord = start_coordinator(opts);
  auto client = connect_to(*coord);

  REQUIRE(!client.kv_put("big", wire::bytes(1001, 7))); // too large: dropped
  REQUIRE(!client.kv_put("fits", wire::bytes(1000, 7)));
  CHECK(client.kv_get("fits", guard) == wire::bytes(1000, 7));
  auto big = client.kv_get("big", 0ms);
  REQUIRE(!big);
  CHECK(code_of(big.error()) == errc::timeout);
  CHECK(coord->kv_puts_dropped() == 1);

  REQUIRE(!client.kv_put("second", bytes_of("2")));
  REQUIRE(!client.kv_put("third", bytes_of("3"))); // a third key: dropped
  REQUIRE(!client.kv_put("fits", bytes_of("overwritten"))); // overwriting stays allowed
  CHECK(client.kv_get("fits", guard) == bytes_of("overwritten"));
  CHECK(!coord->kv_peek("third"));
  CHECK(coord->kv_puts_dropped() == 2);
  CHECK(coord->kv_size() == 2);
  CHECK(client.kv_get("second", guard) == bytes_of("2"));
}

TEST_CASE("kv_waits_max bounds the waiting gets of a connection") {
  coordinator_options opts;
  opts.kv_waits_max = 1;
  auto coord = start_coordinator(opts);
  auto client = connect_to(*coord);
  auto first = std::async(std::launch::async, [&] { return client.kv_get("k1", guard); });
  REQUIRE(eventually([&] { return coord->kv_waiting() == 1; }));
  auto start = steady_clock::now();
  auto second = client.kv_get("k2", guard); // over the bound: answered at once
  REQUIRE(!second);
  CHECK(code_of(second.error()) == errc::timeout);
  CHECK(steady_clock::now() - start < 2s);

  // Another connection has a bound of its own.
  auto other = connect_to(*coord);
  auto third = std::async(std::launch::async, [&] { return other.kv_get("k2", guard); });
  REQUIRE(eventually([&] { return coord->kv_waiting() == 2; }));
  auto putter = connect_to(*coord);
  REQUIRE(!putter.kv_put("k1", bytes_of("one")));
  REQUIRE(!putter.kv_put("k2", bytes_of("two")));
  CHECK(first.get() == bytes_of("one"));
  CHECK(third.get() == bytes_of("two"));
}

TEST_CASE("one client is used from four threads while a fifth waits for the shutdown") {
  auto coord = start_coordinator(1);
  auto client = connect_to(*coord);
  REQUIRE(client.register_and_wait(worker(0, 1), guard));

  auto shutdown = std::async(std::launch::async, [&] { return client.wait_shutdown(30s); });
  constexpr int threads = 4;
  constexpr int ops = 200;
  std::atomic<int> failures{0};
  std::atomic<int> reports_sent{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t)
    workers.emplace_back([&, t] {
      auto fail = [&](const char* what, int i) {
        if (failures++ < 10)
          MESSAGE("thread " << t << " op " << i << ": " << what);
      };
      // All four wait on one key at once: demultiplexed by request id.
      if (client.kv_get("go", 20s) != bytes_of("now"))
        fail("go", -1);
      for (int i = 0; i < ops; ++i) {
        auto key = "t" + std::to_string(t) + "/k" + std::to_string(i);
        auto value = bytes_of(key + "/value");
        switch (i % 3) {
          case 0:
            if (client.kv_put(key, value))
              fail("put", i);
            if (client.kv_get(key, 20s) != value)
              fail("get after put", i);
            break;
          case 1: { // the key put one step ago, and another thread's
            auto prev = "t" + std::to_string(t) + "/k" + std::to_string(i - 1);
            if (client.kv_get(prev, 20s) != bytes_of(prev + "/value"))
              fail("get of the previous key", i);
            auto missing = client.kv_get(key, 0ms);
            if (missing || code_of(missing.error()) != errc::timeout)
              fail("get of a missing key", i);
            break;
          }
          default:
            if (client.report(wire::report{0, "t" + std::to_string(t), std::to_string(i), i}))
              fail("report", i);
            else
              ++reports_sent;
        }
      }
    });
  REQUIRE(eventually([&] { return coord->kv_waiting() == threads; }));
  auto putter = connect_to(*coord);
  REQUIRE(!putter.kv_put("go", bytes_of("now")));
  for (auto& w : workers)
    w.join();
  CHECK(failures == 0);
  CHECK(reports_sent == threads * (ops / 3));
  CHECK(eventually([&] { return coord->reports().size() == size_t(threads * (ops / 3)); }));
  CHECK(shutdown.wait_for(0ms) == std::future_status::timeout); // still waiting

  coord->broadcast_shutdown(0, "all done");
  auto s = shutdown.get();
  REQUIRE(s);
  CHECK(s->reason == "all done");
  // Seen by the other thread, and still there for this one.
  auto again = client.wait_shutdown(0ms);
  REQUIRE(again);
  CHECK(again->reason == "all done");
}

TEST_CASE("stopping the coordinator ends a waiting kv_get with closed, promptly") {
  auto coord = start_coordinator(1);
  auto client = connect_to(*coord);
  auto got = std::async(std::launch::async, [&] { return client.kv_get("never", 30s); });
  REQUIRE(eventually([&] { return coord->kv_waiting() == 1; }));
  auto start = steady_clock::now();
  coord->stop();
  auto v = got.get();
  auto took = steady_clock::now() - start;
  REQUIRE(!v);
  CHECK(code_of(v.error()) == errc::closed);
  CHECK(took < 2s);
  auto after = client.kv_get("never", 1s);
  REQUIRE(!after);
  CHECK(code_of(after.error()) == errc::closed);
  CHECK(code_of(client.kv_put("k", {})) == errc::closed);
}

TEST_CASE("a connection that closes takes its waiting gets with it") {
  auto coord = start_coordinator(1);
  {
    asio::io_context io;
    tcp::socket raw(io);
    raw.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), coord->port()));
    for (uint64_t id : {1, 2, 3}) {
      auto frame = wire::encode(wire::frame_header{}, wire::kv_get{id, "later", 30000});
      auto n = static_cast<uint32_t>(frame.size());
      std::vector<uint8_t> bytes = {uint8_t(n), uint8_t(n >> 8), uint8_t(n >> 16), uint8_t(n >> 24)};
      bytes.insert(bytes.end(), frame.begin(), frame.end());
      asio::write(raw, asio::buffer(bytes));
    }
    REQUIRE(eventually([&] { return coord->kv_waiting() == 3; }));
  } // closed
  CHECK(eventually([&] { return coord->kv_waiting() == 0; }));

  // A get answered by its timer leaves nothing behind either.
  auto client = connect_to(*coord);
  CHECK(!client.kv_get("later", 50ms));
  CHECK(coord->kv_waiting() == 0);
  // The coordinator still serves, and a put answers only the live waiters.
  auto got = std::async(std::launch::async, [&] { return client.kv_get("later", guard); });
  REQUIRE(eventually([&] { return coord->kv_waiting() == 1; }));
  auto putter = connect_to(*coord);
  REQUIRE(!putter.kv_put("later", bytes_of("x")));
  CHECK(got.get() == bytes_of("x"));
  CHECK(coord->kv_waiting() == 0);
}

TEST_CASE("kv calls on a moved-from client are closed") {
  auto coord = start_coordinator(1);
  auto a = connect_to(*coord);
  coordinator_client b = std::move(a);
  CHECK(code_of(a.kv_put("k", {})) == errc::closed); // NOLINT: moved-from on purpose
  CHECK(code_of(a.kv_get("k", 0ms).error()) == errc::closed);
  CHECK(code_of(a.kv_drop("k")) == errc::closed);
  REQUIRE(!b.kv_put("k", bytes_of("v")));
  CHECK(b.kv_get("k", guard) == bytes_of("v"));
}

namespace {

wire::register_worker with_config(wire::register_worker w, config_list c) {
  w.config_digest = config_digest(c);
  w.config = std::move(c);
  return w;
}

} // namespace

TEST_CASE("a worker whose configuration differs from the job's is refused, naming each key") {
  coordinator_options opts;
  opts.world_size = 2;
  opts.job_config = {{"model.experts", "4"}, {"train.lr", "0.003"}, {"train.steps", "4"}};
  auto coord = start_coordinator(opts);
  auto first = std::async(std::launch::async, [&] {
    auto client = connect_to(*coord);
    auto t = client.register_and_wait(with_config(worker(0, 2), opts.job_config), guard);
    return std::make_pair(std::move(client), std::move(t));
  });
  REQUIRE(eventually([&] { return coord->registered() == std::vector<uint32_t>{0}; }));

  auto bad = connect_to(*coord).register_and_wait(
    with_config(worker(1, 2), {{"model.experts", "8"}, {"train.lr", "0.01"}, {"train.steps", "4"}}),
    guard);
  REQUIRE(!bad);
  CHECK(code_of(bad.error()) == errc::invalid_argument);
  CHECK(describe(bad.error())
        == "invalid_argument: the coordinator rejected rank 1: configuration mismatch with the "
           "job: model.experts = 8 (the job's: 4); train.lr = 0.01 (the job's: 0.003)");
  auto missing = connect_to(*coord).register_and_wait(
    with_config(worker(1, 2), {{"model.experts", "4"}, {"train.lr", "0.003"}}), guard);
  REQUIRE(!missing);
  CHECK(describe(missing.error()).find("train.steps missing (the job's: 4)") != std::string::npos);
  CHECK(coord->registered() == std::vector<uint32_t>{0}); // the refused left no trace

  // A correct worker for the rank completes the table.
  auto good = connect_to(*coord).register_and_wait(with_config(worker(1, 2), opts.job_config), guard);
  REQUIRE(good);
  CHECK(good->peers.size() == 2);
  auto [client0, table0] = first.get();
  REQUIRE(table0);
}

TEST_CASE("without the job's configuration the first worker that carries one sets it") {
  coordinator_options opts;
  opts.world_size = 3;
  opts.config_pinned = {{"layout.replicas", "3"}};
  auto coord = start_coordinator(opts);
  std::vector<std::future<expected<wire::peer_table>>> tables;
  std::vector<coordinator_client> clients;
  auto register_async = [&](wire::register_worker w) {
    clients.push_back(connect_to(*coord));
    tables.push_back(std::async(std::launch::async, [&c = clients.back(), w] {
      return c.register_and_wait(w, guard);
    }));
  };
  clients.reserve(3);
  // Without a configuration (a tool, the ring job): not checked, sets nothing.
  register_async(worker(0, 3));
  REQUIRE(eventually([&] { return coord->registered().size() == 1; }));
  // Against what the coordinator fixed itself.
  auto layout = connect_to(*coord).register_and_wait(
    with_config(worker(1, 3), {{"layout.replicas", "1"}, {"train.lr", "0.01"}}), guard);
  REQUIRE(!layout);
  CHECK(describe(layout.error()).find("configuration mismatch with the coordinator") != std::string::npos);
  CHECK(describe(layout.error()).find("layout.replicas = 1 (the job's: 3)") != std::string::npos);
  CHECK(describe(layout.error()).find("train.lr") == std::string::npos);
  // The first that carries one sets the job's ...
  register_async(with_config(worker(1, 3), {{"layout.replicas", "3"}, {"train.lr", "0.01"}}));
  REQUIRE(eventually([&] { return coord->registered().size() == 2; }));
  // ... and the next is held to it.
  auto other = connect_to(*coord).register_and_wait(
    with_config(worker(2, 3), {{"layout.replicas", "3"}, {"train.lr", "0.003"}}), guard);
  REQUIRE(!other);
  CHECK(describe(other.error()).find("configuration mismatch with the job: train.lr = 0.003 "
                                     "(the job's: 0.01)")
        != std::string::npos);
  register_async(with_config(worker(2, 3), {{"layout.replicas", "3"}, {"train.lr", "0.01"}}));
  for (auto& t : tables)
    CHECK(t.get());
}
