#include "actors/checkpointer.hpp"

#include "core/spawn.hpp"
#include "transport/mesh.hpp"

#include <fmt/format.h>
#include <msgpack.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <set>

namespace cmesh::actors {

std::string checkpointer_link_key(uint32_t position) {
  return fmt::format("checkpointer/link/{}", position);
}

std::string checkpointer_accept_key(uint32_t position, uint64_t link) {
  return fmt::format("checkpointer/accept/{}/{}", position, link);
}

std::string checkpointer_id_key() {
  return "checkpointer/id";
}

namespace {

constexpr uint32_t checkpointer_rank = 0; // in a link's two-process transport
constexpr uint32_t feeder_rank = 1;

/// A link request, as put in the store.
struct link_request {
  uint64_t checkpointer = 0; // the id of the checkpointer asked (a replaced one's are moot)
  uint64_t link = 0;
  uint32_t rank = 0; // the feeding rank, for the logs
  wire::bytes address;
  MSGPACK_DEFINE(checkpointer, link, rank, address)
};

wire::bytes pack_request(const link_request& r) {
  msgpack::sbuffer buf;
  msgpack::pack(buf, r);
  return wire::bytes(buf.data(), buf.data() + buf.size());
}

expected<link_request> unpack_request(const wire::bytes& b) {
  try {
    auto h = msgpack::unpack(reinterpret_cast<const char*>(b.data()), b.size());
    return h.get().as<link_request>();
  } catch (const std::exception& e) {
    return make_error(errc::malformed_frame, fmt::format("a checkpointer link request: {}",
                                                         e.what()));
  }
}

/// A fresh id for a link or a checkpointer: the wall clock in ns, which no
/// earlier one has (requests of one position are made one at a time).
uint64_t fresh_id() {
  return static_cast<uint64_t>(
    std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::system_clock::now().time_since_epoch())
      .count());
}

std::span<const float> floats_of(const bulk& b) {
  return {reinterpret_cast<const float*>(b.data()), b.size() / sizeof(float)};
}

} // namespace

/// One end of a link: a two-process transport and the mesh over it.
struct link_io {
  uint64_t id = 0;
  std::unique_ptr<transport> net;
  std::unique_ptr<mesh> m;
  std::chrono::steady_clock::time_point closed_at{};

  /// This end as `self` (checkpointer_rank or feeder_rank), with `a`
  /// published under `name`: before the transport starts, so nothing that
  /// arrives finds it missing.
  caf::error open(caf::actor_system& sys, uint32_t self, const transport_options& o,
                  const std::string& name, const caf::actor& a, mesh::dispatch how) {
    auto t = transport::create(self, o);
    if (!t)
      return t.error();
    net = std::move(*t);
    m = std::make_unique<mesh>(sys, *net);
    m->publish(name, a, how);
    return {};
  }
  /// Connects to the other end's address and starts.
  caf::error dial(uint32_t peer_rank, const wire::bytes& address) {
    wire::peer_entry peer;
    peer.rank = peer_rank;
    peer.ucx_address = address;
    if (auto e = net->connect({peer}))
      return e;
    return net->start();
  }
  /// Stops it: sends over it fail from now on. The transport object stays
  /// until the link is destroyed, since another thread may be in the middle
  /// of a send to the link's proxy.
  void close() {
    if (net) {
      net->begin_shutdown();
      net->stop();
    }
    m.reset();
    closed_at = std::chrono::steady_clock::now();
  }
  ~link_io() { close(); }
};

// -- the feed (a worker) ---------------------------------------------------------

/// What the answers of one link say (shared with the actor that takes them,
/// which may outlive the link by a message or two).
struct link_counters {
  std::atomic<int64_t> in_flight{0};
  std::atomic<bool> refused{false}; // the checkpointer lost track: seed again
  std::atomic<uint64_t> acked{0}, refusals{0};
};

/// The feed's link: the collector's proxy, and what the answers say.
struct checkpointer_link : link_io {
  uint64_t checkpointer = 0; // the id of the checkpointer it links to
  caf::actor collector; // the checkpointer's, over this link
  caf::actor answers;   // ours, published as "feed"
  std::shared_ptr<link_counters> c = std::make_shared<link_counters>();

  bool alive() const { return net && net->peer_alive(checkpointer_rank); }
  ~checkpointer_link() {
    close();
    if (answers)
      caf::anon_send_exit(answers, caf::exit_reason::user_shutdown);
  }
};

namespace {

/// The shard position a feed streams.
uint32_t position_of(const checkpointer_feed_options& o) {
  return o.rank % std::max<uint32_t>(1, o.ranks_per_group);
}

/// The id of the checkpointer running now, from the store (waiting up to
/// `wait` for one to start). Errors: timeout, closed, malformed_frame.
expected<uint64_t> checkpointer_id_of(coordinator_client& store, std::chrono::milliseconds wait) {
  auto who = store.kv_get(checkpointer_id_key(), wait);
  if (!who)
    return make_error(code_of(who.error()) == errc::closed ? errc::closed : errc::timeout,
                      fmt::format("no checkpointer in the coordinator's store after {} ms (is "
                                  "`cmesh checkpointer` running?)",
                                  wait.count()));
  uint64_t id = 0;
  if (who->size() != sizeof id)
    return make_error(errc::malformed_frame, "the checkpointer's id in the store is malformed");
  std::memcpy(&id, who->data(), sizeof id);
  return id;
}

/// Makes a link for `position`: our transport, the request in the store,
/// the checkpointer's answer. Errors: timeout (no checkpointer answered),
/// closed, transport_failure.
expected<std::shared_ptr<checkpointer_link>> make_link(caf::actor_system& sys,
                                                       coordinator_client& store,
                                                       const checkpointer_feed_options& o) {
  const uint32_t position = position_of(o);
  auto L = std::make_shared<checkpointer_link>();
  L->answers = spawn_event_based(sys, [c = L->c](caf::event_based_actor*) -> caf::behavior {
    return {[c](const wire::ack& a) {
      c->in_flight.fetch_sub(1, std::memory_order_relaxed);
      c->acked.fetch_add(1, std::memory_order_relaxed);
      if (a.value == 0) {
        c->refusals.fetch_add(1, std::memory_order_relaxed);
        c->refused.store(true);
      }
    }};
  });
  if (auto e = L->open(sys, feeder_rank, o.transport, "feed", L->answers,
                       mesh::dispatch::transport))
    return e;
  // The checkpointer running now (one started after a death has a new id).
  auto who = checkpointer_id_of(store, o.link_timeout);
  if (!who)
    return who.error();
  const uint64_t checkpointer_id = *who;
  L->id = fresh_id();
  L->checkpointer = checkpointer_id;
  if (auto e = store.kv_put(checkpointer_link_key(position),
                            pack_request({checkpointer_id, L->id, o.rank, L->net->address()})))
    return e;
  // The answer, in slices: a checkpointer that died before it answered and
  // was started again (a new id) is asked at once, not after the timeout.
  const auto until = std::chrono::steady_clock::now() + o.link_timeout;
  expected<wire::bytes> answer = make_error(errc::timeout);
  for (;;) {
    answer = store.kv_get(checkpointer_accept_key(position, L->id), std::chrono::milliseconds(200));
    if (answer || code_of(answer.error()) == errc::closed)
      break;
    if (auto now_id = checkpointer_id_of(store, std::chrono::milliseconds(1));
        now_id && *now_id != checkpointer_id)
      return make_error(errc::aborted, "the checkpointer asked was replaced before it answered");
    if (std::chrono::steady_clock::now() > until)
      break;
  }
  if (!answer)
    return make_error(code_of(answer.error()) == errc::closed ? errc::closed : errc::timeout,
                      fmt::format("no checkpointer answered rank {}'s link request in {} ms "
                                  "(is `cmesh checkpointer` running?): {}",
                                  o.rank, o.link_timeout.count(), describe(answer.error())));
  // The store is bounded: the answer's key goes once read.
  if (auto e = store.kv_drop(checkpointer_accept_key(position, L->id)))
    spdlog::warn("checkpointer feed: rank {}: {}", o.rank, describe(e));
  if (auto e = L->dial(checkpointer_rank, *answer))
    return e;
  L->collector = L->m->remote(checkpointer_rank, "collector");
  return L;
}

} // namespace

checkpointer_feed::checkpointer_feed(caf::actor_system& sys, checkpointer_feed_options o)
    : sys_(sys), o_(std::move(o)) {
  clock_.every = o_.every;
  clock_.every_time = o_.every_time;
  linker_ = std::thread([this] { run_links(); });
}

checkpointer_feed::~checkpointer_feed() {
  stopping_ = true;
  if (linker_.joinable())
    linker_.join();
  std::lock_guard lock(mu_);
  link_.reset();
}

std::shared_ptr<checkpointer_link> checkpointer_feed::current() const {
  std::lock_guard lock(mu_);
  return link_;
}

/// The linker's thread: a link while this rank writes and the one it has
/// died or is missing; none while it does not.
void checkpointer_feed::run_links() {
  std::optional<coordinator_client> store;
  auto next_try = std::chrono::steady_clock::now();
  auto next_look = std::chrono::steady_clock::now();
  while (!stopping_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    auto have = current();
    if (!writer_) {
      if (have) {
        std::lock_guard lock(mu_);
        link_.reset(); // another group feeds this position now
      }
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (have && have->alive() && store && now >= next_look) {
      // A checkpointer started in place of a dead one has a new id: link
      // to it at once rather than when the heartbeats of this link stop.
      next_look = now + std::chrono::milliseconds(250);
      auto id = checkpointer_id_of(*store, std::chrono::milliseconds(1));
      if (id && *id != have->checkpointer) {
        spdlog::warn("checkpointer feed: rank {}: a new checkpointer started; linking to it",
                     o_.rank);
        std::lock_guard lock(mu_);
        link_.reset();
        have.reset();
        next_try = now;
      }
    }
    if ((have && have->alive()) || now < next_try)
      continue;
    if (have) {
      spdlog::warn("checkpointer feed: rank {}: the link to the checkpointer is down; "
                   "asking for a new one",
                   o_.rank);
      std::lock_guard lock(mu_);
      link_.reset();
    }
    next_try = now + std::chrono::seconds(1);
    if (!store) {
      auto c = coordinator_client::connect(o_.coordinator, std::chrono::seconds(2));
      if (!c) {
        spdlog::warn("checkpointer feed: rank {}: {}", o_.rank, describe(c.error()));
        continue;
      }
      store.emplace(std::move(*c));
    }
    auto L = make_link(sys_, *store, o_);
    if (!L) {
      spdlog::warn("checkpointer feed: rank {}: {}", o_.rank, describe(L.error()));
      if (code_of(L.error()) == errc::closed)
        store.reset(); // the coordinator restarted: connect again
      if (code_of(L.error()) == errc::aborted)
        next_try = now; // ask the new one
      continue;
    }
    links_.fetch_add(1);
    spdlog::info("checkpointer feed: rank {} streams its shard to the checkpointer (link {})",
                 o_.rank, (*L)->id);
    std::lock_guard lock(mu_);
    link_ = std::move(*L);
  }
}

void checkpointer_feed::entered_epoch(std::span<const uint32_t> members, size_t ranks_per_group) {
  if (members.empty())
    return;
  const size_t S = std::max<size_t>(1, ranks_per_group);
  writer_ = o_.rank / S == *std::min_element(members.begin(), members.end()) / S;
}

bool checkpointer_feed::wants_checkpoint(uint64_t k) {
  return clock_.wants(k);
}

void checkpointer_feed::checkpoint_agreed(uint64_t k) {
  clock_.agreed(k);
}

void checkpointer_feed::at_boundary(const train_state& st) {
  auto L = writer_ ? current() : nullptr;
  if (!L) {
    tracking_ = false;
    bound_ = nullptr;
    return;
  }
  if (L.get() != bound_ || L->c->refused.exchange(false))
    tracking_ = false;
  bound_ = L.get();
  if (tracking_ && next_ == st.step)
    return;
  // A copy of the state at this boundary: the checkpointer's shadow of
  // this position starts (again) here.
  const size_t n = st.params.size();
  const size_t bytes = (3 * n + st.scalars.size()) * sizeof(float);
  auto b = bulk::allocate(bytes);
  auto* out = reinterpret_cast<float*>(b.data());
  std::memcpy(out, st.params.data(), n * sizeof(float));
  std::memcpy(out + n, st.adam_m.data(), n * sizeof(float));
  std::memcpy(out + 2 * n, st.adam_v.data(), n * sizeof(float));
  std::memcpy(out + 3 * n, st.scalars.data(), st.scalars.size() * sizeof(float));
  wire::ckpt_seed m;
  m.position = position_of(o_);
  m.link = L->id;
  m.step = st.step;
  m.elements = n;
  m.scalars = static_cast<uint32_t>(st.scalars.size());
  m.agreed = st.step == clock_.agreed_step;
  m.payload = std::move(b);
  L->c->in_flight.fetch_add(1, std::memory_order_relaxed);
  caf::anon_send(L->collector, std::move(m));
  ++seeds_;
  tracking_ = true;
  next_ = st.step;
}

void checkpointer_feed::committed(uint64_t k, std::span<const float> update,
                                  const train_state& after) {
  auto L = writer_ && tracking_ && k == next_ ? current() : nullptr;
  if (!L || L.get() != bound_) {
    tracking_ = false;
    return;
  }
  if (L->c->in_flight.load(std::memory_order_relaxed) >= static_cast<int64_t>(o_.queue_max)) {
    ++dropped_;
    tracking_ = false; // seeded again at the next boundary
    return;
  }
  wire::ckpt_update m;
  m.position = position_of(o_);
  m.link = L->id;
  m.step = k;
  m.expect =
    o_.check ? hash_state(after.params, after.adam_m, after.adam_v, after.scalars) | 1 : 0;
  m.agreed = k + 1 == clock_.agreed_step;
  m.payload = bulk::allocate(update.size_bytes());
  std::memcpy(m.payload.data(), update.data(), update.size_bytes());
  L->c->in_flight.fetch_add(1, std::memory_order_relaxed);
  caf::anon_send(L->collector, std::move(m));
  ++sent_;
  ++next_;
}

caf::error checkpointer_feed::drain(std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  // Updates held back for another position (whose rank died) are never
  // answered: give up once nothing was answered for a while.
  constexpr auto quiet_max = std::chrono::seconds(5);
  uint64_t acked = 0;
  auto last_progress = std::chrono::steady_clock::now();
  for (;;) {
    auto L = current();
    if (!L || !writer_ || L->c->in_flight.load() <= 0)
      return {};
    const auto now = std::chrono::steady_clock::now();
    if (L->c->acked.load() != acked) {
      acked = L->c->acked.load();
      last_progress = now;
    }
    if (!L->alive())
      return make_error(errc::peer_lost,
                        fmt::format("rank {}: the checkpointer's link died with {} message(s) "
                                    "unanswered",
                                    o_.rank, L->c->in_flight.load()));
    if (now > until || now - last_progress > quiet_max)
      return make_error(errc::timeout,
                        fmt::format("rank {}: {} message(s) to the checkpointer unanswered "
                                    "(none answered for {} ms)",
                                    o_.rank, L->c->in_flight.load(),
                                    std::chrono::duration_cast<std::chrono::milliseconds>(
                                      now - last_progress)
                                      .count()));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

checkpointer_feed_stats checkpointer_feed::stats() const {
  checkpointer_feed_stats s;
  auto L = current();
  s.linked = L && L->alive();
  s.links = links_.load();
  s.seeds = seeds_;
  s.sent = sent_;
  s.dropped = dropped_;
  if (L) {
    s.acked = L->c->acked.load();
    s.refused = L->c->refusals.load();
  }
  return s;
}

// -- the checkpointer (its own process) --------------------------------------------

namespace {

using link_atom = caf::atom_constant<caf::atom("link")>;
using flush_atom = caf::atom_constant<caf::atom("flushall")>;

/// What the collector knows of one position.
struct position_state {
  uint64_t link = 0;   // the link it takes messages from
  caf::actor answers;  // that link's feed ("feed" over its mesh)
  bool seeded = false;
  uint64_t step = 0;   // where its shadow stands once it handled what it was sent
  std::deque<wire::ckpt_update> queued; // the updates of steps step, step + 1, ...
};

struct collector_state {
  static inline const char* name = "checkpointer_collector";
  std::vector<caf::actor> shadows;
  std::vector<position_state> at;
  checkpoint_target target;
  uint64_t last_steps = 0;        // the run's last step
  std::set<uint64_t> agreed;      // steps a time-based checkpoint was agreed for
  uint64_t last_told = 0;         // the newest step the shadows were told to write
};

using collector_self = caf::stateful_actor<collector_state>;

void answer(collector_self* self, const caf::actor& to, uint64_t step, bool ok) {
  if (to)
    self->send(to, wire::ack{step, ok ? 1u : 0u});
}

/// Tells every shadow to write the step they all stand at, unless they were
/// told already or it is the step resumed from.
void tell_write(collector_self* self, uint64_t step) {
  auto& S = self->state;
  if (step <= S.last_told || step <= S.target.resumed_from)
    return;
  S.last_told = step;
  for (auto& sh : S.shadows)
    self->send(sh, shadow_flush_atom::value);
}

/// Tells every shadow to write the step they all stand at, when one is due
/// there: every K steps, the run's last step, or a step the vote agreed on.
void maybe_write_whole(collector_self* self, uint64_t step) {
  auto& S = self->state;
  const auto& t = S.target;
  const bool due = (t.every > 0 && step % t.every == 0) || step == S.last_steps
                   || S.agreed.count(step) > 0;
  S.agreed.erase(S.agreed.begin(), S.agreed.upper_bound(step));
  if (due)
    tell_write(self, step);
}

/// Passes the positions' queued updates to their shadows, up to the step
/// all positions can reach, the laggards first: whenever they all stand at
/// one step, that step is whole, and written when due.
void forward(collector_self* self) {
  auto& S = self->state;
  uint64_t whole = UINT64_MAX;
  for (auto& p : S.at) {
    if (!p.seeded)
      return;
    whole = std::min(whole, p.step + p.queued.size());
  }
  for (;;) {
    uint64_t low = UINT64_MAX, high = 0;
    for (auto& p : S.at) {
      low = std::min(low, p.step);
      high = std::max(high, p.step);
    }
    if (low == high)
      maybe_write_whole(self, low);
    if (low >= whole)
      return;
    for (size_t i = 0; i < S.at.size(); ++i) {
      auto& p = S.at[i];
      if (p.step != low)
        continue;
      auto u = std::move(p.queued.front());
      p.queued.pop_front();
      auto to = p.answers;
      const uint64_t k = u.step;
      // The buffer the update was received into goes on as it is: a fresh
      // vector of its size would fault its pages in, every step.
      self->request(S.shadows[i], caf::infinite, shadow_commit_atom::value, k,
                    std::move(u.payload), u.expect, false)
        .then([self, to, k]() { answer(self, to, k, true); });
      ++p.step;
    }
  }
}

caf::behavior collector_actor(collector_self* self, std::vector<caf::actor> shadows,
                              checkpoint_target target, uint64_t last_steps) {
  self->state.at.resize(shadows.size());
  self->state.shadows = std::move(shadows);
  self->state.target = std::move(target);
  self->state.last_steps = last_steps;
  return {
    [=](link_atom, uint32_t position, uint64_t link, caf::actor answers) {
      auto& p = self->state.at.at(position);
      p.link = link;
      p.answers = std::move(answers);
      p.queued.clear(); // the old link's: nobody waits for their answers
    },
    [=](wire::ckpt_seed& m) {
      auto& S = self->state;
      if (m.position >= S.at.size() || m.link != S.at[m.position].link)
        return; // a replaced link's
      auto& p = S.at[m.position];
      const uint64_t n = m.elements;
      if (m.payload.size() != (3 * n + m.scalars) * sizeof(float)) {
        spdlog::error("checkpointer: a seed of position {} holds {} bytes, not {} floats",
                      m.position, m.payload.size(), 3 * n + m.scalars);
        answer(self, p.answers, m.step, false);
        return;
      }
      for (auto& u : p.queued) // moot: the rank seeded again
        answer(self, p.answers, u.step, true);
      p.queued.clear();
      auto f = floats_of(m.payload);
      std::vector<float> params(f.begin(), f.begin() + n), am(f.begin() + n, f.begin() + 2 * n),
        av(f.begin() + 2 * n, f.begin() + 3 * n), sc(f.begin() + 3 * n, f.end());
      auto to = p.answers;
      const uint64_t step = m.step;
      self->request(S.shadows[m.position], caf::infinite, shadow_seed_atom::value, step,
                    std::move(params), std::move(am), std::move(av), std::move(sc), false)
        .then([self, to, step]() { answer(self, to, step, true); });
      p.seeded = true;
      p.step = step;
      if (m.agreed)
        S.agreed.insert(step);
      forward(self);
    },
    [=](wire::ckpt_update& m) {
      auto& S = self->state;
      if (m.position >= S.at.size() || m.link != S.at[m.position].link)
        return;
      auto& p = S.at[m.position];
      if (!p.seeded || m.step != p.step + p.queued.size()) {
        answer(self, p.answers, m.step, false); // a gap: the rank seeds again
        return;
      }
      if (m.agreed)
        S.agreed.insert(m.step + 1);
      p.queued.push_back(std::move(m));
      forward(self);
    },
    [=](flush_atom) -> std::vector<uint64_t> {
      // [whole?, step, step of each position...]: everything that can be
      // was forwarded already, so the step they all stand at is the newest
      // whole one.
      auto& S = self->state;
      std::vector<uint64_t> out{1, 0};
      bool any = false;
      for (auto& p : S.at) {
        out.push_back(p.seeded ? p.step : UINT64_MAX);
        any = any || p.seeded;
      }
      if (!any)
        return {1, 0}; // never fed
      for (size_t i = 2; i < out.size(); ++i)
        if (out[i] != out[2])
          out[0] = 0;
      if (out[0] == 0)
        return out;
      out[1] = out[2];
      tell_write(self, out[1]);
      return out;
    },
  };
}

} // namespace

struct checkpointer_state {
  caf::actor_system* sys = nullptr;
  checkpointer_options o;
  coordinator_client store;
  std::vector<caf::actor> shadows;
  caf::actor collector;
  std::vector<std::unique_ptr<link_io>> links; // one per position
  std::vector<std::unique_ptr<link_io>> retired; // closed, destroyed a while later
  std::vector<uint64_t> failed; // per position: the request that could not be linked
  uint64_t made = 0;
  uint64_t id = fresh_id(); // this checkpointer's, in the store

  explicit checkpointer_state(coordinator_client c) : store(std::move(c)) {}
};

expected<std::unique_ptr<checkpointer>> checkpointer::start(caf::actor_system& sys,
                                                            checkpointer_options o) {
  auto c = coordinator_client::connect(o.coordinator, std::chrono::seconds(10));
  if (!c)
    return c.error();
  auto s = std::make_unique<checkpointer_state>(std::move(*c));
  wire::bytes id(sizeof s->id);
  std::memcpy(id.data(), &s->id, sizeof s->id);
  if (auto e = s->store.kv_put(checkpointer_id_key(), id))
    return e;
  s->sys = &sys;
  s->o = std::move(o);
  const uint32_t S = std::max<uint32_t>(1, s->o.target.ranks_per_group);
  s->o.target.when_told = true; // the collector tells them (whole steps only)
  for (uint32_t p = 0; p < S; ++p) {
    auto t = s->o.target;
    t.rank = p; // group 0's position p: position 0 commits
    s->shadows.push_back(spawn_shadow(sys, s->o.train, t));
  }
  s->collector = sys.spawn(collector_actor, s->shadows, s->o.target, s->o.train.steps);
  s->links.resize(S);
  s->failed.resize(S, 0);
  return std::unique_ptr<checkpointer>(new checkpointer(std::move(s)));
}

checkpointer::checkpointer(std::unique_ptr<checkpointer_state> s) : s_(std::move(s)) {}

checkpointer::~checkpointer() {
  // The links close first (sends over them fail), then the collector ends
  // before their transports go with the state.
  for (auto& l : s_->links)
    if (l)
      l->close();
  {
    caf::scoped_actor self{*s_->sys};
    self->monitor(s_->collector);
    self->send_exit(s_->collector, caf::exit_reason::user_shutdown);
    self->receive([](const caf::down_msg&) {},
                  caf::after(std::chrono::seconds(10)) >> [] {
                    spdlog::warn("checkpointer: the collector did not end within 10 s");
                  });
  }
  for (auto& sh : s_->shadows)
    caf::anon_send_exit(sh, caf::exit_reason::user_shutdown);
}

uint64_t checkpointer::links_made() const {
  return s_->made;
}

caf::error checkpointer::poll_links() {
  std::erase_if(s_->retired, [](const auto& l) {
    return std::chrono::steady_clock::now() - l->closed_at > std::chrono::seconds(10);
  });
  for (uint32_t p = 0; p < s_->links.size(); ++p) {
    auto v = s_->store.kv_get(checkpointer_link_key(p), std::chrono::milliseconds(1));
    if (!v) {
      if (code_of(v.error()) == errc::closed)
        return v.error();
      continue; // no request yet
    }
    auto req = unpack_request(*v);
    if (!req) {
      spdlog::error("checkpointer: {}", describe(req.error()));
      continue;
    }
    if (req->checkpointer != s_->id || (s_->links[p] && s_->links[p]->id == req->link)
        || s_->failed[p] == req->link)
      continue; // for a checkpointer that is gone, linked already, or tried in vain
    auto L = std::make_unique<link_io>();
    L->id = req->link;
    if (auto e = L->open(*s_->sys, checkpointer_rank, s_->o.transport, "collector",
                         s_->collector, mesh::dispatch::scheduled))
      return e;
    if (auto e = L->dial(feeder_rank, req->address)) {
      // Its rank died after asking: tried once, not at every poll (each
      // try makes a UCP context); the rank's next request has a new id.
      spdlog::error("checkpointer: rank {}'s link: {}", req->rank, describe(e));
      s_->failed[p] = req->link;
      continue;
    }
    // The collector takes the link's messages from now on (the actor's
    // mailbox keeps this before any message the link brings).
    caf::anon_send(s_->collector, link_atom::value, p, req->link,
                   L->m->remote(feeder_rank, "feed"));
    if (auto e = s_->store.kv_put(checkpointer_accept_key(p, req->link), L->net->address()))
      return e;
    spdlog::info("checkpointer: rank {} feeds position {} (link {})", req->rank, p, req->link);
    if (s_->links[p]) {
      s_->links[p]->close();
      s_->retired.push_back(std::move(s_->links[p]));
    }
    s_->links[p] = std::move(L);
    ++s_->made;
  }
  return {};
}

std::vector<expected<shadow_status>> checkpointer::status(std::chrono::milliseconds timeout) {
  std::vector<expected<shadow_status>> out;
  for (auto& sh : s_->shadows)
    out.push_back(shadow_status_of(*s_->sys, sh, timeout));
  return out;
}

expected<uint64_t> checkpointer::flush(std::chrono::milliseconds timeout) {
  uint64_t failures_before = 0;
  for (auto& st : status(timeout))
    if (st)
      failures_before += st->write_failures;
  std::vector<uint64_t> where;
  {
    caf::scoped_actor self{*s_->sys};
    caf::error err;
    self->request(s_->collector, caf::duration{timeout}, flush_atom::value)
      .receive([&](std::vector<uint64_t>& v) { where = std::move(v); },
               [&](caf::error& e) { err = e; });
    if (err)
      return make_error(errc::timeout, "the checkpointer's collector: " + s_->sys->render(err));
  }
  if (where.at(0) == 0) {
    std::string steps;
    for (size_t i = 2; i < where.size(); ++i)
      steps += fmt::format("{}{}", i > 2 ? ", " : "",
                           where[i] == UINT64_MAX ? std::string("none")
                                                  : std::to_string(where[i]));
    return make_error(errc::unrecoverable,
                      fmt::format("the shards' shadows stand at different steps ({}): no step "
                                  "is whole, nothing more is written",
                                  steps));
  }
  const uint64_t step = where.at(1);
  if (step == 0)
    return uint64_t{0};
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    bool done = true;
    uint64_t failures = 0;
    for (auto& st : status(timeout)) {
      if (!st)
        return st.error();
      done = done && !st->writing && st->step >= step;
      failures += st->write_failures;
    }
    if (done) {
      if (failures > failures_before)
        return make_error(errc::aborted,
                          fmt::format("{} write(s) of the shards of step {} failed (see the "
                                      "errors above)",
                                      failures - failures_before, step));
      return step;
    }
    if (std::chrono::steady_clock::now() > until)
      return make_error(errc::timeout, fmt::format("the checkpoint of step {} is not written "
                                                   "after {} ms",
                                                   step, timeout.count()));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

} // namespace cmesh::actors
