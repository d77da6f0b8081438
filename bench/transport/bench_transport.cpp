// The transport benchmark: two processes of this host, actor to actor.
//
//   cmesh_bench_transport [all]                          the driver: runs everything below
//                                                        and prints the comparison table
//   cmesh_bench_transport cmesh-node <lat|bw|all|frames> one rank of a 2-process mesh
//                                                        (CMESH_COORDINATOR/RANK/WORLD_SIZE);
//                                                        frames: both measurements on the
//                                                        bare transport, no actors
//   cmesh_bench_transport caf-server <port>              CAF 0.17 echo/sink behind its TCP
//                                                        middleman (port 0: ephemeral, written
//                                                        to $CMESH_BENCH_PORT_FILE)
//   cmesh_bench_transport caf-client <host> <port> <lat|bw|all>
//                                                        measures against caf-server; results
//                                                        also go to $CMESH_BENCH_OUT
//
// Latency: an actor in rank 0 sends a wire::sequenced to the echo actor of
// rank 1 (mesh::remote(1, "echo")), which answers wire::ack to the sender;
// one-way latency = round trip / 2. Bandwidth: rank 0 keeps a window of
// wire::blob messages with one reused 4 MiB bulk payload in flight to the sink
// of rank 1, which acks each; GB/s = 1e9 bytes/s over the acks after warm-up.
// The CAF pair does the same with (atom, uint64) and (atom, std::vector<char>).
//
// The driver runs the cmesh pair once per configuration (the transport's
// CMESH_SPIN_US and the CAF scheduler's idle polling, see configure_scheduler),
// the CAF pair once per scheduler setting used, then the raw UCX anchor
// (../shared/anchors/ucx.sh next to the repository, ucx_perftest), and prints
// one table with the ratios, then `cmesh transport lat_us X`-style lines.
//
// Knobs (environment of the driver): CMESH_BENCH_CONFIGS (SPIN_US:POLL list,
// POLL = cv | default | frames | inline: the actors published with
// mesh::dispatch::transport, run on the data thread;
// "50:frames,50:inline,50:cv,1000:cv,50:default"),
// CMESH_BENCH_ROUNDS (3: cmesh runs and anchor repeated, medians shown),
// CMESH_BENCH_LAT_ITERS (20000),
// CMESH_BENCH_LAT_WARMUP (2000), CMESH_BENCH_BW_MSGS (500), CMESH_BENCH_BW_WARMUP
// (16), CMESH_BENCH_WINDOW (16), CMESH_BENCH_CAF_BW_MSGS (100),
// CMESH_BENCH_TIME_CAP_S (2: a measurement stops early after this long, a
// latency warm-up after a third of it),
// CMESH_BENCH_UCX_ANCHOR (path of ucx.sh), CMESH_BENCH_SKIP_UCX=1,
// CMESH_BENCH_SKIP_CAF=1, CMESH_BENCH_VERBOSE=1 (every figure measured).
#include "common/anchor.hpp"
#include "core/env.hpp"
#include "core/process.hpp"
#include "transport/bootstrap.hpp"
#include "transport/join.hpp"
#include "transport/mesh.hpp"

#include <caf/all.hpp>
#include <caf/io/all.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace cmesh;
using namespace std::chrono_literals;

namespace {

using ping_atom = caf::atom_constant<caf::atom("ping")>;
using pong_atom = caf::atom_constant<caf::atom("pong")>;
using blob_atom = caf::atom_constant<caf::atom("blob")>;
using bye_atom = caf::atom_constant<caf::atom("bye")>;

constexpr size_t payload_bytes = size_t{4} << 20;

// -- parameters ------------------------------------------------------------------

uint64_t env_u64(const char* name, uint64_t fallback) {
  auto v = env_int(name);
  if (!v.error.empty() || !v.value || *v.value <= 0)
    return fallback;
  return static_cast<uint64_t>(*v.value);
}

struct params {
  uint64_t lat_warmup = env_u64("CMESH_BENCH_LAT_WARMUP", 2000);
  uint64_t lat_iters = env_u64("CMESH_BENCH_LAT_ITERS", 20000);
  uint64_t bw_warmup = env_u64("CMESH_BENCH_BW_WARMUP", 16);
  uint64_t bw_msgs = env_u64("CMESH_BENCH_BW_MSGS", 500);
  uint64_t caf_bw_msgs = env_u64("CMESH_BENCH_CAF_BW_MSGS", 100);
  uint64_t window = env_u64("CMESH_BENCH_WINDOW", 16);
  /// The cmesh pairs and the raw UCX anchor run this many times, one after
  /// the other, and the table shows each figure's median: this machine is
  /// shared, and one run of either can land in someone else's busy second.
  uint64_t rounds = env_u64("CMESH_BENCH_ROUNDS", 3);
  /// Each measurement stops early after this long (a slow path must not make
  /// the whole benchmark slow); the figures say how many messages counted.
  int64_t cap_ns = static_cast<int64_t>(env_u64("CMESH_BENCH_TIME_CAP_S", 2)) * 1'000'000'000;
};

/// The CAF scheduler of every benchmark process: two workers, as `cmesh
/// worker` runs them. CMESH_BENCH_CAF_POLL=cv makes idle workers wait on
/// their condition variable right after the aggressive spin instead of
/// polling with 50 us sleeps (CAF's "moderate" stage) for a while.
void configure_scheduler(caf::actor_system_config& cfg) {
  cfg.set("scheduler.max-threads", size_t{2});
  if (env_string("CMESH_BENCH_CAF_POLL").value_or("default") == "cv")
    cfg.set("work-stealing.moderate-poll-attempts", size_t{0});
}

// -- measurement state shared by the cmesh and CAF clients ------------------------

using results = std::map<std::string, double>;

/// Ping-pong bookkeeping: call sent() before each ping and replied() on each
/// pong; replied() says whether to send another.
struct pingpong {
  uint64_t warmup = 0;
  uint64_t iters = 0;
  int64_t cap_ns = 0;
  uint64_t seq = 0; // of the ping in flight
  int64_t sent_ns = 0;
  int64_t first_ns = 0; // of the first ping
  int64_t start_ns = 0; // of the first measured ping
  std::vector<int64_t> rtt_ns;

  pingpong(const params& p) : warmup(p.lat_warmup), iters(p.lat_iters), cap_ns(p.cap_ns) {
    rtt_ns.reserve(iters);
  }

  void sent() {
    sent_ns = mono_ns();
    if (seq == 0)
      first_ns = sent_ns;
    if (seq == warmup)
      start_ns = sent_ns;
  }

  bool replied() {
    auto now = mono_ns();
    if (seq >= warmup)
      rtt_ns.push_back(now - sent_ns);
    else if (now - first_ns > cap_ns / 3)
      warmup = seq + 1; // a slow path: cut the warm-up short as well
    ++seq;
    if (seq > warmup && now - start_ns > cap_ns)
      return false;
    return seq < warmup + iters;
  }

  void summarize(results& out) const {
    if (rtt_ns.empty())
      return;
    auto v = rtt_ns;
    std::sort(v.begin(), v.end());
    double sum = 0;
    for (auto x : v)
      sum += static_cast<double>(x);
    auto pct = [&](double p) {
      auto i = static_cast<size_t>(p * static_cast<double>(v.size() - 1));
      return static_cast<double>(v[i]) / 2e3;
    };
    out["lat_us"] = sum / static_cast<double>(v.size()) / 2e3;
    out["lat_p50_us"] = pct(0.50);
    out["lat_p99_us"] = pct(0.99);
    out["lat_iters"] = static_cast<double>(v.size());
  }
};

/// Windowed streaming bookkeeping: keep up to `window` messages
/// unacknowledged. The warm-up messages are all acknowledged before the
/// measured ones start, so the clock runs from the first measured send to the
/// last ack (pipeline fill and drain included).
struct stream {
  uint64_t warmup = 0;
  uint64_t count = 0;
  uint64_t window = 0;
  int64_t cap_ns = 0;
  bool capped = false; // past the time cap: send no more, drain
  uint64_t sent = 0;
  uint64_t acked = 0;
  int64_t t0 = 0;
  int64_t t1 = 0;
  int64_t last_ack = 0;
  std::vector<int64_t> gaps_ns; // between measured acks

  stream(const params& p, uint64_t messages)
      : warmup(p.bw_warmup), count(messages), window(p.window), cap_ns(p.cap_ns) {}

  uint64_t total() const { return warmup + count; }
  /// How many to send now (at the start, or after an ack).
  uint64_t to_send() const {
    if (capped)
      return 0;
    auto phase_end = acked < warmup ? warmup : total();
    auto limit = std::min(phase_end, acked + window);
    return limit > sent ? limit - sent : 0;
  }
  /// Records one ack; true when the last one came.
  bool on_ack() {
    ++acked;
    auto now = mono_ns();
    if (acked > warmup)
      gaps_ns.push_back(now - last_ack);
    last_ack = now;
    if (acked == warmup)
      t0 = now;
    if (acked > warmup && !capped && now - t0 > cap_ns)
      capped = true;
    if (acked == total() || (capped && acked == sent)) {
      t1 = now;
      count = acked - warmup;
      return true;
    }
    return false;
  }
  void summarize(results& out, size_t bytes) const {
    if (t1 <= t0)
      return;
    out["bw_GBps"] = static_cast<double>(count) * static_cast<double>(bytes)
                     / static_cast<double>(t1 - t0);
    out["bw_msgs"] = static_cast<double>(count);
    if (!gaps_ns.empty()) {
      auto g = gaps_ns;
      std::sort(g.begin(), g.end());
      out["bw_gap_p50_us"] = static_cast<double>(g[g.size() / 2]) / 1e3;
      out["bw_gap_max_us"] = static_cast<double>(g.back()) / 1e3;
      double stalls = 0, stall_ns = 0;
      for (auto x : g)
        if (x > 5'000'000) {
          ++stalls;
          stall_ns += static_cast<double>(x);
        }
      out["bw_stalls_over_5ms"] = stalls;
      out["bw_stall_ms"] = stall_ns / 1e6;
    }
  }
};

/// Both ranks get the coordinator's shutdown at about the same time; each
/// lingers a moment so that the other has called begin_shutdown() before its
/// endpoints close (else the other logs the expected departure as a loss).
void leave(transport& net) {
  net.begin_shutdown();
  std::this_thread::sleep_for(100ms);
  net.stop();
}

/// The outcome of an actor-driven measurement, handed to the main thread.
struct outcome {
  std::string error; // empty: ok
  results values;
};

using outcome_promise = std::shared_ptr<std::promise<outcome>>;

/// Waits for a measurement; a timeout is an error.
outcome await(std::future<outcome>& f, std::chrono::seconds limit, const char* what) {
  if (f.wait_for(limit) != std::future_status::ready)
    return {std::string(what) + ": no result within " + std::to_string(limit.count()) + " s", {}};
  return f.get();
}

// -- cmesh ranks -------------------------------------------------------------------

/// Rank 0's latency client: ping-pong with the echo actor of rank 1.
caf::behavior cmesh_pinger(caf::event_based_actor* self, caf::actor echo, params p,
                           outcome_promise done) {
  auto st = std::make_shared<pingpong>(p);
  auto finished = std::make_shared<bool>(false);
  auto finish = [=](std::string err) {
    if (*finished)
      return;
    *finished = true;
    outcome o{std::move(err), {}};
    st->summarize(o.values);
    done->set_value(std::move(o));
    self->quit();
  };
  self->monitor(echo);
  self->set_down_handler([=](caf::down_msg& d) { finish("echo went down: " + describe(d.reason)); });
  st->sent();
  self->send(echo, wire::sequenced{0, 0, st->sent_ns});
  return {[=](const wire::ack& a) {
    if (a.seq != st->seq) {
      finish("ack " + std::to_string(a.seq) + " for ping " + std::to_string(st->seq));
      return;
    }
    if (!st->replied()) {
      finish({});
      return;
    }
    st->sent();
    self->send(echo, wire::sequenced{0, st->seq, st->sent_ns});
  }};
}

/// Rank 0's bandwidth client: a window of blobs sharing one bulk buffer.
caf::behavior cmesh_streamer(caf::event_based_actor* self, caf::actor sink, params p,
                             outcome_promise done) {
  auto st = std::make_shared<stream>(p, p.bw_msgs);
  auto buf = bulk::allocate(payload_bytes);
  std::memset(buf.data(), 0x5a, buf.size()); // touch every page once, here
  auto finished = std::make_shared<bool>(false);
  auto finish = [=](std::string err) {
    if (*finished)
      return;
    *finished = true;
    outcome o{std::move(err), {}};
    st->summarize(o.values, payload_bytes);
    done->set_value(std::move(o));
    self->quit();
  };
  auto pump = [=] {
    for (auto n = st->to_send(); n > 0; --n)
      self->send(sink, wire::blob{st->sent++, 0, buf});
  };
  self->monitor(sink);
  self->set_down_handler([=](caf::down_msg& d) { finish("sink went down: " + describe(d.reason)); });
  pump();
  return {[=](const wire::ack& a) {
    if (a.value != payload_bytes) {
      finish("sink got " + std::to_string(a.value) + " bytes, expected "
             + std::to_string(payload_bytes));
      return;
    }
    if (st->on_ack()) {
      finish({});
      return;
    }
    pump();
  }};
}

/// The same two measurements on the bare transport, without actors: the
/// frame handlers run on the transport's data thread, rank 1 answers from
/// there and rank 0 sends its next message from there. Separates the cost of
/// the transport from that of the CAF hop on either side.
struct frames_client {
  transport& net;
  params p;
  pingpong ping;
  stream flow;
  bulk buf;
  bool streaming = false;
  bool finished = false;
  std::promise<outcome> done;

  frames_client(transport& n, params ps)
      : net(n), p(ps), ping(ps), flow(ps, ps.bw_msgs), buf(bulk::allocate(payload_bytes)) {
    std::memset(buf.data(), 0x5a, buf.size());
  }

  void finish(std::string err) {
    if (finished)
      return;
    finished = true;
    outcome o{std::move(err), {}};
    ping.summarize(o.values);
    flow.summarize(o.values, payload_bytes);
    done.set_value(std::move(o));
  }

  void check(const caf::error& e) {
    if (e)
      finish("send: " + describe(e));
  }

  void send_ping() {
    ping.sent();
    check(net.send_message(1, {}, wire::sequenced{0, ping.seq, ping.sent_ns}));
  }

  void pump() {
    for (auto n = flow.to_send(); n > 0 && !finished; --n)
      check(net.send_message(1, {}, wire::blob{flow.sent++, 0, buf}));
  }

  // On the data thread.
  void on_frame(inbound_frame&& f) {
    if (finished || f.header.kind != wire::ack::kind)
      return;
    auto a = wire::decode_body<wire::ack>(f.body());
    if (!a) {
      finish("undecodable ack: " + describe(a.error()));
      return;
    }
    if (!streaming) {
      if (a->seq != ping.seq) {
        finish("ack " + std::to_string(a->seq) + " for ping " + std::to_string(ping.seq));
        return;
      }
      if (ping.replied()) {
        send_ping();
        return;
      }
      streaming = true;
      pump();
      return;
    }
    if (a->value != payload_bytes) {
      finish("rank 1 got " + std::to_string(a->value) + " bytes");
      return;
    }
    if (flow.on_ack())
      finish({});
    else
      pump();
  }
};

int cmesh_frames(joined_mesh& j, uint32_t rank,
                 const std::function<void(const std::string&, const std::string&)>& report) {
  params p;
  std::unique_ptr<frames_client> client;
  if (rank == 1) {
    auto* net = j.net.get();
    net->set_handlers(
      [net](inbound_frame&& f) {
        wire::ack reply;
        if (f.header.kind == wire::sequenced::kind) {
          auto m = wire::decode_body<wire::sequenced>(f.body());
          reply = {m ? m->seq : ~uint64_t{0}, 0};
        } else if (f.header.kind == wire::blob::kind) {
          auto m = wire::decode_body<wire::blob>(f.body());
          reply = {m ? m->seq : ~uint64_t{0}, f.payload.size()};
        } else {
          return;
        }
        (void)net->send_message(0, {}, reply);
      },
      [](uint32_t, const caf::error&) {});
  } else {
    client = std::make_unique<frames_client>(*j.net, p);
    auto* c = client.get();
    j.net->set_handlers([c](inbound_frame&& f) { c->on_frame(std::move(f)); },
                        [c](uint32_t, const caf::error& e) { c->finish("rank 1 lost: " + describe(e)); });
  }
  if (auto e = j.net->start()) {
    std::fprintf(stderr, "cmesh-node %u: %s\n", rank, describe(e).c_str());
    return 3;
  }
  report("ready", "");
  int rc = 0;
  if (rank == 0) {
    // Frames sent before rank 1 started wait in UCX; the warm-up absorbs that.
    auto f = client->done.get_future();
    client->send_ping();
    auto o = await(f, 60s, "frames");
    for (auto& [k, v] : o.values)
      report(k, std::to_string(v));
    report("done", o.error.empty() ? "ok" : o.error);
    rc = o.error.empty() ? 0 : 1;
  }
  auto bye = j.coordinator.wait_shutdown(120s);
  leave(*j.net); // joins the data thread: no handler runs after this
  return bye ? rc : (rc ? rc : 1);
}

int cmesh_node(const std::string& mode) {
  if (mode != "lat" && mode != "bw" && mode != "all" && mode != "frames") {
    std::fprintf(stderr, "cmesh-node: mode must be lat, bw, all or frames\n");
    return 2;
  }
  auto j = join_mesh({});
  if (!j) {
    std::fprintf(stderr, "cmesh-node: %s\n", describe(j.error()).c_str());
    return 3;
  }
  const auto rank = static_cast<uint32_t>(j->place.rank);
  if (j->place.world_size != 2 || rank > 1) {
    std::fprintf(stderr, "cmesh-node: needs a world of 2\n");
    return 2;
  }
  auto report = [&](const std::string& key, const std::string& value) {
    if (auto e = j->coordinator.report({rank, key, value, mono_ns()}))
      std::fprintf(stderr, "cmesh-node %u: report failed: %s\n", rank, describe(e).c_str());
  };
  if (mode == "frames")
    return cmesh_frames(*j, rank, report);
  params p;
  caf::actor_system_config cfg;
  configure_scheduler(cfg);
  caf::actor_system sys{cfg};
  const auto how = env_string("CMESH_BENCH_DISPATCH").value_or("scheduled") == "transport"
                     ? mesh::dispatch::transport
                     : mesh::dispatch::scheduled;
  int rc = 0;
  {
    mesh m(sys, *j->net);
    std::vector<caf::actor> mine;
    if (rank == 1) {
      // Published before the transport starts: no frame finds them missing.
      auto echo = sys.spawn([](caf::event_based_actor* self) -> caf::behavior {
        return {[=](const wire::sequenced& s) {
          self->send(caf::actor_cast<caf::actor>(self->current_sender()), wire::ack{s.seq, 0});
        }};
      });
      auto sink = sys.spawn([](caf::event_based_actor* self) -> caf::behavior {
        return {[=](const wire::blob& b) {
          self->send(caf::actor_cast<caf::actor>(self->current_sender()),
                     wire::ack{b.seq, b.payload.size()});
        }};
      });
      m.publish("echo", echo, how);
      m.publish("sink", sink, how);
      mine = {echo, sink};
    }
    if (auto e = j->net->start()) {
      std::fprintf(stderr, "cmesh-node %u: %s\n", rank, describe(e).c_str());
      return 3;
    }
    report("ready", "");
    if (rank == 0) {
      std::string error;
      results all;
      auto run = [&](auto behavior_fn, const char* peer, std::chrono::seconds limit) {
        auto done = std::make_shared<std::promise<outcome>>();
        auto f = done->get_future();
        auto dst = m.remote(1, peer);
        // The mesh names unpublished senders by a weak reference: hold the
        // client, or the replies would find it gone.
        auto client = sys.spawn(
          [=](caf::event_based_actor* self) { return behavior_fn(self, dst, p, done); });
        m.publish(std::string("client_") + peer, client, how);
        auto o = await(f, limit, peer);
        caf::anon_send_exit(client, caf::exit_reason::user_shutdown);
        if (!o.error.empty() && error.empty())
          error = o.error;
        all.insert(o.values.begin(), o.values.end());
      };
      if (mode != "bw")
        run(cmesh_pinger, "echo", 60s);
      if (mode != "lat" && error.empty())
        run(cmesh_streamer, "sink", 60s);
      auto ts = j->net->stats();
      all["frames_sent"] = static_cast<double>(ts.frames_sent);
      for (auto& [k, v] : all)
        report(k, std::to_string(v));
      report("done", error.empty() ? "ok" : error);
      rc = error.empty() ? 0 : 1;
    }
    auto bye = j->coordinator.wait_shutdown(120s);
    for (auto& a : mine)
      caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    if (!bye)
      rc = rc ? rc : 1;
    leave(*j->net);
  }
  sys.await_all_actors_done();
  return rc;
}

// -- CAF TCP middleman -------------------------------------------------------------

caf::actor_system_config& caf_config(caf::actor_system_config& cfg) {
  cfg.load<caf::io::middleman>();
  configure_scheduler(cfg);
  return cfg;
}

int caf_server(uint16_t port) {
  caf::actor_system_config cfg;
  caf::actor_system sys{caf_config(cfg)};
  auto bye = std::make_shared<std::promise<void>>();
  auto f = bye->get_future();
  auto srv = sys.spawn([bye](caf::event_based_actor* self) -> caf::behavior {
    return {
      [=](ping_atom, uint64_t seq) {
        self->send(caf::actor_cast<caf::actor>(self->current_sender()), pong_atom::value, seq);
      },
      [=](blob_atom, const std::vector<char>& data) {
        self->send(caf::actor_cast<caf::actor>(self->current_sender()), pong_atom::value,
                   static_cast<uint64_t>(data.size()));
      },
      [=](bye_atom) {
        bye->set_value();
        self->quit();
      },
    };
  });
  auto bound = sys.middleman().publish(srv, port, "127.0.0.1");
  if (!bound) {
    std::fprintf(stderr, "caf-server: publish failed: %s\n", sys.render(bound.error()).c_str());
    caf::anon_send_exit(srv, caf::exit_reason::user_shutdown);
    return 3;
  }
  if (auto path = env_string("CMESH_BENCH_PORT_FILE")) {
    auto tmp = *path + ".tmp";
    std::ofstream(tmp) << *bound << "\n";
    std::filesystem::rename(tmp, *path);
  }
  int rc = 0;
  if (f.wait_for(300s) != std::future_status::ready) {
    std::fprintf(stderr, "caf-server: no client said bye within 300 s\n");
    rc = 1;
  }
  caf::anon_send_exit(srv, caf::exit_reason::user_shutdown);
  sys.middleman().unpublish(srv, *bound);
  return rc;
}

caf::behavior caf_pinger(caf::event_based_actor* self, caf::actor srv, params p,
                         outcome_promise done) {
  auto st = std::make_shared<pingpong>(p);
  auto finished = std::make_shared<bool>(false);
  auto finish = [=](std::string err) {
    if (*finished)
      return;
    *finished = true;
    outcome o{std::move(err), {}};
    st->summarize(o.values);
    done->set_value(std::move(o));
    self->quit();
  };
  self->monitor(srv);
  self->set_down_handler([=](caf::down_msg& d) {
    finish("server went down: " + self->system().render(d.reason));
  });
  st->sent();
  self->send(srv, ping_atom::value, uint64_t{0});
  return {[=](pong_atom, uint64_t seq) {
    if (seq != st->seq) {
      finish("pong " + std::to_string(seq) + " for ping " + std::to_string(st->seq));
      return;
    }
    if (!st->replied()) {
      finish({});
      return;
    }
    st->sent();
    self->send(srv, ping_atom::value, st->seq);
  }};
}

caf::behavior caf_streamer(caf::event_based_actor* self, caf::actor srv, params p,
                           outcome_promise done) {
  auto st = std::make_shared<stream>(p, p.caf_bw_msgs);
  // One message, built once: CAF messages are copy-on-write, so every send
  // shares this vector until the middleman serializes it.
  auto msg = caf::make_message(blob_atom::value, std::vector<char>(payload_bytes, 'z'));
  auto finished = std::make_shared<bool>(false);
  auto finish = [=](std::string err) {
    if (*finished)
      return;
    *finished = true;
    outcome o{std::move(err), {}};
    st->summarize(o.values, payload_bytes);
    done->set_value(std::move(o));
    self->quit();
  };
  auto pump = [=] {
    for (auto n = st->to_send(); n > 0; --n, ++st->sent)
      self->send(srv, msg);
  };
  self->monitor(srv);
  self->set_down_handler([=](caf::down_msg& d) {
    finish("server went down: " + self->system().render(d.reason));
  });
  pump();
  return {[=](pong_atom, uint64_t size) {
    if (size != payload_bytes) {
      finish("server got " + std::to_string(size) + " bytes");
      return;
    }
    if (st->on_ack()) {
      finish({});
      return;
    }
    pump();
  }};
}

int caf_client(const std::string& host, uint16_t port, const std::string& mode) {
  if (mode != "lat" && mode != "bw" && mode != "all") {
    std::fprintf(stderr, "caf-client: mode must be lat, bw or all\n");
    return 2;
  }
  caf::actor_system_config cfg;
  caf::actor_system sys{caf_config(cfg)};
  caf::actor srv;
  auto deadline = mono_ns() + 10'000'000'000;
  std::string last;
  while (!srv && mono_ns() < deadline) {
    auto r = sys.middleman().remote_actor(host, port);
    if (r) {
      srv = *r;
    } else {
      last = sys.render(r.error());
      std::this_thread::sleep_for(50ms);
    }
  }
  if (!srv) {
    std::fprintf(stderr, "caf-client: cannot reach %s:%u: %s\n", host.c_str(), port, last.c_str());
    return 3;
  }
  params p;
  std::string error;
  results all;
  auto run = [&](auto behavior_fn, const char* what, std::chrono::seconds limit) {
    auto done = std::make_shared<std::promise<outcome>>();
    auto f = done->get_future();
    auto client = sys.spawn(
      [=](caf::event_based_actor* self) { return behavior_fn(self, srv, p, done); });
    auto o = await(f, limit, what);
    caf::anon_send_exit(client, caf::exit_reason::user_shutdown);
    if (!o.error.empty() && error.empty())
      error = o.error;
    all.insert(o.values.begin(), o.values.end());
  };
  if (mode != "bw")
    run(caf_pinger, "caf latency", 60s);
  if (mode != "lat" && error.empty())
    run(caf_streamer, "caf bandwidth", 60s);
  caf::anon_send(srv, bye_atom::value);
  std::ostringstream text;
  for (auto& [k, v] : all)
    text << k << " " << v << "\n";
  text << "done " << (error.empty() ? "ok" : error) << "\n";
  if (auto path = env_string("CMESH_BENCH_OUT")) {
    auto tmp = *path + ".tmp";
    std::ofstream(tmp) << text.str();
    std::filesystem::rename(tmp, *path);
  } else {
    std::fputs(text.str().c_str(), stdout);
  }
  // Let the bye leave before the middleman shuts down.
  std::this_thread::sleep_for(100ms);
  return error.empty() ? 0 : 1;
}

// -- driver ------------------------------------------------------------------------

std::string self_exe() {
  char buf[4096];
  auto n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("cmesh_bench_transport");
}

double seconds_since(int64_t t0) {
  return static_cast<double>(mono_ns() - t0) / 1e9;
}

/// Waits for every child, killing the ones still running after `limit`;
/// returns how many had to be killed.
int reap_all(std::vector<child_process>& kids, std::chrono::milliseconds limit) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  int killed = 0;
  for (auto& k : kids) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
    if (!k.running())
      continue;
    if (!k.wait(std::max(left, std::chrono::milliseconds(1)))) {
      k.kill_and_reap();
      ++killed;
    }
  }
  return killed;
}

/// One cmesh pair with CMESH_SPIN_US = spin_us, CMESH_BENCH_CAF_POLL = poll
/// and CMESH_BENCH_DISPATCH = dispatch; results or an error text.
outcome run_cmesh(int64_t spin_us, const std::string& poll, const std::string& mode,
                  const std::string& dispatch) {
  coordinator coord({"127.0.0.1", 0, 2});
  if (auto e = coord.start())
    return {"coordinator: " + describe(e), {}};
  std::vector<child_process> kids;
  int killed = 0;
  auto cleanup = [&] {
    coord.broadcast_shutdown(0, "benchmark over");
    killed = reap_all(kids, 5s);
    coord.stop();
  };
  for (uint32_t r = 0; r < 2; ++r) {
    std::string err;
    auto c = child_process::spawn(
      self_exe(), {"cmesh-node", mode},
      {{"CMESH_COORDINATOR", "127.0.0.1:" + std::to_string(coord.port())},
       {"CMESH_RANK", std::to_string(r)},
       {"CMESH_WORLD_SIZE", "2"},
       {"CMESH_SPIN_US", std::to_string(spin_us)},
       {"CMESH_BENCH_CAF_POLL", poll},
       {"CMESH_BENCH_DISPATCH", dispatch}},
      &err);
    if (c.pid() <= 0) {
      cleanup();
      return {"spawn: " + err, {}};
    }
    kids.push_back(std::move(c));
  }
  // Rank 0 reports "done" last; poll so that a dead child fails fast.
  auto deadline = std::chrono::steady_clock::now() + 150s;
  std::optional<wire::report> done;
  std::string error;
  while (!done && error.empty()) {
    done = coord.wait_report(
      [](const wire::report& r) { return r.rank == 0 && r.key == "done"; }, 200ms);
    if (done)
      break;
    for (size_t r = 0; r < kids.size(); ++r)
      if (auto st = kids[r].poll())
        error = "rank " + std::to_string(r) + " exited early: " + describe_wait_status(*st);
    if (std::chrono::steady_clock::now() > deadline)
      error = "no result within 150 s";
  }
  outcome o;
  if (done && done->value != "ok")
    error = done->value;
  o.error = error;
  for (auto& r : coord.reports())
    if (r.rank == 0 && r.key != "done" && r.key != "ready")
      o.values[r.key] = std::atof(r.value.c_str());
  auto t_results = mono_ns();
  cleanup();
  o.values["driver_shutdown_s"] = seconds_since(t_results);
  o.values["driver_killed"] = killed;
  return o;
}

outcome run_caf(const std::string& poll, const std::string& mode) {
  auto dir = std::filesystem::temp_directory_path()
             / ("cmesh_bench_" + std::to_string(getpid()) + "_" + std::to_string(mono_ns()));
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    return {"cannot create " + dir.string() + ": " + ec.message(), {}};
  auto port_file = (dir / "port").string();
  auto out_file = (dir / "out").string();
  std::vector<child_process> kids;
  auto finish = [&](outcome o) {
    reap_all(kids, 5s);
    std::filesystem::remove_all(dir, ec);
    return o;
  };
  std::string err;
  kids.push_back(child_process::spawn(
    self_exe(), {"caf-server", "0"},
    {{"CMESH_BENCH_PORT_FILE", port_file}, {"CMESH_BENCH_CAF_POLL", poll}}, &err));
  if (kids.back().pid() <= 0)
    return finish({"spawn caf-server: " + err, {}});
  // Wait for the server's port.
  std::string port;
  for (auto deadline = mono_ns() + 15'000'000'000; port.empty();) {
    if (std::filesystem::exists(port_file))
      std::ifstream(port_file) >> port;
    if (!port.empty())
      break;
    if (auto st = kids[0].poll())
      return finish({"caf-server exited: " + describe_wait_status(*st), {}});
    if (mono_ns() > deadline)
      return finish({"caf-server did not publish within 15 s", {}});
    std::this_thread::sleep_for(20ms);
  }
  kids.push_back(child_process::spawn(
    self_exe(), {"caf-client", "127.0.0.1", port, mode},
    {{"CMESH_BENCH_OUT", out_file}, {"CMESH_BENCH_CAF_POLL", poll}}, &err));
  if (kids.back().pid() <= 0)
    return finish({"spawn caf-client: " + err, {}});
  auto st = kids[1].wait(150s);
  if (!st)
    return finish({"caf-client did not finish within 150 s", {}});
  outcome o;
  std::ifstream in(out_file);
  std::string key;
  while (in >> key) {
    if (key == "done") {
      std::string rest;
      std::getline(in, rest);
      if (rest != " ok")
        o.error = rest.empty() ? "caf-client failed" : rest.substr(1);
    } else {
      double v = 0;
      in >> v;
      o.values[key] = v;
    }
  }
  if (o.values.empty() && o.error.empty())
    o.error = "caf-client: " + describe_wait_status(*st) + ", no results";
  return finish(o);
}

struct ucx_anchor {
  std::string error;
  std::map<std::string, double> values; // "plain tag_lat_us" -> x
  std::vector<std::string> lines;
};

std::string anchor_path() {
  if (auto p = env_string("CMESH_BENCH_UCX_ANCHOR"))
    return *p;
  // $(git rev-parse --show-toplevel)/../shared/anchors/ucx.sh, found without
  // git: walk up from the binary (build/bin) and the working directory.
  std::vector<std::filesystem::path> starts{self_exe_dir(), std::filesystem::current_path()};
  for (auto dir : starts) {
    for (int i = 0; i < 6 && !dir.empty(); ++i, dir = dir.parent_path()) {
      if (std::filesystem::exists(dir / ".git")) {
        auto p = dir.parent_path() / "shared" / "anchors" / "ucx.sh";
        if (std::filesystem::exists(p))
          return p.string();
      }
      if (dir == dir.parent_path())
        break;
    }
  }
  return "/work/shared/anchors/ucx.sh";
}

ucx_anchor run_ucx() {
  ucx_anchor a;
  auto run = bench::run_anchor_script(anchor_path(), 150);
  a.lines = run.lines;
  if (!run.error.empty()) {
    a.error = run.error;
    return a;
  }
  for (const auto& line : a.lines) {
    std::istringstream in(line);
    std::string tool, mode, key, value;
    if (in >> tool >> mode >> key >> value && tool == "ucx")
      if (auto v = bench::parse_number(value))
        a.values[mode + " " + key] = *v;
  }
  if (a.values.empty())
    a.error = "anchor gave no figures (" + describe_wait_status(run.status)
              + "; is ucx-utils installed? apt-get install -y ucx-utils)";
  return a;
}

/// Each key's median over the runs that measured it; the first error.
results median_values(const std::vector<const results*>& runs) {
  std::map<std::string, std::vector<double>> all;
  for (auto* r : runs)
    for (auto& [k, v] : *r)
      if (std::isfinite(v))
        all[k].push_back(v);
  results out;
  for (auto& [k, v] : all) {
    std::sort(v.begin(), v.end());
    auto n = v.size();
    out[k] = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  }
  return out;
}

/// A run (outcome, ucx_anchor) whose values are the medians of `runs` and
/// whose error is their first.
template <class Run>
Run median_run(const std::vector<Run>& runs) {
  Run out;
  std::vector<const results*> vals;
  for (auto& r : runs) {
    vals.push_back(&r.values);
    if (out.error.empty())
      out.error = r.error;
  }
  out.values = median_values(vals);
  return out;
}

outcome median_of(const std::vector<outcome>& runs) {
  return median_run(runs);
}

ucx_anchor median_of(const std::vector<ucx_anchor>& runs) {
  auto a = median_run(runs);
  for (auto& [k, v] : a.values) // "plain tag_lat_us" -> "ucx plain tag_lat_us X"
    a.lines.push_back(fmt::format("ucx {} {:.3f}", k, v));
  if (a.values.empty() && a.error.empty())
    a.error = "no anchor run";
  return a;
}

std::optional<double> get(const results& r, const std::string& key) {
  auto i = r.find(key);
  if (i == r.end() || !std::isfinite(i->second))
    return std::nullopt;
  return i->second;
}

std::string fmt_num(std::optional<double> v, int prec = 2) {
  if (!v)
    return "n/a";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", prec, *v);
  return buf;
}

std::optional<double> ratio(std::optional<double> a, std::optional<double> b) {
  if (!a || !b || *b == 0)
    return std::nullopt;
  return *a / *b;
}

std::string spin_label(int64_t us) {
  return us >= 1000 && us % 1000 == 0 ? std::to_string(us / 1000) + "ms"
                                      : std::to_string(us) + "us";
}

/// One cmesh configuration: the transport's spin and the CAF scheduler's
/// polling, or poll "frames": the bare transport without actors.
struct cmesh_config {
  int64_t spin_us = 50;
  std::string poll = "cv";
  bool frames() const { return poll == "frames"; }
  /// Actors published with mesh::dispatch::transport (CAF scheduler "cv").
  bool on_lane() const { return poll == "inline"; }
  /// The CAF scheduler setting of the run.
  std::string caf_poll() const { return frames() || on_lane() ? "cv" : poll; }
  std::string name() const {
    return frames()    ? "frames_spin" + spin_label(spin_us)
           : on_lane() ? "spin" + spin_label(spin_us) + "_inline"
                       : "spin" + spin_label(spin_us) + "_caf" + poll;
  }
  std::string what() const {
    return frames() ? "no actors" : on_lane() ? "on transport" : "caf " + poll;
  }
};

/// CMESH_BENCH_CONFIGS: comma-separated SPIN_US:POLL, POLL = cv | default |
/// frames | inline (actors dispatched on the transport's data thread).
std::vector<cmesh_config> cmesh_configs() {
  std::vector<cmesh_config> out;
  std::istringstream in(
    env_string("CMESH_BENCH_CONFIGS").value_or("50:frames,50:inline,50:cv,1000:cv,50:default"));
  std::string item;
  while (std::getline(in, item, ',')) {
    if (item.empty())
      continue;
    cmesh_config c;
    auto colon = item.find(':');
    c.spin_us = std::atoll(item.substr(0, colon).c_str());
    if (colon != std::string::npos) {
      auto poll = item.substr(colon + 1);
      c.poll = poll == "default" || poll == "frames" || poll == "inline" ? poll : "cv";
    }
    out.push_back(c);
  }
  if (out.empty())
    out.push_back({});
  return out;
}

bool env_flag(const char* name) {
  return env_string(name).value_or("0") == "1";
}

void note_run(const std::string& what, double secs, const outcome& o) {
  std::printf("  %s: %.1f s%s%s\n", what.c_str(), secs, o.error.empty() ? "" : ", ERROR: ",
              o.error.c_str());
  std::fflush(stdout);
}

int driver() {
  params p;
  auto configs = cmesh_configs();
  std::printf("cmesh transport benchmark: 2 processes on this host (%u cores)\n",
              std::thread::hardware_concurrency());
  std::printf("  latency: %llu round trips after %llu warm-up (cmesh: wire::sequenced -> "
              "wire::ack; CAF: (atom, u64) both ways), one-way = RTT / 2\n",
              static_cast<unsigned long long>(p.lat_iters),
              static_cast<unsigned long long>(p.lat_warmup));
  std::printf("  bandwidth: 4 MiB messages, window %llu, %llu (cmesh) / %llu (CAF) after %llu "
              "warm-up\n",
              static_cast<unsigned long long>(p.window), static_cast<unsigned long long>(p.bw_msgs),
              static_cast<unsigned long long>(p.caf_bw_msgs),
              static_cast<unsigned long long>(p.bw_warmup));
  std::printf("  every measurement stops after %.1f s (a latency warm-up after %.1f s): slow "
              "configurations count fewer messages\n",
              static_cast<double>(p.cap_ns) / 1e9, static_cast<double>(p.cap_ns) / 3e9);
  std::printf("  %llu rounds of the cmesh runs and the raw UCX anchor, one after the other: every "
              "figure is the median over the rounds (CAF: one round)\n",
              static_cast<unsigned long long>(p.rounds));
  std::printf("  CAF scheduler: 2 workers; 'caf cv' = idle workers wait on a condition variable "
              "(work-stealing.moderate-poll-attempts=0), 'caf default' = CAF's 50 us sleep polling\n");
  std::fflush(stdout);
  int failures = 0;

  // Rounds: every cmesh configuration, then the raw UCX anchor, again and
  // again; each figure is the median over the rounds.
  std::vector<std::vector<outcome>> cm_rounds(configs.size());
  std::vector<ucx_anchor> ucx_rounds;
  for (uint64_t round = 1; round <= p.rounds; ++round) {
    for (size_t i = 0; i < configs.size(); ++i) {
      auto& c = configs[i];
      auto t0 = mono_ns();
      cm_rounds[i].push_back(run_cmesh(c.spin_us, c.caf_poll(), c.frames() ? "frames" : "all",
                                       c.on_lane() ? "transport" : "scheduled"));
      note_run("round " + std::to_string(round) + ": cmesh, CMESH_SPIN_US="
                 + std::to_string(c.spin_us) + ", " + c.what(),
               seconds_since(t0), cm_rounds[i].back());
      failures += !cm_rounds[i].back().error.empty();
    }
    if (env_flag("CMESH_BENCH_SKIP_UCX"))
      continue;
    auto t0 = mono_ns();
    ucx_rounds.push_back(run_ucx());
    std::printf("  round %llu: raw UCX anchor: %.1f s%s%s\n",
                static_cast<unsigned long long>(round), seconds_since(t0),
                ucx_rounds.back().error.empty() ? "" : ", ", ucx_rounds.back().error.c_str());
  }
  std::vector<outcome> cm;
  for (auto& runs : cm_rounds)
    cm.push_back(median_of(runs));
  // CAF's TCP middleman under every scheduler setting the cmesh runs used.
  std::map<std::string, outcome> caf;
  for (auto& c : configs) {
    if (c.frames() || caf.count(c.caf_poll()) || env_flag("CMESH_BENCH_SKIP_CAF"))
      continue;
    auto poll = c.caf_poll();
    auto t0 = mono_ns();
    caf[poll] = run_caf(poll, "all");
    note_run("CAF TCP middleman, caf " + poll, seconds_since(t0), caf[poll]);
    failures += !caf[poll].error.empty();
  }
  ucx_anchor ucx = env_flag("CMESH_BENCH_SKIP_UCX")
                     ? ucx_anchor{"anchor skipped (CMESH_BENCH_SKIP_UCX=1)", {}, {}}
                     : median_of(ucx_rounds);
  // ucx_perftest reports MB/s with MB = 2^20 bytes, and the anchor divides
  // that by 1000: its "GBps" are 1.048576e9 bytes/s. The table uses 1e9.
  constexpr double anchor_gb = 1.048576;
  auto ucx_get = [&](const std::string& k) -> std::optional<double> {
    auto i = ucx.values.find(k);
    if (i == ucx.values.end())
      return std::nullopt;
    return k.find("_GBps") != std::string::npos ? i->second * anchor_gb : i->second;
  };
  auto caf_get = [&](const std::string& poll, const std::string& key) -> std::optional<double> {
    auto i = caf.find(poll);
    return i == caf.end() ? std::nullopt : get(i->second.values, key);
  };
  std::vector<std::string> polls; // CAF columns, in first-use order
  for (auto& c : configs)
    if (!c.frames() && std::find(polls.begin(), polls.end(), c.caf_poll()) == polls.end())
      polls.push_back(c.caf_poll());

  // -- the table: values, then ratio columns (one per cmesh configuration) --
  auto lat_plain = ucx_get("plain tag_lat_us");
  auto bw_plain = ucx_get("plain tag_bw_GBps");
  constexpr int w = 11;
  auto pad = [](std::string text, int width) {
    if (static_cast<int>(text.size()) < width)
      text.insert(0, static_cast<size_t>(width) - text.size(), ' ');
    return text;
  };
  auto group = [&](const std::string& title, size_t ncols) -> std::string {
    if (ncols == 0)
      return {};
    auto width = static_cast<int>(ncols) * (w + 1);
    auto t = title.substr(0, static_cast<size_t>(width) - 1);
    return " " + t + std::string(static_cast<size_t>(width) - 1 - t.size(), ' ');
  };
  std::string h1(25, ' '), h2(25, ' '), h3(25, ' ');
  auto cmesh_heads = [&] {
    for (auto& c : configs) {
      h2 += " " + pad("spin " + spin_label(c.spin_us), w);
      h3 += " " + pad(c.what(), w);
    }
  };
  h1 += group("cmesh", configs.size()) + group("raw UCX", 2)
        + group("CAF TCP middleman", polls.size());
  cmesh_heads();
  h2 += " " + pad("plain", w) + " " + pad("peer_err", w);
  h3 += " " + pad("", w) + " " + pad("", w);
  for (auto& poll : polls) {
    h2 += " " + pad("", w);
    h3 += " " + pad("caf " + poll, w);
  }
  h1 += " |" + group("cmesh / UCX plain", configs.size()) + group("goal", 1) + " |"
        + group("cmesh vs CAF, x faster", configs.size());
  h2 += " |";
  h3 += " |";
  cmesh_heads();
  h2 += " " + pad("", w) + " |";
  h3 += " " + pad("", w) + " |";
  cmesh_heads();
  auto trim = [](std::string t) {
    while (!t.empty() && t.back() == ' ')
      t.pop_back();
    return t;
  };
  std::printf("\n%s\n%s\n%s\n", trim(h1).c_str(), trim(h2).c_str(), trim(h3).c_str());

  enum class kind { lat, bw, other };
  auto line = [&](const char* name, const std::string& key, std::optional<double> plain,
                  std::optional<double> peer, kind k, int prec = 2) {
    std::string out = name;
    out.resize(25, ' ');
    for (auto& o : cm)
      out += " " + pad(fmt_num(get(o.values, key), prec), w);
    out += " " + pad(fmt_num(plain, prec), w) + " " + pad(fmt_num(peer, prec), w);
    for (auto& poll : polls)
      out += " " + pad(fmt_num(caf_get(poll, key), prec), w);
    out += " |";
    for (auto& o : cm)
      out += " " + pad(k == kind::other ? "" : fmt_num(ratio(get(o.values, key), plain)), w);
    out += " " + pad(k == kind::lat ? "<= 3" : k == kind::bw ? ">= 0.8" : "", w) + " |";
    for (size_t i = 0; i < cm.size(); ++i) {
      auto mine = get(cm[i].values, key);
      auto theirs = caf_get(configs[i].caf_poll(), key);
      auto r = k == kind::lat ? ratio(theirs, mine) : ratio(mine, theirs);
      out += " " + pad(k == kind::other || configs[i].frames() ? "" : fmt_num(r, 1), w);
    }
    std::printf("%s\n", trim(out).c_str());
  };
  line("latency (us, one-way)", "lat_us", lat_plain, ucx_get("peer_err tag_lat_us"), kind::lat);
  line("  p50 (us, one-way)", "lat_p50_us", std::nullopt, std::nullopt, kind::other);
  line("  p99 (us, one-way)", "lat_p99_us", std::nullopt, std::nullopt, kind::other);
  line("  round trips counted", "lat_iters", std::nullopt, std::nullopt, kind::other, 0);
  line("bandwidth (GB/s, 4 MiB)", "bw_GBps", bw_plain, ucx_get("peer_err tag_bw_GBps"), kind::bw);
  line("  messages counted", "bw_msgs", std::nullopt, std::nullopt, kind::other, 0);
  std::printf("  UCX = ucx_perftest (tag_lat 8 B average, tag_bw 4 MiB; its MiB/s converted to "
              "1e9 B/s): plain = shared memory + CMA, peer_err = TCP loopback.\n  cmesh vs CAF "
              "compares runs with the same CAF scheduler setting.\n");
  for (size_t i = 0; i < cm.size(); ++i) {
    auto lr = ratio(get(cm[i].values, "lat_us"), lat_plain);
    auto br = ratio(get(cm[i].values, "bw_GBps"), bw_plain);
    std::printf("  goals, cmesh spin %s %s: latency within 3x of raw UCX: %s; bandwidth >= "
                "0.8 of raw UCX: %s\n",
                spin_label(configs[i].spin_us).c_str(), configs[i].what().c_str(),
                !lr ? "n/a" : *lr <= 3.0 ? "met" : "MISSED",
                !br ? "n/a" : *br >= 0.8 ? "met" : "MISSED");
  }
  if (!ucx.error.empty())
    std::printf("  raw UCX: %s\n", ucx.error.c_str());

  // -- machine-readable lines --
  std::printf("\n");
  const char* keys[] = {"lat_us", "lat_p50_us", "lat_p99_us", "bw_GBps"};
  bool named_first = false;
  for (size_t i = 0; i < cm.size(); ++i) {
    // The first actor configuration is "cmesh transport"; the others are named.
    bool first = !configs[i].frames() && !named_first;
    named_first |= first;
    auto mode = first ? std::string("transport") : "transport_" + configs[i].name();
    for (auto k : keys)
      std::printf("cmesh %s %s %s\n", mode.c_str(), k, fmt_num(get(cm[i].values, k), 3).c_str());
  }
  for (size_t i = 0; i < polls.size(); ++i) {
    auto mode = i == 0 ? std::string("caf_tcp") : "caf_tcp_caf" + polls[i];
    for (auto k : keys)
      std::printf("%s %s %s\n", mode.c_str(), k, fmt_num(caf_get(polls[i], k), 3).c_str());
  }
  if (ucx.lines.empty())
    std::printf("ucx anchor unavailable: %s\n", ucx.error.c_str());
  for (auto& l : ucx.lines)
    std::printf("%s\n", l.c_str());
  for (size_t i = 0; i < cm.size(); ++i) {
    auto name = configs[i].name();
    auto lat = get(cm[i].values, "lat_us");
    auto bw = get(cm[i].values, "bw_GBps");
    std::printf("ratio %s cmesh_over_ucx_lat %s\n", name.c_str(),
                fmt_num(ratio(lat, lat_plain), 3).c_str());
    std::printf("ratio %s cmesh_over_ucx_bw %s\n", name.c_str(),
                fmt_num(ratio(bw, bw_plain), 3).c_str());
    if (configs[i].frames())
      continue;
    std::printf("ratio %s caf_over_cmesh_lat %s\n", name.c_str(),
                fmt_num(ratio(caf_get(configs[i].caf_poll(), "lat_us"), lat), 3).c_str());
    std::printf("ratio %s cmesh_over_caf_bw %s\n", name.c_str(),
                fmt_num(ratio(bw, caf_get(configs[i].caf_poll(), "bw_GBps")), 3).c_str());
  }
  if (env_flag("CMESH_BENCH_VERBOSE")) {
    for (size_t i = 0; i < cm.size(); ++i)
      for (auto& [k, v] : cm[i].values)
        std::printf("detail cmesh_%s %s %.3f\n", configs[i].name().c_str(), k.c_str(), v);
    for (auto& [poll, o] : caf)
      for (auto& [k, v] : o.values)
        std::printf("detail caf_tcp_caf%s %s %.3f\n", poll.c_str(), k.c_str(), v);
  }
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}

int usage() {
  std::fprintf(stderr,
               "usage: cmesh_bench_transport [all]\n"
               "       cmesh_bench_transport cmesh-node <lat|bw|all|frames>\n"
               "       cmesh_bench_transport caf-server <port>\n"
               "       cmesh_bench_transport caf-client <host> <port> <lat|bw|all>\n");
  return 2;
}

} // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.empty() || (args.size() == 1 && args[0] == "all")) {
      ::signal(SIGPIPE, SIG_IGN);
      spdlog::set_level(spdlog::level::err); // the coordinator's join/leave chatter
      return driver();
    }
    if (args[0] == "cmesh-node" && args.size() == 2)
      return cmesh_node(args[1]);
    if (args[0] == "caf-server" && args.size() == 2)
      return caf_server(static_cast<uint16_t>(std::stoul(args[1])));
    if (args[0] == "caf-client" && args.size() == 4)
      return caf_client(args[1], static_cast<uint16_t>(std::stoul(args[2])), args[3]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cmesh_bench_transport: %s\n", e.what());
    return 2;
  }
  return usage();
}
