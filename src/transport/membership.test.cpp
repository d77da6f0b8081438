// The transport and the mesh follow a rank's incarnations: three transports
// in one process (rank 0, and two incarnations of rank 1), real UCX between
// them.
#include "core/spawn.hpp"
#include "transport/join.hpp"
#include "transport/mesh.hpp"
#include "transport/transport.hpp"

#include <caf/all.hpp>
#include <doctest/doctest.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

using namespace cmesh;
using namespace std::chrono_literals;

namespace {

/// What one transport received and saw, for the test to wait on.
struct inbox {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<uint32_t, uint64_t>> tokens; // (from, hops)
  std::vector<uint64_t> blob_checksums;
  std::vector<std::pair<uint32_t, std::string>> downs;
  std::vector<std::pair<uint32_t, uint64_t>> ups;

  void handlers(transport& t) {
    t.set_handlers(
      [this](inbound_frame&& f) {
        std::lock_guard lk(mu);
        if (f.header.kind == wire::token::kind) {
          auto m = wire::decode_body<wire::token>(f.body());
          REQUIRE(m);
          tokens.emplace_back(f.from, m->hops);
        } else if (f.header.kind == wire::blob::kind) {
          auto m = wire::decode_body<wire::blob>(f.body());
          REQUIRE(m);
          uint64_t sum = 0;
          for (size_t i = 0; i < f.payload.size(); ++i)
            sum += f.payload.data()[i];
          blob_checksums.push_back(sum == m->checksum ? sum : ~uint64_t{0});
        }
        cv.notify_all();
      },
      [this](uint32_t rank, const caf::error& why) {
        std::lock_guard lk(mu);
        downs.emplace_back(rank, describe(why));
        cv.notify_all();
      },
      [this](uint32_t rank, uint64_t inc) {
        std::lock_guard lk(mu);
        ups.emplace_back(rank, inc);
        cv.notify_all();
      });
  }

  template <class Pred>
  bool wait(Pred pred) {
    std::unique_lock lk(mu);
    return cv.wait_for(lk, 10s, pred);
  }
};

wire::peer_entry entry_of(transport& t, uint32_t rank, uint64_t incarnation) {
  wire::peer_entry e;
  e.rank = rank;
  e.incarnation = incarnation;
  e.ucx_address = t.address();
  return e;
}

transport_options quick() {
  transport_options o;
  o.connect_timeout_ms = 20000;
  return o;
}

/// Rank 0, and rank 1 at incarnations 1000 and 2000.
std::array<std::unique_ptr<transport>, 3> three_transports() {
  auto a = transport::create(0, quick(), 1);
  auto b1 = transport::create(1, quick(), 1000);
  auto b2 = transport::create(1, quick(), 2000);
  REQUIRE(a);
  REQUIRE(b1);
  REQUIRE(b2);
  return {std::move(*a), std::move(*b1), std::move(*b2)};
}

caf::error send_token(transport& t, uint32_t to, uint64_t hops, uint64_t incarnation = 0) {
  wire::frame_header h;
  return t.send_message(to, h, wire::token{0, 0, 0, hops}, incarnation);
}

} // namespace

TEST_CASE("a rank's new incarnation is connected after start; the old one is fenced for good") {
  auto [a, b1, b2] = three_transports();
  inbox in_a, in_b1, in_b2;
  in_a.handlers(*a);
  in_b1.handlers(*b1);
  in_b2.handlers(*b2);
  REQUIRE_FALSE(a->connect({entry_of(*b1, 1, 1000)}));
  REQUIRE_FALSE(b1->connect({entry_of(*a, 0, 1)}));
  REQUIRE_FALSE(a->start());
  REQUIRE_FALSE(b1->start());
  CHECK(a->peer_incarnation(1) == 1000);

  REQUIRE_FALSE(send_token(*a, 1, 1));
  REQUIRE(in_b1.wait([&] { return in_b1.tokens.size() == 1; }));
  REQUIRE_FALSE(send_token(*b1, 0, 10));
  REQUIRE(in_a.wait([&] { return in_a.tokens.size() == 1; }));

  // Rank 1 restarts: its new incarnation dials rank 0, and rank 0 learns
  // of it (the peer table) and connects it while running.
  REQUIRE_FALSE(b2->connect({entry_of(*a, 0, 1)}));
  REQUIRE_FALSE(b2->start());
  REQUIRE_FALSE(a->connect_peer(entry_of(*b2, 1, 2000)));
  REQUIRE(in_a.wait([&] { return !in_a.ups.empty() && !in_a.downs.empty(); }));
  CHECK(in_a.ups[0] == std::pair<uint32_t, uint64_t>{1, 2000});
  CHECK(in_a.downs[0].first == 1);
  CHECK(in_a.downs[0].second.find("superseded by incarnation 2000") != std::string::npos);
  CHECK(a->peer_incarnation(1) == 2000);
  CHECK(a->peer_alive(1));

  // Frames go to the new incarnation only.
  REQUIRE_FALSE(send_token(*a, 1, 2));
  REQUIRE(in_b2.wait([&] { return in_b2.tokens.size() == 1; }));
  CHECK(in_b2.tokens[0].second == 2);
  // A send meant for the old incarnation is refused.
  CHECK(code_of(send_token(*a, 1, 3, 1000)) == errc::peer_lost);

  // The old process still runs and sends: dropped as stale, while the new
  // one's frames and payloads arrive.
  REQUIRE_FALSE(send_token(*b1, 0, 11));
  REQUIRE(in_a.wait([&] { return a->stats().frames_stale >= 1; }));
  REQUIRE_FALSE(send_token(*b2, 0, 20));
  wire::blob blob;
  blob.payload = bulk::allocate(1 << 20);
  uint64_t sum = 0;
  for (size_t i = 0; i < blob.payload.size(); ++i) {
    blob.payload.data()[i] = static_cast<uint8_t>(i * 7);
    sum += blob.payload.data()[i];
  }
  blob.checksum = sum;
  REQUIRE_FALSE(b2->send_message(0, wire::frame_header{}, blob));
  REQUIRE(in_a.wait([&] { return in_a.tokens.size() == 2 && in_a.blob_checksums.size() == 1; }));
  CHECK(in_a.tokens[1] == std::pair<uint32_t, uint64_t>{1, 20});
  CHECK(in_a.blob_checksums[0] == sum);
  // Heartbeats of the new one keep it alive (the old one's are stale).
  std::this_thread::sleep_for(std::chrono::milliseconds(3 * quick().heartbeat_timeout_ms / 2));
  CHECK(a->peer_alive(1));
  CHECK(b2->peer_alive(0));
  {
    std::lock_guard lk(in_a.mu);
    CHECK(in_a.downs.size() == 1);
  }

  // An older (or the same) incarnation again changes nothing.
  REQUIRE_FALSE(a->connect_peer(entry_of(*b1, 1, 1000)));
  REQUIRE_FALSE(a->connect_peer(entry_of(*b2, 1, 2000)));
  std::this_thread::sleep_for(50ms);
  CHECK(a->peer_incarnation(1) == 2000);
  CHECK(in_a.ups.size() == 1);
  CHECK(a->stats().peers_connected == 2);

  // Out of range, or a malformed address: invalid_argument.
  CHECK(code_of(a->connect_peer(entry_of(*b2, 7, 1))) == errc::invalid_argument);
  auto bad = entry_of(*b2, 1, 3000);
  bad.ucx_address.resize(3);
  CHECK(code_of(a->connect_peer(bad)) == errc::invalid_argument);
  for (auto* t : {b1.get(), b2.get(), a.get()})
    t->stop();
}

TEST_CASE("mesh proxies are bound to an incarnation: a new one gets new proxies") {
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  auto [a, b1, b2] = three_transports();
  mesh ma(sys, *a), mb1(sys, *b1), mb2(sys, *b2);
  // Each incarnation's echo answers with its own value.
  auto echo = [&](uint64_t value) {
    return spawn_event_based(sys, [value](caf::event_based_actor* self) -> caf::behavior {
      return {[self, value](const wire::sequenced& s) {
        self->send(caf::actor_cast<caf::actor>(self->current_sender()), wire::ack{s.seq, value});
      }};
    });
  };
  mb1.publish("echo", echo(1000));
  mb2.publish("echo", echo(2000));
  REQUIRE_FALSE(a->connect({entry_of(*b1, 1, 1000)}));
  REQUIRE_FALSE(b1->connect({entry_of(*a, 0, 1)}));
  REQUIRE_FALSE(a->start());
  REQUIRE_FALSE(b1->start());

  caf::scoped_actor self{sys};
  auto ask = [&](const caf::actor& to, uint64_t seq) {
    self->send(to, wire::sequenced{0, seq, 0});
    uint64_t got = 0;
    self->receive([&](const wire::ack& k) { got = k.value; },
                  caf::after(std::chrono::seconds(10)) >> [&] { got = 0; });
    return got;
  };
  auto old_echo = ma.remote(1, "echo");
  CHECK(ask(old_echo, 1) == 1000);

  // Rank 1 restarts: its new incarnation starts, and rank 0 dials it. (Had
  // it started long before rank 0 dialled it, it would have found rank 0
  // silent past the heartbeat bound meanwhile, and fenced it for good.)
  REQUIRE_FALSE(b2->connect({entry_of(*a, 0, 1)}));
  REQUIRE_FALSE(b2->start());
  REQUIRE_FALSE(a->connect_peer(entry_of(*b2, 1, 2000)));
  for (int i = 0; i < 1000 && a->peer_incarnation(1) != 2000; ++i)
    std::this_thread::sleep_for(10ms);
  REQUIRE(a->peer_incarnation(1) == 2000);
  // The old proxy is terminated: a monitor of it hears so at once.
  self->monitor(old_echo);
  bool down = false;
  self->receive([&](const caf::down_msg&) { down = true; },
                caf::after(std::chrono::seconds(10)) >> [&] { down = false; });
  CHECK(down);
  // A new proxy reaches the new incarnation.
  auto new_echo = ma.remote(1, "echo");
  CHECK(new_echo != old_echo);
  CHECK(ask(new_echo, 2) == 2000);
  b1->stop();
  b2->stop();
  a->stop();
}

TEST_CASE("entries_to_dial: the members at the incarnations asked for, never self or the dead") {
  wire::peer_table t;
  for (uint32_t r = 0; r < 4; ++r) {
    wire::peer_entry e;
    e.rank = r;
    e.incarnation = 100 + r;
    e.ucx_address = {static_cast<uint8_t>(r)};
    t.peers.push_back(e);
  }
  auto ranks = [](const std::vector<wire::peer_entry>& es) {
    std::vector<uint32_t> out;
    for (auto& e : es)
      out.push_back(e.rank);
    return out;
  };
  // Self left out; in rank order whatever the order asked.
  CHECK(ranks(entries_to_dial(t, {{3, 103}, {1, 101}, {0, 100}}, 0)) == std::vector<uint32_t>{1, 3});
  // Rank 2 asked for at an incarnation the table does not hold (it died and
  // its replacement has not registered, or the table is older): not dialled.
  CHECK(ranks(entries_to_dial(t, {{2, 999}, {1, 101}}, 0)) == std::vector<uint32_t>{1});
  // Incarnation 0: whichever the table holds.
  auto any = entries_to_dial(t, {{2, 0}}, 0);
  REQUIRE(any.size() == 1);
  CHECK(any[0].incarnation == 102);
  CHECK(entries_to_dial(t, {}, 0).empty());
}
