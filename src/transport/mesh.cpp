#include "transport/mesh.hpp"

#include "core/check.hpp"

#include <caf/send.hpp>
#include <caf/actor_cast.hpp>
#include <caf/actor_proxy.hpp>
#include <caf/make_actor.hpp>
#include <caf/mailbox_element.hpp>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <caf/execution_unit.hpp>
#include <caf/resumable.hpp>
#include <caf/scheduler/abstract_coordinator.hpp>

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace cmesh {

namespace {

/// The execution unit of the transport's data thread. A frame that unblocks
/// an actor published with dispatch::transport hands it here (CAF passes
/// the unit given to enqueue on to exec_later), and it runs right away on
/// this thread; any other actor goes to CAF's scheduler as usual.
class lane_unit final : public caf::execution_unit {
public:
  lane_unit(caf::actor_system& sys, std::function<bool(caf::resumable*)> runs_here)
      : caf::execution_unit(&sys), runs_here_(std::move(runs_here)) {}

  void exec_later(caf::resumable* job) override {
    if (runs_here_(job))
      ready_.push_back(job);
    else
      system().scheduler().enqueue(job);
  }

  /// Runs what became ready, as CAF's workers do: each job holds the
  /// reference its enqueue added.
  void run() {
    while (!ready_.empty()) {
      auto* job = ready_.front();
      ready_.pop_front();
      switch (job->resume(this, mesh::inline_burst_max)) {
        case caf::resumable::resume_later:
          // Still has mail after a burst: the scheduler takes the rest, so a
          // flood cannot hold the data thread.
          system().scheduler().enqueue(job);
          break;
        case caf::resumable::awaiting_message:
        case caf::resumable::done:
        case caf::resumable::shutdown_execution_unit:
          intrusive_ptr_release(job);
          break;
      }
    }
  }

private:
  std::function<bool(caf::resumable*)> runs_here_;
  std::deque<caf::resumable*> ready_;
};

} // namespace

struct mesh::core : std::enable_shared_from_this<mesh::core> {
  caf::actor_system& sys;
  transport& net;
  std::atomic<uint64_t> epoch{0};
  lane_unit unit; // used on the data thread only

  mutable std::mutex mtx;
  std::unordered_map<std::string, caf::actor> published;
  std::unordered_map<caf::actor_id, std::string> names_by_id;
  std::unordered_map<std::string, caf::actor_addr> auto_named; // weak: repliable senders
  std::map<std::pair<uint32_t, std::string>, caf::strong_actor_ptr> proxies;
  std::map<uint32_t, caf::error> fenced;
  caf::actor watcher; // told of each fenced peer (watch_peers)
  std::unordered_set<caf::actor_id> run_inline; // published with dispatch::transport

  std::atomic<uint64_t> forwarded{0}, delivered{0}, unsendable{0}, send_failures{0};

  core(caf::actor_system& s, transport& t)
      : sys(s), net(t), unit(s, [this](caf::resumable* job) { return runs_inline(job); }) {}

  bool runs_inline(caf::resumable* job) {
    auto* a = dynamic_cast<caf::abstract_actor*>(job);
    if (a == nullptr)
      return false;
    std::lock_guard<std::mutex> g(mtx);
    return run_inline.count(a->id()) != 0;
  }

  std::string name_of(const caf::strong_actor_ptr& sender);
  caf::actor local(const std::string& name);
  caf::strong_actor_ptr proxy_for(uint32_t rank, const std::string& name);
  void deliver(inbound_frame&& f);
  void peer_down(uint32_t rank, const caf::error& reason);
  void peer_up(uint32_t rank, uint64_t incarnation);

  template <class T>
  void forward(uint32_t rank, uint64_t incarnation, const std::string& dst,
               const caf::strong_actor_ptr& sender, const T& msg) {
    wire::frame_header h;
    h.epoch = epoch.load(std::memory_order_relaxed);
    h.src_actor = name_of(sender);
    h.dst_actor = dst;
    if (auto err = net.send_message(rank, std::move(h), msg, incarnation)) {
      auto n = ++send_failures;
      if (n <= 10 || n % 1000 == 0)
        spdlog::warn("send to {}@{} failed ({} so far): {}", dst, rank, n, describe(err));
      // A peer that took nothing for the whole backpressure wait is failed:
      // fenced, so its monitors learn that this message (and any later one)
      // was not delivered, rather than seeing a silent gap in the order.
      if (code_of(err) == errc::queue_full && net.peer_incarnation(rank) == incarnation)
        net.fence(rank, make_error(errc::queue_full,
                                   fmt::format("rank {} took no message while its send queue was "
                                               "full: {}",
                                               rank, describe(err))));
      return;
    }
    ++forwarded;
  }
};

namespace {

/// A local stand-in for an actor in another process.
class remote_proxy final : public caf::actor_proxy {
public:
  remote_proxy(caf::actor_config& cfg, std::weak_ptr<mesh::core> core, uint32_t rank,
               uint64_t incarnation, std::string name)
      : caf::actor_proxy(cfg), core_(std::move(core)), rank_(rank), incarnation_(incarnation),
        name_(std::move(name)) {}

  void enqueue(caf::mailbox_element_ptr what, caf::execution_unit*) override {
    if (!what)
      return;
    auto c = core_.lock();
    if (!c)
      return;
    auto& content = what->content();
    bool sent = false;
    wire::for_each_type(wire::actor_messages{}, [&]<class T>() {
      if (!sent && content.size() == 1 && content.match_elements<T>()) {
        sent = true;
        c->forward(rank_, incarnation_, name_, what->sender, content.get_as<T>(0));
      }
    });
    if (!sent) {
      auto n = ++c->unsendable;
      if (n <= 10)
        spdlog::warn("message to {}@{} dropped: its type is not in the wire registry", name_,
                     rank_);
    }
  }

  // Remote links are not supported: callers monitor proxies instead.
  void add_link(caf::abstract_actor*) override {}
  void remove_link(caf::abstract_actor*) override {}
  bool add_backlink(caf::abstract_actor*) override { return false; }
  bool remove_backlink(caf::abstract_actor*) override { return false; }

  void kill_proxy(caf::execution_unit* ctx, caf::error reason) override {
    cleanup(std::move(reason), ctx);
  }

  const char* name() const override { return "cmesh.remote_proxy"; }

  uint64_t incarnation() const { return incarnation_; }

private:
  std::weak_ptr<mesh::core> core_;
  uint32_t rank_;
  uint64_t incarnation_; // of the peer when the proxy was made: it never reaches another
  std::string name_;
};

} // namespace

std::string mesh::core::name_of(const caf::strong_actor_ptr& sender) {
  if (!sender)
    return {};
  std::lock_guard<std::mutex> g(mtx);
  auto id = sender->id();
  if (auto i = names_by_id.find(id); i != names_by_id.end())
    return i->second;
  // An unpublished sender gets a name so that the receiver can answer it.
  auto name = "@" + std::to_string(id);
  names_by_id.emplace(id, name);
  auto_named.emplace(name, caf::actor_cast<caf::actor_addr>(sender));
  return name;
}

caf::actor mesh::core::local(const std::string& name) {
  std::lock_guard<std::mutex> g(mtx);
  if (auto i = published.find(name); i != published.end())
    return i->second;
  if (auto i = auto_named.find(name); i != auto_named.end()) {
    auto a = caf::actor_cast<caf::actor>(i->second);
    if (!a) {
      auto_named.erase(i);
      names_by_id.erase(caf::actor_id{std::stoull(name.substr(1))});
    }
    return a;
  }
  return {};
}

caf::strong_actor_ptr mesh::core::proxy_for(uint32_t rank, const std::string& name) {
  if (name.empty())
    return nullptr;
  caf::strong_actor_ptr p;
  caf::error dead;
  {
    std::lock_guard<std::mutex> g(mtx);
    auto key = std::make_pair(rank, name);
    if (auto i = proxies.find(key); i != proxies.end())
      return i->second;
    caf::actor_config cfg;
    p = caf::make_actor<remote_proxy, caf::strong_actor_ptr>(
      sys.next_actor_id(), sys.node(), &sys, cfg, weak_from_this(), rank,
      net.peer_incarnation(rank), name);
    proxies.emplace(key, p);
    if (auto i = fenced.find(rank); i != fenced.end())
      dead = i->second;
  }
  if (dead)
    static_cast<remote_proxy*>(caf::actor_cast<caf::abstract_actor*>(p))->kill_proxy(nullptr, dead);
  return p;
}

void mesh::core::deliver(inbound_frame&& f) {
  auto dst = local(f.header.dst_actor);
  if (!dst) {
    wire::note_reject(make_error(errc::unknown_destination,
                                 "no actor named '" + f.header.dst_actor + "'"),
                      "mesh");
    return;
  }
  bool known = wire::visit_kind<wire::actor_messages>(f.header.kind, [&]<class T>() {
    auto m = wire::decode_body<T>(f.body());
    if (!m) {
      wire::note_reject(m.error(), "mesh");
      return;
    }
    if constexpr (wire::has_bulk_v<T>)
      m->payload = std::move(f.payload);
    auto src = proxy_for(f.from, f.header.src_actor);
    dst->enqueue(caf::make_mailbox_element(std::move(src), caf::make_message_id(), {},
                                           std::move(*m)),
                 &unit);
    ++delivered;
    unit.run();
  });
  if (!known)
    wire::note_reject(make_error(errc::unknown_kind, std::string("kind ")
                                                       + std::to_string(f.header.kind)
                                                       + " is not an actor message"),
                      "mesh");
}

void mesh::core::peer_down(uint32_t rank, const caf::error& reason) {
  std::vector<caf::strong_actor_ptr> victims;
  // Still the fenced incarnation's: a newer one is armed after this runs.
  const uint64_t incarnation = net.peer_incarnation(rank);
  caf::actor told;
  {
    std::lock_guard<std::mutex> g(mtx);
    told = watcher;
    fenced[rank] = reason;
    // Kept (terminated) until a newer incarnation is connected: remote()
    // of a fenced rank keeps returning the same dead proxy.
    for (auto& [key, p] : proxies)
      if (key.first == rank)
        victims.push_back(p);
  }
  for (auto& p : victims)
    static_cast<remote_proxy*>(caf::actor_cast<caf::abstract_actor*>(p))->kill_proxy(nullptr,
                                                                                      reason);
  if (told)
    caf::anon_send(told, peer_down_atom::value, rank, incarnation, describe(reason));
}

void mesh::watch_peers(caf::actor a) {
  std::lock_guard<std::mutex> g(core_->mtx);
  core_->watcher = std::move(a);
}

void mesh::core::peer_up(uint32_t rank, uint64_t incarnation) {
  std::vector<caf::strong_actor_ptr> stale;
  {
    std::lock_guard<std::mutex> g(mtx);
    fenced.erase(rank);
    // The older incarnations' proxies (terminated when they were fenced,
    // or made dead while the rank was fenced) go: remote() makes new ones.
    for (auto it = proxies.begin(); it != proxies.end();) {
      auto* rp = static_cast<remote_proxy*>(caf::actor_cast<caf::abstract_actor*>(it->second));
      if (it->first.first == rank && rp->incarnation() != incarnation) {
        stale.push_back(it->second);
        it = proxies.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& p : stale)
    static_cast<remote_proxy*>(caf::actor_cast<caf::abstract_actor*>(p))
      ->kill_proxy(nullptr, make_error(errc::peer_lost, "rank " + std::to_string(rank)
                                                           + " runs a newer incarnation"));
}

mesh::mesh(caf::actor_system& sys, transport& t) : core_(std::make_shared<core>(sys, t)) {
  std::weak_ptr<core> weak = core_;
  t.set_handlers(
    [weak](inbound_frame&& f) {
      if (auto c = weak.lock())
        c->deliver(std::move(f));
    },
    [weak](uint32_t rank, const caf::error& reason) {
      if (auto c = weak.lock())
        c->peer_down(rank, reason);
    },
    [weak](uint32_t rank, uint64_t incarnation) {
      if (auto c = weak.lock())
        c->peer_up(rank, incarnation);
    });
}

mesh::~mesh() {
  // Proxies keep only weak references; terminate them so monitors fire.
  std::vector<caf::strong_actor_ptr> all;
  {
    std::lock_guard<std::mutex> g(core_->mtx);
    for (auto& [key, p] : core_->proxies)
      all.push_back(p);
    core_->proxies.clear();
    core_->published.clear();
  }
  for (auto& p : all)
    static_cast<remote_proxy*>(caf::actor_cast<caf::abstract_actor*>(p))
      ->kill_proxy(nullptr, make_error(errc::closed, "mesh shut down"));
}

void mesh::publish(const std::string& name, const caf::actor& a, dispatch how) {
  CMESH_CHECK(!name.empty() && name.size() <= wire::actor_name_max && name[0] != '@');
  std::lock_guard<std::mutex> g(core_->mtx);
  core_->published[name] = a;
  core_->names_by_id[a.id()] = name;
  if (how == dispatch::transport)
    core_->run_inline.insert(a.id());
  else
    core_->run_inline.erase(a.id());
}

caf::actor mesh::remote(uint32_t rank, const std::string& name) {
  if (rank == core_->net.self())
    return core_->local(name);
  return caf::actor_cast<caf::actor>(core_->proxy_for(rank, name));
}

void mesh::set_epoch(uint64_t epoch) {
  core_->epoch = epoch;
}

uint32_t mesh::self() const {
  return core_->net.self();
}

mesh_stats mesh::stats() const {
  mesh_stats s;
  s.forwarded = core_->forwarded;
  s.delivered = core_->delivered;
  s.unsendable = core_->unsendable;
  s.send_failures = core_->send_failures;
  return s;
}

} // namespace cmesh
