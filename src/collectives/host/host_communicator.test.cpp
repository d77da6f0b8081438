#include "collectives/host/host_communicator.hpp"

#include "transport/bootstrap.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

using namespace cmesh;
using namespace cmesh::coll;

namespace {

/// Sets an environment variable for one scope, restoring what was there.
struct scoped_env {
  std::string name;
  std::optional<std::string> old;
  scoped_env(const char* n, const char* value) : name(n) {
    if (const char* o = std::getenv(n))
      old = o;
    ::setenv(n, value, 1);
  }
  ~scoped_env() {
    if (old)
      ::setenv(name.c_str(), old->c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
};

} // namespace

TEST_CASE("CMESH_COLL_BULK chooses a context's protocol; a bad value is a typed error") {
  {
    scoped_env e("CMESH_COLL_BULK", "rendezvous");
    auto ctx = host_context::create(0);
    REQUIRE(ctx);
    CHECK((*ctx)->bulk() == bulk_protocol::rendezvous);
    auto given = host_context::create(0, bulk_protocol::eager);
    REQUIRE(given);
    CHECK((*given)->bulk() == bulk_protocol::eager); // the caller's choice wins
  }
  {
    scoped_env e("CMESH_COLL_BULK", "eager");
    CHECK(*default_bulk_protocol() == bulk_protocol::eager);
  }
  {
    scoped_env e("CMESH_COLL_BULK", "pull");
    auto p = default_bulk_protocol();
    REQUIRE_FALSE(p);
    CHECK(code_of(p.error()) == errc::invalid_argument);
    CHECK(describe(p.error()).find("CMESH_COLL_BULK=pull") != std::string::npos);
    CHECK_FALSE(host_context::create(0));
  }
}

TEST_CASE("both bulk protocols and the shared-memory ring all_reduce across two workers of one process") {
  for (int mode = 0; mode < 3; ++mode) {
    // eager, rendezvous (both through UCX), and the shared-memory ring
    auto bulk = mode == 1 ? bulk_protocol::rendezvous : bulk_protocol::eager;
    CAPTURE(mode);
    auto a = host_context::create(0, bulk);
    auto b = host_context::create(1, bulk);
    REQUIRE(a);
    REQUIRE(b);
    std::vector<std::string> addresses{(*a)->address(), (*b)->address()};
    membership m{1, {0, 1}};
    auto alive = [](uint32_t) { return caf::error{}; };
    host_options o;
    o.chunk_bytes = 64 * 1024; // several chunks in flight
    o.shared_memory_ring = mode == 2;
    auto ca = make_host_communicator(*a, m, addresses, alive, o);
    auto cb = make_host_communicator(*b, m, addresses, alive, o);
    REQUIRE(ca);
    REQUIRE(cb);
    CHECK_FALSE(uses_shared_memory_ring(**ca)); // decided by the first ring operation
    // Sizes around the fragment (32 KiB), the small-message bound and the chunk.
    for (size_t count : {size_t{1}, size_t{8191}, size_t{8193}, size_t{40000}, size_t{300001}}) {
      CAPTURE(count);
      std::vector<float> x(count), y(count);
      for (size_t i = 0; i < count; ++i) {
        x[i] = static_cast<float>(i % 97);
        y[i] = static_cast<float>(i % 89) * 0.5f;
      }
      caf::error ea, eb;
      std::thread t([&] { eb = (*cb)->all_reduce(y.data(), count, dtype::float32, reduce_op::sum); });
      ea = (*ca)->all_reduce(x.data(), count, dtype::float32, reduce_op::sum);
      t.join();
      REQUIRE_FALSE(ea);
      REQUIRE_FALSE(eb);
      size_t wrong = 0;
      for (size_t i = 0; i < count; ++i) {
        const float want = static_cast<float>(i % 97) + static_cast<float>(i % 89) * 0.5f;
        wrong += x[i] != want || y[i] != want;
      }
      CHECK(wrong == 0);
      if (count * 4 > o.small_bytes_max) {
        CHECK(uses_shared_memory_ring(**ca) == (mode == 2));
        CHECK(uses_shared_memory_ring(**cb) == (mode == 2));
      }
    }
  }
}

TEST_CASE("transfer contexts: chunked broadcasts either way, whichever side enters first") {
  auto a = transfer_context(0);
  auto b = transfer_context(1);
  REQUIRE(a);
  REQUIRE(b);
  CHECK((*a)->bulk() == bulk_protocol::eager);
  std::vector<std::string> addresses{(*a)->address(), (*b)->address()};
  membership m{1, {0, 1}};
  auto alive = [](uint32_t) { return caf::error{}; };
  host_options o;
  o.chunk_bytes = 256 * 1024; // 2.5 MB: ten chunks, the last one short
  o.shared_memory_ring = false;
  auto ca = make_host_communicator(*a, m, addresses, alive, o);
  auto cb = make_host_communicator(*b, m, addresses, alive, o);
  REQUIRE(ca);
  REQUIRE(cb);
  const size_t count = 625000 + 3;
  for (int round = 0; round < 4; ++round) {
    CAPTURE(round);
    const size_t root = round % 2;
    // Rounds 2 and 3: the receiver enters late, so the root waits for its
    // word that the receives are posted (nothing is sent before).
    const bool late_receiver = round >= 2;
    std::vector<float> x(count), y(count, -1.0f);
    for (size_t i = 0; i < count; ++i)
      x[i] = static_cast<float>((i * 7 + round) % 1009);
    auto& sender = root == 0 ? *ca : *cb;
    auto& receiver = root == 0 ? *cb : *ca;
    caf::error es, er;
    std::thread t([&] {
      if (late_receiver)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      er = receiver->broadcast(y.data(), count, dtype::float32, root);
    });
    es = sender->broadcast(x.data(), count, dtype::float32, root);
    t.join();
    REQUIRE_FALSE(es);
    REQUIRE_FALSE(er);
    CHECK(std::memcmp(x.data(), y.data(), count * sizeof(float)) == 0);
  }
}

TEST_CASE("a context moves to a fresh worker after a failed communicator or a lost member") {
  auto a = host_context::create(0);
  auto b = host_context::create(1);
  REQUIRE(a);
  REQUIRE(b);
  auto& ctx = **a;
  REQUIRE_FALSE(ctx.prepare({1, {0, 1}}));
  REQUIRE_FALSE((*b)->prepare({1, {0, 1}}));
  CHECK(ctx.renewals() == 0);
  REQUIRE_FALSE(ctx.prepare({2, {0, 1}})); // same members, nothing failed
  CHECK(ctx.renewals() == 0);
  const auto before = ctx.address();
  REQUIRE_FALSE(ctx.prepare({3, {0}})); // member 1 is gone: fresh worker
  CHECK(ctx.renewals() == 1);
  CHECK(ctx.address() != before);
  REQUIRE_FALSE(ctx.prepare({4, {0, 1}})); // a member comes back: nothing to drop
  REQUIRE_FALSE((*b)->prepare({4, {0, 1}}));
  CHECK(ctx.renewals() == 1);

  // A communicator that fails (here: aborted) taints its context.
  auto alive = [](uint32_t) { return caf::error{}; };
  std::vector<std::string> addresses{ctx.address(), (*b)->address()};
  // Only one member builds: building waits for nothing from the peer (a
  // peer that left for a newer epoch must not hold a rebuild).
  const auto t0 = std::chrono::steady_clock::now();
  auto c = make_host_communicator(*a, {4, {0, 1}}, addresses, alive);
  REQUIRE(c);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));
  (*c)->abort(make_error(errc::aborted, "test"));
  std::vector<float> x(16, 1.0f);
  auto e = (*c)->all_reduce(x.data(), x.size(), dtype::float32, reduce_op::sum);
  CHECK(code_of(e) == errc::aborted);
  REQUIRE_FALSE(ctx.prepare({6, {0, 1}}));
  CHECK(ctx.renewals() == 2);
  // The failed communicator still holds its own worker and closes cleanly.
  CHECK(code_of((*c)->poisoned()) == errc::aborted);
  c->reset();
}

TEST_CASE("a build through the coordinator ends at once when a member is lost or it is made moot") {
  using namespace std::chrono_literals;
  // Rank 1 never publishes its address (it went to a newer membership, or
  // died): the build must not wait out the rendezvous timeout (60 s here).
  coordinator_options co;
  co.world_size = 3;
  coordinator coord(co);
  REQUIRE(!coord.start());
  auto client = coordinator_client::connect({"127.0.0.1", coord.port()}, 5000ms);
  REQUIRE(client);
  host_options o;
  o.rendezvous_timeout = 60000ms;
  auto after = [](std::chrono::milliseconds d) {
    return [at = std::chrono::steady_clock::now() + d] { return std::chrono::steady_clock::now() >= at; };
  };
  auto took_s = [](auto t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  SUBCASE("made moot: a newer membership came") {
    auto ctx = host_context::create(0);
    REQUIRE(ctx);
    auto newer = after(300ms);
    build_status moot = [&]() -> caf::error {
      return newer() ? make_error(errc::aborted, "superseded by membership 8") : caf::error{};
    };
    auto t0 = std::chrono::steady_clock::now();
    auto c = make_host_communicator(*ctx, {7, {0, 1}}, *client, {}, o, moot);
    REQUIRE_FALSE(c);
    CHECK(code_of(c.error()) == errc::aborted);
    CHECK(describe(c.error()).find("superseded by membership 8") != std::string::npos);
    CHECK(took_s(t0) < 10.0); // a hang guard: it ends within a slice of the moot
  }
  SUBCASE("a member other than the one awaited is lost") {
    // Rank 2 published; rank 1 is awaited; then rank 2 is found lost.
    REQUIRE(!client->kv_put("epoch/9/host/2", wire::bytes{1, 2, 3}));
    auto ctx = host_context::create(0);
    REQUIRE(ctx);
    auto dead = after(300ms);
    std::atomic<uint32_t> asked_about_2{0};
    peer_status status = [&](uint32_t r) -> caf::error {
      if (r == 2) {
        ++asked_about_2;
        if (dead())
          return make_error(errc::peer_lost, "rank 2 was lost in epoch 9");
      }
      return {};
    };
    auto t0 = std::chrono::steady_clock::now();
    auto c = make_host_communicator(*ctx, {9, {0, 1, 2}}, *client, status, o);
    REQUIRE_FALSE(c);
    CHECK(code_of(c.error()) == errc::peer_lost);
    CHECK(describe(c.error()).find("rank 2 was lost") != std::string::npos);
    CHECK(asked_about_2.load() >= 1);
    CHECK(took_s(t0) < 10.0);
  }
  SUBCASE("nobody says anything: the timeout names the member that never published") {
    auto ctx = host_context::create(0);
    REQUIRE(ctx);
    o.rendezvous_timeout = 400ms;
    auto c = make_host_communicator(*ctx, {11, {0, 1}}, *client, {}, o);
    REQUIRE_FALSE(c);
    CHECK(code_of(c.error()) == errc::timeout);
    CHECK(describe(c.error()).find("rank 1 published no address for membership 11 within 400 ms")
          != std::string::npos);
  }
}
