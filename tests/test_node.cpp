// A worker process for the multi-process transport tests. It joins the mesh
// like `cmesh worker` does, runs one scenario with real actors, reports what
// it saw to the coordinator and waits for the shutdown.
//
//   cmesh_test_node order   <messages>     every rank streams to rank+1
//   cmesh_test_node payload <bytes>        every rank sends one blob to rank+1
//   cmesh_test_node survive <victims...>   watch for the victims' loss, then
//                                          check the survivors still answer
//   cmesh_test_node flood                  rank 0 floods rank 1 (stopped by
//                                          the test) until it is fenced
//   cmesh_test_node inline  <messages>     as order, with both ends published
//                                          with mesh::dispatch::transport and
//                                          every message acknowledged
#include "core/env.hpp"
#include "transport/join.hpp"
#include "transport/mesh.hpp"

#include "core/spawn.hpp"

#include <caf/all.hpp>
#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <atomic>
#include <future>
#include <random>
#include <set>
#include <thread>

using namespace cmesh;
using namespace std::chrono_literals;

namespace {

struct context {
  joined_mesh* j = nullptr;
  mesh* m = nullptr;
  caf::actor_system* sys = nullptr;
  uint32_t rank = 0;
  uint32_t size = 0;

  // Actors are published before the transport starts, so no frame can
  // arrive for a name that does not exist yet.
  void start() {
    if (auto e = j->net->start()) {
      std::fprintf(stderr, "cmesh_test_node: %s\n", describe(e).c_str());
      std::exit(3);
    }
  }

  void report(const std::string& key, const std::string& value) {
    j->coordinator.report({rank, key, value, mono_ns()});
  }
};

// -- order -----------------------------------------------------------------------

int run_order(context& c, uint64_t count) {
  std::promise<std::string> done;
  auto sink = spawn_event_based(*c.sys, [&done, count](caf::event_based_actor* self) -> caf::behavior {
    auto next = std::make_shared<uint64_t>(0);
    return {[=, &done](const wire::sequenced& m) {
      if (m.seq != *next) {
        done.set_value("out of order: expected " + std::to_string(*next) + " got "
                       + std::to_string(m.seq));
        self->quit();
        return;
      }
      if (++*next == count) {
        done.set_value("ok " + std::to_string(count));
        self->quit();
      }
    }};
  });
  c.m->publish("sink", sink);
  c.start();
  c.report("ready", "");
  auto dst = c.m->remote((c.rank + 1) % c.size, "sink");
  {
    caf::scoped_actor self{*c.sys};
    for (uint64_t i = 0; i < count; ++i)
      self->send(dst, wire::sequenced{c.rank, i, 0});
  }
  auto f = done.get_future();
  if (f.wait_for(120s) != std::future_status::ready) {
    c.report("order", "timeout");
    return 1;
  }
  c.report("order", f.get());
  return 0;
}

// -- inline ----------------------------------------------------------------------

// Every rank's "source" streams `count` messages to the "isink" of rank+1
// with a window of 256 unacknowledged ones; the sink checks their order and
// acknowledges each. Both are run on the transport's data thread: the sink's
// acks and the source's later messages are sent from there, the source's
// first window from a CAF worker, so the order check covers a sender that
// changes threads; bursts of acks larger than mesh::inline_burst_max are
// handed back to the scheduler midway.
int run_inline(context& c, uint64_t count) {
  constexpr uint64_t window = 256;
  std::promise<std::string> sunk, acked;
  auto sink = spawn_event_based(*c.sys, [&sunk, count](caf::event_based_actor* self) -> caf::behavior {
    auto next = std::make_shared<uint64_t>(0);
    return {[=, &sunk](const wire::sequenced& m) {
      if (*next > count)
        return;
      if (m.seq != *next) {
        sunk.set_value("out of order: expected " + std::to_string(*next) + " got "
                       + std::to_string(m.seq));
        *next = count + 1;
        return;
      }
      self->send(caf::actor_cast<caf::actor>(self->current_sender()), wire::ack{m.seq, 0});
      if (++*next == count)
        sunk.set_value("ok " + std::to_string(count));
    }};
  });
  auto dst = c.m->remote((c.rank + 1) % c.size, "isink");
  auto source = spawn_event_based(*c.sys, [&acked, count, dst](caf::event_based_actor* self)
                                    -> caf::behavior {
    auto sent = std::make_shared<uint64_t>(0);
    auto next_ack = std::make_shared<uint64_t>(0);
    auto pump = [=] {
      while (*sent < count && *sent < *next_ack + window)
        self->send(dst, wire::sequenced{0, (*sent)++, 0});
    };
    return {[=](caf::atom_value) { pump(); },
            [=, &acked](const wire::ack& a) {
              if (*next_ack > count)
                return;
              if (a.seq != *next_ack) {
                acked.set_value("ack out of order: expected " + std::to_string(*next_ack)
                                + " got " + std::to_string(a.seq));
                *next_ack = count + 1;
                return;
              }
              if (++*next_ack == count) {
                acked.set_value("ok " + std::to_string(count));
                return;
              }
              pump();
            }};
  });
  c.m->publish("isink", sink, mesh::dispatch::transport);
  c.m->publish("source", source, mesh::dispatch::transport);
  c.start();
  c.report("ready", "");
  caf::anon_send(source, caf::atom("go"));
  auto s = sunk.get_future();
  auto a = acked.get_future();
  auto ok = s.wait_for(120s) == std::future_status::ready
            && a.wait_for(60s) == std::future_status::ready;
  c.report("inline", ok ? s.get() + " / " + a.get() : "timeout");
  for (auto& actor : {sink, source})
    caf::anon_send_exit(actor, caf::exit_reason::user_shutdown);
  return ok ? 0 : 1;
}

// -- payload ---------------------------------------------------------------------

int run_payload(context& c, uint64_t bytes) {
  std::promise<std::string> done;
  auto sink = spawn_event_based(*c.sys, [&done](caf::event_based_actor*) -> caf::behavior {
    return {[&done](const wire::blob& b) {
      auto sum = XXH64(b.payload.data(), b.payload.size(), 0);
      done.set_value(sum == b.checksum ? "ok " + std::to_string(b.payload.size())
                                       : "checksum mismatch");
    }};
  });
  c.m->publish("sink", sink);
  c.start();
  c.report("ready", "");
  wire::blob b;
  b.seq = c.rank;
  b.payload = bulk::allocate(bytes);
  std::mt19937_64 rng(c.rank + 1);
  auto* words = reinterpret_cast<uint64_t*>(b.payload.data());
  for (size_t i = 0; i < bytes / 8; ++i)
    words[i] = rng();
  for (size_t i = bytes / 8 * 8; i < bytes; ++i)
    b.payload.data()[i] = static_cast<uint8_t>(rng());
  b.checksum = XXH64(b.payload.data(), b.payload.size(), 0);
  caf::anon_send(c.m->remote((c.rank + 1) % c.size, "sink"), std::move(b));
  auto f = done.get_future();
  if (f.wait_for(120s) != std::future_status::ready) {
    c.report("payload", "timeout");
    return 1;
  }
  c.report("payload", f.get());
  return 0;
}

// -- flood -----------------------------------------------------------------------

// Rank 1 publishes a sink and is stopped by the test; rank 0 watches it and,
// a second after everyone is ready, sends it 64 KiB blobs until its monitor
// fires: the send queue fills, and the peer is fenced with queue_full.
int run_flood(context& c) {
  if (c.rank != 0) {
    auto sink = spawn_event_based(*c.sys, [](caf::event_based_actor*) -> caf::behavior {
      return {[](const wire::blob&) {}};
    });
    c.m->publish("sink", sink);
    c.start();
    c.report("ready", "");
    c.j->coordinator.wait_shutdown(120s);
    caf::anon_send_exit(sink, caf::exit_reason::user_shutdown);
    return 0;
  }
  c.start();
  auto target = c.m->remote(1, "sink");
  auto down = std::make_shared<std::atomic<bool>>(false);
  auto watcher = spawn_event_based(*c.sys, [&c, target, down](caf::event_based_actor* self) {
    self->monitor(target);
    self->set_down_handler([&c, down](caf::down_msg& d) {
      c.report("down", "1 " + std::string(to_string(code_of(d.reason))) + " "
                         + std::to_string(mono_ns()));
      down->store(true);
    });
    return caf::behavior{[](int) {}};
  });
  c.report("ready", "");
  std::this_thread::sleep_for(1s);
  uint64_t sent = 0;
  auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!down->load() && std::chrono::steady_clock::now() < deadline) {
    wire::blob b;
    b.seq = sent++;
    b.payload = bulk::allocate(64 << 10);
    caf::anon_send(target, std::move(b));
  }
  c.report("flood", std::to_string(sent));
  c.j->coordinator.wait_shutdown(120s);
  caf::anon_send_exit(watcher, caf::exit_reason::user_shutdown);
  return 0;
}

// -- survive ---------------------------------------------------------------------

int run_survive(context& c, std::set<uint32_t> victims) {
  if (victims.count(c.rank)) {
    auto echo = spawn_event_based(*c.sys, [](caf::event_based_actor* self) -> caf::behavior {
      return {[=](const wire::sequenced& m) { self->send(caf::actor_cast<caf::actor>(self->current_sender()), wire::ack{m.seq, 0}); }};
    });
    c.m->publish("echo", echo);
    c.start();
    c.report("ready", "");
    c.j->coordinator.wait_shutdown(300s);
    return 0;
  }
  std::promise<void> all_down;
  std::promise<std::string> served;
  std::vector<uint32_t> survivors;
  for (uint32_t r = 0; r < c.size; ++r)
    if (!victims.count(r) && r != c.rank)
      survivors.push_back(r);
  auto echo = spawn_event_based(*c.sys, [](caf::event_based_actor* self) -> caf::behavior {
    return {[=](const wire::sequenced& m) {
      self->send(caf::actor_cast<caf::actor>(self->current_sender()), wire::ack{m.seq, 0});
    }};
  });
  c.m->publish("echo", echo);
  c.start();
  auto watcher = spawn_event_based(*c.sys, [&](caf::event_based_actor* self) {
    auto pending = std::make_shared<size_t>(victims.size());
    auto acks = std::make_shared<size_t>(0);
    for (uint32_t r = 0; r < c.size; ++r) {
      if (r == c.rank)
        continue;
      self->monitor(c.m->remote(r, "echo"));
    }
    self->set_down_handler([=, &all_down, &served, &c](caf::down_msg& d) {
      uint32_t who = ~0u;
      for (uint32_t r = 0; r < c.size; ++r)
        if (r != c.rank && c.m->remote(r, "echo").address() == d.source)
          who = r;
      c.report("down", std::to_string(who) + " " + std::string(to_string(code_of(d.reason))) + " "
                         + std::to_string(mono_ns()));
      if (--*pending == 0) {
        all_down.set_value();
        if (survivors.empty())
          served.set_value("ok 0");
        for (auto r : survivors)
          self->send(c.m->remote(r, "echo"), wire::sequenced{c.rank, r, 0});
      }
    });
    return caf::behavior{[=, &served](const wire::ack&) {
      if (++*acks == survivors.size())
        served.set_value("ok " + std::to_string(*acks));
    }};
  });
  c.report("ready", "");
  auto s = served.get_future();
  if (s.wait_for(120s) != std::future_status::ready) {
    c.report("serving", "timeout");
    caf::anon_send_exit(watcher, caf::exit_reason::user_shutdown);
    return 1;
  }
  c.report("serving", s.get());
  c.j->coordinator.wait_shutdown(120s);
  caf::anon_send_exit(watcher, caf::exit_reason::user_shutdown);
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: cmesh_test_node order|inline|payload|flood|survive ARGS\n");
    return 2;
  }
  std::string scenario = argv[1];
  auto j = join_mesh({});
  if (!j) {
    std::fprintf(stderr, "cmesh_test_node: %s\n", describe(j.error()).c_str());
    return 3;
  }
  caf::actor_system_config cfg;
  tune_actor_system(cfg, 2);
  caf::actor_system sys{cfg};
  int rc = 0;
  {
    mesh m(sys, *j->net);
    context c{&*j, &m, &sys, static_cast<uint32_t>(j->place.rank),
              static_cast<uint32_t>(j->place.world_size)};
    if (scenario == "order") {
      rc = run_order(c, argc > 2 ? std::stoull(argv[2]) : 100000);
    } else if (scenario == "payload") {
      rc = run_payload(c, argc > 2 ? std::stoull(argv[2]) : (size_t{256} << 20));
    } else if (scenario == "inline") {
      rc = run_inline(c, argc > 2 ? std::stoull(argv[2]) : 100000);
    } else if (scenario == "flood") {
      rc = run_flood(c);
    } else if (scenario == "survive") {
      std::set<uint32_t> victims;
      for (int i = 2; i < argc; ++i)
        victims.insert(static_cast<uint32_t>(std::stoul(argv[i])));
      rc = run_survive(c, victims);
    } else {
      std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
      rc = 2;
    }
    if (scenario != "survive" && scenario != "flood")
      c.j->coordinator.wait_shutdown(120s);
    j->net->stop();
  }
  sys.await_all_actors_done();
  return rc;
}
