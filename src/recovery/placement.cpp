#include "recovery/placement.hpp"

#include "core/check.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iterator>
#include <numeric>
#include <optional>
#include <string>

namespace cmesh::recovery {

std::string_view to_string(move_kind k) {
  switch (k) {
    case move_kind::move:
      return "move";
    case move_kind::copy:
      return "copy";
    case move_kind::drop:
      return "drop";
  }
  return "unknown";
}

double imbalance(std::span<const double> rank_load) {
  if (rank_load.empty())
    return 1;
  const double sum = std::accumulate(rank_load.begin(), rank_load.end(), 0.0);
  if (!(sum > 0))
    return 1;
  const double mean = sum / static_cast<double>(rank_load.size());
  return *std::max_element(rank_load.begin(), rank_load.end()) / mean;
}

namespace {

/// One replica of one expert.
struct item {
  expert_id expert;
  uint32_t replica;
  double load;
};

/// Where each item went, and the resulting loads.
struct assignment {
  bool ok = false;
  std::vector<rank_id> rank_of; // per item
  std::vector<double> load;     // per rank
  double max = 0;
  size_t at_max = 0;
};

constexpr uint32_t unbounded = std::numeric_limits<uint32_t>::max();

struct problem {
  std::vector<item> items;  // load descending, then expert, then replica
  uint32_t ranks = 1;
  std::vector<uint32_t> cap; // per rank: experts it may host (unbounded: no limit)
  size_t experts = 0;
  double eps = 0;

  bool room(rank_id r, uint32_t count) const { return count < cap[r]; }
};

/// Per rank capacities of place_experts' options.
std::vector<uint32_t> uniform_caps(const placement_options& o) {
  return std::vector<uint32_t>(o.ranks, o.capacity == 0 ? unbounded : o.capacity);
}

problem make_problem(std::span<const uint64_t> tokens, std::span<const uint32_t> replicas,
                     std::span<const uint32_t> cap, double eps) {
  problem p;
  p.ranks = static_cast<uint32_t>(cap.size());
  p.cap.assign(cap.begin(), cap.end());
  p.experts = tokens.size();
  p.eps = eps;
  for (expert_id e = 0; e < tokens.size(); ++e)
    for (uint32_t k = 0; k < replicas[e]; ++k)
      p.items.push_back({e, k, static_cast<double>(tokens[e]) / replicas[e]});
  std::sort(p.items.begin(), p.items.end(), [](const item& a, const item& b) {
    if (a.load != b.load)
      return a.load > b.load;
    if (a.expert != b.expert)
      return a.expert < b.expert;
    return a.replica < b.replica;
  });
  return p;
}

void score(assignment& a, double eps) {
  a.max = a.load.empty() ? 0 : *std::max_element(a.load.begin(), a.load.end());
  a.at_max = static_cast<size_t>(
    std::count_if(a.load.begin(), a.load.end(), [&](double l) { return l >= a.max - eps; }));
}

/// (max, ranks at max), lexicographically, strictly smaller.
bool better(const assignment& a, const assignment& b, double eps) {
  if (!a.ok)
    return false;
  if (!b.ok)
    return true;
  if (a.max < b.max - eps)
    return true;
  return a.max <= b.max + eps && a.at_max < b.at_max;
}

assignment greedy(const problem& p) {
  assignment a;
  a.rank_of.resize(p.items.size());
  a.load.assign(p.ranks, 0.0);
  std::vector<uint32_t> count(p.ranks, 0);
  std::vector<uint8_t> hosts(static_cast<size_t>(p.ranks) * p.experts, 0);
  for (size_t i = 0; i < p.items.size(); ++i) {
    const auto& it = p.items[i];
    rank_id best = no_rank;
    for (rank_id r = 0; r < p.ranks; ++r) {
      if (!p.room(r, count[r]) || hosts[static_cast<size_t>(r) * p.experts + it.expert])
        continue;
      if (best == no_rank || a.load[r] < a.load[best] ||
          (a.load[r] == a.load[best] && count[r] < count[best]))
        best = r;
    }
    if (best == no_rank)
      return a; // ok stays false
    a.rank_of[i] = best;
    a.load[best] += it.load;
    ++count[best];
    hosts[static_cast<size_t>(best) * p.experts + it.expert] = 1;
  }
  a.ok = true;
  score(a, p.eps);
  return a;
}

/// Depth-first branch and bound on the max load, from `start`.
class exact_search {
public:
  exact_search(const problem& p, assignment start, uint64_t limit)
    : p_(p), best_(std::move(start)), limit_(limit), load_(p.ranks, 0.0), count_(p.ranks, 0),
      hosts_(static_cast<size_t>(p.ranks) * p.experts, 0), cur_(p.items.size(), 0) {
    double total = 0;
    for (const auto& it : p.items)
      total += it.load;
    const auto live = std::count_if(p.cap.begin(), p.cap.end(), [](uint32_t c) { return c > 0; });
    bound_ = total / static_cast<double>(std::max<std::ptrdiff_t>(1, live));
    if (!p.items.empty())
      bound_ = std::max(bound_, p.items.front().load);
  }

  /// Returns whether the result is proven optimal.
  bool run() {
    if (best_.max <= bound_ + p_.eps)
      return true;
    if (limit_ == 0)
      return false;
    dfs(0, 0.0);
    return !aborted_ || best_.max <= bound_ + p_.eps;
  }

  assignment take() { return std::move(best_); }

private:
  void dfs(size_t i, double cur_max) {
    if (++nodes_ > limit_) {
      aborted_ = true;
      return;
    }
    if (i == p_.items.size()) {
      if (cur_max < best_.max - p_.eps) {
        best_.rank_of = cur_;
        best_.load = load_;
        score(best_, p_.eps);
      }
      return;
    }
    if (std::max(cur_max, bound_) >= best_.max - p_.eps)
      return;
    const auto& it = p_.items[i];
    std::vector<rank_id> order;
    std::vector<uint32_t> empty_caps; // empty ranks of equal capacity are interchangeable: try one
    for (rank_id r = 0; r < p_.ranks; ++r) {
      if (!p_.room(r, count_[r]) || hosts_[static_cast<size_t>(r) * p_.experts + it.expert])
        continue;
      if (count_[r] == 0) {
        if (std::find(empty_caps.begin(), empty_caps.end(), p_.cap[r]) != empty_caps.end())
          continue;
        empty_caps.push_back(p_.cap[r]);
      }
      order.push_back(r);
    }
    std::sort(order.begin(), order.end(), [&](rank_id a, rank_id b) {
      if (load_[a] != load_[b])
        return load_[a] < load_[b];
      if (count_[a] != count_[b])
        return count_[a] < count_[b];
      return a < b;
    });
    for (auto r : order) {
      const double nl = load_[r] + it.load;
      if (nl >= best_.max - p_.eps)
        continue;
      const size_t h = static_cast<size_t>(r) * p_.experts + it.expert;
      load_[r] = nl;
      ++count_[r];
      hosts_[h] = 1;
      cur_[i] = r;
      dfs(i + 1, std::max(cur_max, nl));
      load_[r] -= it.load;
      --count_[r];
      hosts_[h] = 0;
      if (aborted_ || best_.max <= bound_ + p_.eps)
        return;
    }
  }

  const problem& p_;
  assignment best_;
  uint64_t limit_;
  uint64_t nodes_ = 0;
  bool aborted_ = false;
  double bound_ = 0;
  std::vector<double> load_;
  std::vector<uint32_t> count_;
  std::vector<uint8_t> hosts_;
  std::vector<rank_id> cur_;
};

/// place_experts' replication, from one replica each: one more replica of a
/// hot expert on a most loaded rank of the greedy assignment, hottest per
/// replica first (ties by expert id), kept when greedy LPT then lowers (max
/// load, ranks at the max); while one does and the budget and the slots
/// allow. `best` gets the greedy assignment of the counts returned.
std::vector<uint32_t> lpt_replicas(std::span<const uint64_t> tokens, std::span<const uint32_t> caps,
                                   uint32_t budget, double eps, assignment& best) {
  uint64_t slots = 0;
  for (auto c : caps)
    slots = (c == unbounded || slots == std::numeric_limits<uint64_t>::max())
                ? std::numeric_limits<uint64_t>::max()
                : slots + c;
  const auto live = static_cast<uint32_t>(
      std::count_if(caps.begin(), caps.end(), [](uint32_t c) { return c > 0; }));
  std::vector<uint32_t> replicas(tokens.size(), 1);
  best = greedy(make_problem(tokens, replicas, caps, eps));
  if (!best.ok)
    return replicas;
  uint64_t placed = tokens.size();
  for (; budget > 0; --budget) {
    if (placed >= slots)
      break;
    const auto p = make_problem(tokens, replicas, caps, eps);
    std::vector<expert_id> hot;
    for (size_t i = 0; i < p.items.size(); ++i) {
      const auto e = p.items[i].expert;
      if (best.load[best.rank_of[i]] >= best.max - eps && replicas[e] < live && tokens[e] > 0)
        hot.push_back(e);
    }
    std::sort(hot.begin(), hot.end(), [&](expert_id a, expert_id b) {
      const double la = static_cast<double>(tokens[a]) / replicas[a];
      const double lb = static_cast<double>(tokens[b]) / replicas[b];
      if (la != lb)
        return la > lb;
      return a < b;
    });
    hot.erase(std::unique(hot.begin(), hot.end()), hot.end());
    bool accepted = false;
    for (auto e : hot) {
      ++replicas[e];
      auto trial = greedy(make_problem(tokens, replicas, caps, eps));
      if (better(trial, best, eps)) {
        best = std::move(trial);
        accepted = true;
        ++placed;
        break;
      }
      --replicas[e];
    }
    if (!accepted)
      break;
  }
  return replicas;
}

} // namespace

expected<placement> place_experts(std::span<const uint64_t> tokens, const placement_options& o) {
  if (tokens.empty())
    return make_error(errc::invalid_argument, "no experts to place");
  if (o.ranks == 0)
    return make_error(errc::invalid_argument, "no ranks to place experts on");
  const uint64_t slots = static_cast<uint64_t>(o.ranks) * o.capacity;
  if (o.capacity != 0 && tokens.size() > slots)
    return make_error(errc::invalid_argument,
                      std::to_string(tokens.size()) + " experts do not fit on " +
                          std::to_string(o.ranks) + " ranks of capacity " +
                          std::to_string(o.capacity));

  double total = 0;
  for (auto t : tokens)
    total += static_cast<double>(t);
  const double eps = 1e-9 * std::max(1.0, total);

  const auto caps = uniform_caps(o);
  assignment best;
  const auto replicas = lpt_replicas(tokens, caps, o.replication_budget, eps, best);
  CMESH_CHECK(best.ok);

  const auto p = make_problem(tokens, replicas, caps, eps);
  exact_search search(p, std::move(best), o.search_nodes);
  const bool optimal = search.run();
  auto a = search.take();

  placement out;
  out.expert_ranks.resize(tokens.size());
  out.rank_experts.resize(o.ranks);
  out.rank_load.assign(o.ranks, 0.0);
  for (size_t i = 0; i < p.items.size(); ++i) {
    const auto r = a.rank_of[i];
    const auto& it = p.items[i];
    out.expert_ranks[it.expert].push_back(r);
    out.rank_experts[r].push_back(it.expert);
    out.rank_load[r] += it.load;
  }
  for (auto& v : out.expert_ranks)
    std::sort(v.begin(), v.end());
  for (auto& v : out.rank_experts)
    std::sort(v.begin(), v.end());
  out.max_load = *std::max_element(out.rank_load.begin(), out.rank_load.end());
  out.mean_load = total / o.ranks;
  out.imbalance = imbalance(out.rank_load);
  out.optimal = optimal;
  return out;
}

expected<std::vector<double>> rank_loads(std::span<const uint64_t> tokens,
                                         const std::vector<std::vector<rank_id>>& expert_ranks,
                                         uint32_t ranks) {
  if (tokens.size() != expert_ranks.size())
    return make_error(errc::invalid_argument,
                      std::to_string(tokens.size()) + " token counts for " +
                          std::to_string(expert_ranks.size()) + " placed experts");
  std::vector<double> load(ranks, 0.0);
  for (size_t e = 0; e < tokens.size(); ++e) {
    const auto& rs = expert_ranks[e];
    if (rs.empty())
      return make_error(errc::invalid_argument, "expert " + std::to_string(e) + " has no rank");
    for (auto r : rs) {
      if (r >= ranks)
        return make_error(errc::invalid_argument, "expert " + std::to_string(e) + " on rank " +
                                                      std::to_string(r) + " of " +
                                                      std::to_string(ranks));
      load[r] += static_cast<double>(tokens[e]) / static_cast<double>(rs.size());
    }
  }
  return load;
}

namespace {

caf::error sorted_set(const std::vector<rank_id>& in, size_t e, const char* which,
                      std::vector<rank_id>& out) {
  out = in;
  std::sort(out.begin(), out.end());
  if (out.empty())
    return make_error(errc::invalid_argument,
                      std::string(which) + ": expert " + std::to_string(e) + " has no rank");
  if (std::adjacent_find(out.begin(), out.end()) != out.end())
    return make_error(errc::invalid_argument,
                      std::string(which) + ": expert " + std::to_string(e) + " on a rank twice");
  return {};
}

} // namespace

expected<std::vector<expert_move>> moves_between(const std::vector<std::vector<rank_id>>& before,
                                                 const std::vector<std::vector<rank_id>>& after) {
  if (before.size() != after.size())
    return make_error(errc::invalid_argument,
                      std::to_string(before.size()) + " experts before, " +
                          std::to_string(after.size()) + " after");
  std::vector<expert_move> out;
  std::vector<rank_id> b, a, gained, lost, kept;
  for (expert_id e = 0; e < before.size(); ++e) {
    if (auto err = sorted_set(before[e], e, "before", b))
      return err;
    if (auto err = sorted_set(after[e], e, "after", a))
      return err;
    gained.clear();
    lost.clear();
    kept.clear();
    std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(gained));
    std::set_difference(b.begin(), b.end(), a.begin(), a.end(), std::back_inserter(lost));
    std::set_intersection(b.begin(), b.end(), a.begin(), a.end(), std::back_inserter(kept));
    const size_t paired = std::min(gained.size(), lost.size());
    for (size_t i = 0; i < paired; ++i)
      out.push_back({e, lost[i], gained[i], move_kind::move});
    const auto& sources = kept.empty() ? b : kept;
    for (size_t i = paired; i < gained.size(); ++i)
      out.push_back({e, sources[(i - paired) % sources.size()], gained[i], move_kind::copy});
    for (size_t i = paired; i < lost.size(); ++i)
      out.push_back({e, lost[i], no_rank, move_kind::drop});
  }
  return out;
}

// ---------------------------------------------------------------------------
// plan_placement, place_lpt, place_eplb.

std::string_view to_string(plan_reason r) {
  switch (r) {
    case plan_reason::first_placement:
      return "first placement";
    case plan_reason::unchanged:
      return "unchanged: nothing to gain";
    case plan_reason::forced:
      return "forced: a rank lost its slots or the budget shrank (must move)";
    case plan_reason::rebalance_pays:
      return "rebalance pays";
    case plan_reason::rebalance_does_not_pay:
      return "rebalance does not pay";
  }
  return "unknown";
}

namespace {

using layout_hosts = std::vector<std::vector<rank_id>>;

double share(std::span<const uint64_t> tokens, expert_id e, size_t replicas) {
  return static_cast<double>(tokens[e]) / static_cast<double>(replicas);
}

/// ta / ra > tb / rb, exactly (the EPLB choices compare these).
bool heavier(uint64_t ta, uint64_t ra, uint64_t tb, uint64_t rb) {
  return static_cast<unsigned __int128>(ta) * rb > static_cast<unsigned __int128>(tb) * ra;
}

double sum_tokens(std::span<const uint64_t> tokens) {
  double total = 0;
  for (auto t : tokens)
    total += static_cast<double>(t);
  return total;
}

size_t live_ranks(std::span<const uint32_t> slots) {
  return static_cast<size_t>(
      std::count_if(slots.begin(), slots.end(), [](uint32_t s) { return s > 0; }));
}

/// Whether some placement has these replica counts: Gale and Ryser's
/// condition for a 0/1 matrix with row sums `replicas` (each expert at most
/// once per rank) and column sums at most `slots`: the k largest counts
/// together need at most sum over ranks of min(slots, k), for every k.
bool feasible(std::span<const uint32_t> replicas, std::span<const uint32_t> slots) {
  std::vector<uint32_t> d(replicas.begin(), replicas.end());
  std::sort(d.begin(), d.end(), std::greater<>());
  std::vector<uint32_t> s(slots.begin(), slots.end());
  std::sort(s.begin(), s.end());
  // sum over ranks of min(slots, k) = the slots of ranks with at most k, plus
  // k for every other rank.
  size_t small = 0;
  uint64_t small_slots = 0, need = 0;
  for (size_t k = 1; k <= d.size(); ++k) {
    for (; small < s.size() && s[small] <= k; ++small)
      small_slots += s[small];
    need += d[k - 1];
    if (need > small_slots + k * (s.size() - small))
      return false;
  }
  return true;
}

/// EPLB's replication: one more replica at a time to the expert with the most
/// tokens per replica (ties: lower id), up to `total` replicas, at most `cap`
/// per expert and, with `slots`, only while a placement still exists.
/// `skip_idle` stops when that expert has no tokens (a replica of it gains
/// nothing).
std::vector<uint32_t> eplb_replicas(std::span<const uint64_t> tokens, uint64_t total, uint32_t cap,
                                    std::span<const uint32_t> slots, bool skip_idle) {
  const size_t n = tokens.size();
  std::vector<uint32_t> r(n, 1);
  std::vector<uint8_t> full(n, 0); // another replica would not fit
  for (uint64_t placed = n; placed < total;) {
    size_t best = n;
    for (size_t e = 0; e < n; ++e)
      if (!full[e] && r[e] < cap && (best == n || heavier(tokens[e], r[e], tokens[best], r[best])))
        best = e;
    if (best == n || (skip_idle && tokens[best] == 0))
      break;
    ++r[best];
    if (!slots.empty() && !feasible(r, slots)) {
      --r[best];
      full[best] = 1;
      continue;
    }
    ++placed;
  }
  return r;
}

/// A placement under construction: per expert its ranks, per rank its
/// experts and load.
struct layout {
  layout_hosts hosts;
  std::vector<std::vector<expert_id>> held;
  std::vector<double> load;

  bool on(expert_id e, rank_id r) const {
    return std::find(hosts[e].begin(), hosts[e].end(), r) != hosts[e].end();
  }
};

layout make_layout(layout_hosts hosts, std::span<const uint64_t> tokens, size_t ranks) {
  layout l;
  l.hosts = std::move(hosts);
  l.held.resize(ranks);
  l.load.assign(ranks, 0.0);
  for (expert_id e = 0; e < l.hosts.size(); ++e)
    for (auto r : l.hosts[e]) {
      l.held[r].push_back(e);
      l.load[r] += share(tokens, e, l.hosts[e].size());
    }
  return l;
}

/// Moves expert e's replica on `from` to `to`.
void relocate(layout& l, std::span<const uint64_t> tokens, expert_id e, rank_id from, rank_id to) {
  auto& h = l.hosts[e];
  *std::find(h.begin(), h.end(), from) = to;
  auto& src = l.held[from];
  src.erase(std::find(src.begin(), src.end(), e));
  l.held[to].push_back(e);
  const double x = share(tokens, e, h.size());
  l.load[from] -= x;
  l.load[to] += x;
}

/// Local improvement: the best move (to a rank with a free slot) or swap (with
/// a lighter replica) of one replica off the most loaded rank (lowest id among
/// ties) that leaves both ranks below that rank's load, lowest resulting peak
/// first, a move before a swap; until none does. Each step lowers (max load,
/// ranks at the max), so it ends; `max_steps` bounds it anyway. The replica
/// counts stay.
void improve(layout& l, std::span<const uint64_t> tokens, std::span<const uint32_t> slots,
             double eps, size_t max_steps) {
  struct option {
    double peak;
    int kind; // 0 move, 1 swap
    expert_id e;
    rank_id r;
    expert_id f;
  };
  for (size_t step = 0; step < max_steps; ++step) {
    const auto m =
        static_cast<rank_id>(std::max_element(l.load.begin(), l.load.end()) - l.load.begin());
    const double top = l.load[m];
    std::optional<option> best;
    auto consider = [&](const option& c) {
      if (c.peak < top - eps &&
          (!best || c.peak < best->peak || (c.peak == best->peak && c.kind < best->kind)))
        best = c;
    };
    for (auto e : l.held[m]) {
      const double x = share(tokens, e, l.hosts[e].size());
      if (!(x > eps))
        continue;
      for (rank_id r = 0; r < slots.size(); ++r) {
        if (r == m || slots[r] == 0 || l.on(e, r))
          continue;
        if (l.held[r].size() < slots[r])
          consider({std::max(top - x, l.load[r] + x), 0, e, r, 0});
        for (auto f : l.held[r]) {
          const double y = share(tokens, f, l.hosts[f].size());
          if (y < x - eps && !l.on(f, m))
            consider({std::max(top - x + y, l.load[r] + x - y), 1, e, r, f});
        }
      }
    }
    if (!best)
      return;
    relocate(l, tokens, best->e, m, best->r);
    if (best->kind == 1)
      relocate(l, tokens, best->f, best->r, m);
  }
}

/// A placement for any feasible replica counts: experts by count descending
/// (ties: lower id), each onto the ranks with the most free slots (ties:
/// lower id), as in Gale and Ryser's construction, which cannot strand a
/// replica when the counts are feasible. Used when greedy LPT strands one.
assignment fill(const problem& p) {
  std::vector<uint32_t> count(p.experts, 0);
  for (const auto& it : p.items)
    ++count[it.expert];
  std::vector<expert_id> order(p.experts);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return count[a] > count[b]; });
  std::vector<uint32_t> free(p.cap.begin(), p.cap.end());
  std::vector<std::vector<rank_id>> at(p.experts);
  std::vector<rank_id> ranks(p.ranks);
  for (auto e : order) {
    std::iota(ranks.begin(), ranks.end(), 0);
    std::stable_sort(ranks.begin(), ranks.end(), [&](auto a, auto b) { return free[a] > free[b]; });
    for (uint32_t k = 0; k < count[e]; ++k) {
      if (free[ranks[k]] == 0)
        return {};
      --free[ranks[k]];
      at[e].push_back(ranks[k]);
    }
  }
  assignment a;
  a.rank_of.resize(p.items.size());
  a.load.assign(p.ranks, 0.0);
  for (size_t i = 0; i < p.items.size(); ++i) {
    a.rank_of[i] = at[p.items[i].expert][p.items[i].replica];
    a.load[a.rank_of[i]] += p.items[i].load;
  }
  a.ok = true;
  score(a, p.eps);
  return a;
}

/// Which rank every item went to, per expert.
layout_hosts hosts_of(const problem& p, const assignment& a) {
  layout_hosts hosts(p.experts);
  for (size_t i = 0; i < p.items.size(); ++i)
    hosts[p.items[i].expert].push_back(a.rank_of[i]);
  return hosts;
}

/// Greedy LPT for given (feasible) replica counts, then the branch and bound;
/// `proven` says whether the search proved the max load optimal.
layout pack(std::span<const uint64_t> tokens, std::span<const uint32_t> replicas,
            std::span<const uint32_t> slots, uint64_t nodes, double eps, bool& proven) {
  const auto p = make_problem(tokens, replicas, slots, eps);
  auto start = greedy(p);
  if (!start.ok)
    start = fill(p);
  CMESH_CHECK(start.ok);
  exact_search search(p, std::move(start), nodes);
  proven = search.run();
  return make_layout(hosts_of(p, search.take()), tokens, slots.size());
}

/// Renames the ranks of `l` (only among ranks of equal slots, so it stays
/// valid and keeps its loads) to share the most experts with `ref`: pairs by
/// shared experts, most first (ties: lower ids), the rest in id order.
void relabel(layout& l, const layout& ref, std::span<const uint32_t> slots) {
  const size_t n = slots.size();
  struct pair_overlap {
    size_t shared;
    rank_id from, to;
  };
  std::vector<pair_overlap> pairs;
  for (rank_id i = 0; i < n; ++i)
    for (rank_id j = 0; j < n; ++j) {
      if (slots[i] != slots[j])
        continue;
      size_t shared = 0;
      for (auto e : l.held[i])
        shared += ref.on(e, j);
      pairs.push_back({shared, i, j});
    }
  std::stable_sort(pairs.begin(), pairs.end(),
                   [](const auto& a, const auto& b) { return a.shared > b.shared; });
  std::vector<rank_id> to(n, no_rank);
  std::vector<uint8_t> taken(n, 0);
  for (const auto& pr : pairs)
    if (to[pr.from] == no_rank && !taken[pr.to]) {
      to[pr.from] = pr.to;
      taken[pr.to] = 1;
    }
  for (auto& hs : l.hosts)
    for (auto& r : hs)
      r = to[r];
  std::vector<std::vector<expert_id>> held(n);
  std::vector<double> load(n, 0.0);
  for (rank_id i = 0; i < n; ++i) {
    held[to[i]] = std::move(l.held[i]);
    load[to[i]] = l.load[i];
  }
  l.held = std::move(held);
  l.load = std::move(load);
}

/// The placement of `hosts`, loads summed afresh; mean over the ranks with slots.
placement finish(layout_hosts hosts, std::span<const uint64_t> tokens,
                 std::span<const uint32_t> slots, bool optimal) {
  for (auto& rs : hosts)
    std::sort(rs.begin(), rs.end());
  layout l = make_layout(std::move(hosts), tokens, slots.size());
  placement out;
  out.expert_ranks = std::move(l.hosts);
  out.rank_experts = std::move(l.held);
  out.rank_load = std::move(l.load);
  const double total = sum_tokens(tokens);
  out.max_load = *std::max_element(out.rank_load.begin(), out.rank_load.end());
  out.mean_load = total / static_cast<double>(std::max<size_t>(1, live_ranks(slots)));
  out.imbalance = out.mean_load > 0 ? out.max_load / out.mean_load : 1.0;
  out.optimal = optimal;
  return out;
}

std::string str(double x) {
  return fmt::format("{:.6g}", x);
}

caf::error check_current(const layout_hosts& current, size_t experts, size_t ranks) {
  if (current.empty())
    return {};
  if (current.size() != experts)
    return make_error(errc::invalid_argument,
                      fmt::format("the current placement has {} experts, the token counts {}",
                                  current.size(), experts));
  for (size_t e = 0; e < current.size(); ++e) {
    if (current[e].empty())
      return make_error(errc::invalid_argument,
                        fmt::format("current placement: expert {} has no rank", e));
    for (size_t i = 0; i < current[e].size(); ++i) {
      const auto r = current[e][i];
      if (r >= ranks)
        return make_error(
            errc::invalid_argument,
            fmt::format("current placement: expert {} on rank {} of {}", e, r, ranks));
      if (std::find(current[e].begin(), current[e].begin() + i, r) != current[e].begin() + i)
        return make_error(errc::invalid_argument,
                          fmt::format("current placement: expert {} on rank {} twice", e, r));
    }
  }
  return {};
}

caf::error check_plan_input(std::span<const uint64_t> tokens, std::span<const uint32_t> slots,
                            const layout_hosts& current, const plan_options& o) {
  if (tokens.empty())
    return make_error(errc::invalid_argument, "no experts to place");
  if (slots.empty())
    return make_error(errc::invalid_argument, "no ranks to place experts on");
  const uint64_t total = std::accumulate(slots.begin(), slots.end(), uint64_t{0});
  if (tokens.size() > total)
    return make_error(errc::invalid_argument,
                      fmt::format("{} experts do not fit in {} slots over {} ranks ({} with slots)",
                                  tokens.size(), total, slots.size(), live_ranks(slots)));
  const auto& c = o.cost;
  if (c.window_steps == 0)
    return make_error(errc::invalid_argument, "cost.window_steps must be at least 1");
  if (!(c.seconds_per_token >= 0) || !std::isfinite(c.seconds_per_token))
    return make_error(errc::invalid_argument,
                      "cost.seconds_per_token must be finite and >= 0, not " +
                          str(c.seconds_per_token));
  if (c.expert_bytes > 0 && !(c.bytes_per_second > 0))
    return make_error(errc::invalid_argument,
                      "cost.bytes_per_second must be > 0 when experts have bytes, not " +
                          str(c.bytes_per_second));
  return check_current(current, tokens.size(), slots.size());
}

/// The current placement, made to fit (see the header): ranks over their
/// slots drop the excess, replicas over `max_replicas` in total are dropped,
/// experts left with no rank go to the least loaded rank with room.
struct repaired {
  layout_hosts hosts;
  std::vector<std::string> notes; // what was forced; empty when nothing was
};

void evict_over_slots(std::span<const uint64_t> tokens, std::span<const uint32_t> slots,
                      repaired& out) {
  auto& hosts = out.hosts;
  for (rank_id r = 0; r < slots.size(); ++r) {
    std::vector<expert_id> held;
    for (expert_id e = 0; e < hosts.size(); ++e)
      if (std::find(hosts[e].begin(), hosts[e].end(), r) != hosts[e].end())
        held.push_back(e);
    if (held.size() <= slots[r])
      continue;
    out.notes.push_back(
        fmt::format("rank {} holds {} experts over its {} slots", r, held.size(), slots[r]));
    // Replicated experts first (dropping one copies nothing), then the lightest.
    std::stable_sort(held.begin(), held.end(), [&](expert_id a, expert_id b) {
      const bool ma = hosts[a].size() > 1, mb = hosts[b].size() > 1;
      if (ma != mb)
        return ma;
      return heavier(tokens[b], hosts[b].size(), tokens[a], hosts[a].size());
    });
    for (size_t i = 0; i < held.size() - slots[r]; ++i) {
      auto& h = hosts[held[i]];
      h.erase(std::find(h.begin(), h.end(), r));
    }
  }
}

void drop_over_budget(std::span<const uint64_t> tokens, size_t ranks, uint64_t max_replicas,
                      repaired& out) {
  auto& hosts = out.hosts;
  uint64_t total = 0;
  for (const auto& h : hosts)
    total += std::max<size_t>(1, h.size()); // an expert with no rank needs one
  const uint64_t over = total > max_replicas ? total - max_replicas : 0;
  for (uint64_t k = 0; k < over; ++k) {
    // The replica whose loss raises its expert's per-replica load least.
    size_t best = hosts.size();
    for (expert_id e = 0; e < hosts.size(); ++e)
      if (hosts[e].size() > 1 &&
          (best == hosts.size() ||
           heavier(tokens[best], hosts[best].size() - 1, tokens[e], hosts[e].size() - 1)))
        best = e;
    CMESH_CHECK(best < hosts.size());
    const auto load = make_layout(hosts, tokens, ranks).load;
    auto& h = hosts[best];
    auto at = std::max_element(h.begin(), h.end(), [&](rank_id a, rank_id b) {
      return load[a] < load[b] || (load[a] == load[b] && a > b);
    });
    h.erase(at);
  }
  if (over > 0)
    out.notes.push_back(
        fmt::format("{} replicas dropped: over the {} the replication budget and the slots allow",
                    over, max_replicas));
}

repaired repair(std::span<const uint64_t> tokens, std::span<const uint32_t> slots,
                const layout_hosts& current, uint64_t max_replicas) {
  repaired out{current, {}};
  evict_over_slots(tokens, slots, out);
  drop_over_budget(tokens, slots.size(), max_replicas, out);
  std::vector<expert_id> orphans;
  for (expert_id e = 0; e < out.hosts.size(); ++e)
    if (out.hosts[e].empty())
      orphans.push_back(e);
  std::stable_sort(orphans.begin(), orphans.end(),
                   [&](expert_id a, expert_id b) { return tokens[a] > tokens[b]; });
  for (auto e : orphans) {
    const auto l = make_layout(out.hosts, tokens, slots.size());
    rank_id best = no_rank;
    for (rank_id r = 0; r < slots.size(); ++r) {
      if (l.held[r].size() >= slots[r])
        continue;
      if (best == no_rank || l.load[r] < l.load[best] ||
          (l.load[r] == l.load[best] && l.held[r].size() < l.held[best].size()))
        best = r;
    }
    CMESH_CHECK(best != no_rank); // the slots hold every replica left
    out.hosts[e].push_back(best);
  }
  return out;
}

/// One candidate placement, weighed against the (repaired) current one.
struct candidate {
  const char* name;
  placement placed;
  std::vector<expert_move> moves;
  size_t moved = 0; // moves and copies (drops are free)
  double saving_s = 0;
  double cost_s = 0; // beyond the forced moves
};

size_t moved_count(const std::vector<expert_move>& moves) {
  return static_cast<size_t>(std::count_if(
      moves.begin(), moves.end(), [](const expert_move& m) { return m.kind != move_kind::drop; }));
}

double move_cost_s(size_t moved, const placement_cost& c) {
  return c.expert_bytes == 0 ? 0.0
                             : static_cast<double>(moved) * static_cast<double>(c.expert_bytes) /
                                   c.bytes_per_second;
}

/// Everything plan_placement shares between its steps.
struct plan_context {
  std::span<const uint64_t> tokens;
  std::span<const uint32_t> slots;
  const plan_options& o;
  double eps = 0;
  uint64_t max_replicas = 0;
  size_t improve_steps = 0;
};

candidate make_candidate(const plan_context& c, const char* name, layout l, bool proven,
                         const layout_hosts& current, const placement& base, double base_cost) {
  improve(l, c.tokens, c.slots, c.eps, c.improve_steps);
  candidate out{name, finish(std::move(l.hosts), c.tokens, c.slots, proven), {}, 0, 0, 0};
  if (current.empty())
    return out;
  auto moves = moves_between(current, out.placed.expert_ranks);
  CMESH_CHECK(moves);
  out.moves = std::move(*moves);
  out.moved = moved_count(out.moves);
  const auto& k = c.o.cost;
  const double gain = base.max_load - out.placed.max_load;
  out.saving_s = gain > c.eps ? gain / static_cast<double>(k.window_steps) * k.seconds_per_token *
                                    static_cast<double>(k.horizon_steps)
                              : 0.0;
  out.cost_s = move_cost_s(out.moved, k) - base_cost;
  return out;
}

/// Largest saving minus cost; ties: fewer moves, lower max, earlier.
bool preferred(const candidate& a, const candidate& b) {
  const double na = a.saving_s - a.cost_s, nb = b.saving_s - b.cost_s;
  if (na != nb)
    return na > nb;
  if (a.moved != b.moved)
    return a.moved < b.moved;
  return a.placed.max_load < b.placed.max_load;
}

std::string describe_load(const placement& p) {
  return fmt::format("max load {} (imbalance {:.4f})", str(p.max_load), p.imbalance);
}

/// The plan once the candidates are weighed: the best when it pays and is
/// never worse, else the repaired current placement.
placement_plan decide(std::vector<candidate> cands, candidate base, const std::string& forced,
                      const placement_cost& k, double eps) {
  std::stable_sort(cands.begin(), cands.end(), preferred);
  const auto& best = cands.front();
  const bool pays =
      best.saving_s - best.cost_s > 0 && best.placed.max_load <= base.placed.max_load + eps;
  placement_plan out;
  out.max_load_before = base.placed.max_load;
  out.saving_s = best.saving_s;
  out.cost_s = best.cost_s;
  const auto numbers =
      fmt::format("max load {} -> {}, {} moves: saving {} s over {} steps vs cost {} s",
                  str(base.placed.max_load), str(best.placed.max_load), best.moved,
                  str(best.saving_s), k.horizon_steps, str(best.cost_s));
  auto& chosen = pays ? cands.front() : base;
  out.placed = std::move(chosen.placed);
  out.moves = std::move(chosen.moves);
  if (!forced.empty()) {
    out.reason = plan_reason::forced;
    out.detail = fmt::format("forced: {}; {} moves", forced, moved_count(out.moves));
    out.detail += pays ? fmt::format("; then rebalance pays ({}): {}", best.name, numbers)
                       : "; " + describe_load(out.placed);
  } else if (pays) {
    out.reason = plan_reason::rebalance_pays;
    out.detail = fmt::format("rebalance pays ({}): {}", best.name, numbers);
  } else if (best.saving_s > 0) {
    out.reason = plan_reason::rebalance_does_not_pay;
    out.detail = fmt::format("rebalance does not pay ({}): {}", best.name, numbers);
  } else {
    out.reason = plan_reason::unchanged;
    out.detail = "unchanged: nothing to gain; " + describe_load(out.placed);
  }
  return out;
}

std::vector<uint32_t> counts_of(const layout_hosts& hosts) {
  std::vector<uint32_t> out(hosts.size());
  for (size_t e = 0; e < hosts.size(); ++e)
    out[e] = static_cast<uint32_t>(hosts[e].size());
  return out;
}

} // namespace

namespace {

/// A fresh packing for some replica counts.
struct fresh_pack {
  const char* name;
  layout l;
  bool proven = false;
  uint64_t replicas = 0;
};

/// Fresh packings for EPLB's replica counts and for place_experts' (when
/// they differ): filling every slot helps a skewed load, while stopping when
/// a replica no longer lowers the greedy max suits a steeper one.
std::vector<fresh_pack> fresh_packs(const plan_context& c) {
  const auto live = static_cast<uint32_t>(live_ranks(c.slots));
  std::vector<std::pair<const char*, std::vector<uint32_t>>> counts;
  counts.emplace_back("fresh", eplb_replicas(c.tokens, c.max_replicas, live, c.slots, true));
  assignment unused;
  const auto extra = static_cast<uint32_t>(
      std::min<uint64_t>(c.max_replicas - c.tokens.size(), std::numeric_limits<uint32_t>::max()));
  auto lpt = lpt_replicas(c.tokens, c.slots, extra, c.eps, unused);
  if (lpt != counts.front().second)
    counts.emplace_back("fresh, fewer replicas", std::move(lpt));
  std::vector<fresh_pack> out;
  for (const auto& [name, n] : counts) {
    fresh_pack f{name, {}, false, std::accumulate(n.begin(), n.end(), uint64_t{0})};
    f.l = pack(c.tokens, n, c.slots, c.o.search_nodes, c.eps, f.proven);
    out.push_back(std::move(f));
  }
  return out;
}

/// A first placement: the fresh candidate of the lowest max load (ties: fewer
/// replicas, then the order of fresh_packs).
placement_plan first_plan(const plan_context& c, std::vector<fresh_pack> fresh) {
  std::optional<candidate> best;
  uint64_t best_replicas = 0;
  for (auto& f : fresh) {
    auto x = make_candidate(c, f.name, std::move(f.l), f.proven, {}, {}, 0);
    if (!best || x.placed.max_load < best->placed.max_load - c.eps ||
        (x.placed.max_load <= best->placed.max_load + c.eps && f.replicas < best_replicas)) {
      best = std::move(x);
      best_replicas = f.replicas;
    }
  }
  placement_plan out;
  out.placed = std::move(best->placed);
  out.detail =
      fmt::format("first placement ({}): {}, {} replicas of {} experts over {} ranks", best->name,
                  describe_load(out.placed), best_replicas, c.tokens.size(), live_ranks(c.slots));
  return out;
}

} // namespace

expected<placement_plan> plan_placement(std::span<const uint64_t> tokens,
                                        std::span<const uint32_t> slots,
                                        const layout_hosts& current, const plan_options& o) {
  if (auto err = check_plan_input(tokens, slots, current, o))
    return err;
  const uint64_t total_slots = std::accumulate(slots.begin(), slots.end(), uint64_t{0});
  const double total = sum_tokens(tokens);
  plan_context c{tokens, slots, o};
  c.eps = 1e-9 * std::max(1.0, total);
  c.max_replicas =
      tokens.size() + std::min<uint64_t>(o.replication_budget, total_slots - tokens.size());
  c.improve_steps = 8 * (c.max_replicas + slots.size());
  auto fresh = fresh_packs(c);
  if (current.empty())
    return first_plan(c, std::move(fresh));

  // The current placement made to fit: the baseline every candidate is
  // weighed against, its forced moves paid whatever the cost.
  auto rep = repair(tokens, slots, current, c.max_replicas);
  const auto base_layout = make_layout(rep.hosts, tokens, slots.size());
  candidate base{"current", finish(rep.hosts, tokens, slots, false), {}, 0, 0, 0};
  auto base_moves = moves_between(current, base.placed.expert_ranks);
  CMESH_CHECK(base_moves);
  base.moves = std::move(*base_moves);
  base.moved = moved_count(base.moves);
  const double base_cost = move_cost_s(base.moved, o.cost);

  std::vector<candidate> cands;
  for (auto& f : fresh) {
    relabel(f.l, base_layout, slots);
    cands.push_back(
        make_candidate(c, f.name, std::move(f.l), f.proven, current, base.placed, base_cost));
  }
  cands.push_back(make_candidate(c, "kept", base_layout, false, current, base.placed, base_cost));
  bool proven = false;
  auto repacked = pack(tokens, counts_of(rep.hosts), slots, o.search_nodes, c.eps, proven);
  relabel(repacked, base_layout, slots);
  cands.push_back(
      make_candidate(c, "repacked", std::move(repacked), proven, current, base.placed, base_cost));
  std::string forced;
  for (const auto& n : rep.notes)
    forced += (forced.empty() ? "" : "; ") + n;
  return decide(std::move(cands), std::move(base), forced, o.cost, c.eps);
}

expected<placement> place_lpt(std::span<const uint64_t> tokens, std::span<const uint32_t> replicas,
                              std::span<const uint32_t> slots) {
  if (tokens.empty() || slots.empty())
    return make_error(errc::invalid_argument, "no experts or no ranks to place them on");
  if (replicas.size() != tokens.size())
    return make_error(errc::invalid_argument, fmt::format("{} replica counts for {} experts",
                                                          replicas.size(), tokens.size()));
  const auto live = live_ranks(slots);
  for (size_t e = 0; e < replicas.size(); ++e)
    if (replicas[e] == 0 || replicas[e] > live)
      return make_error(
          errc::invalid_argument,
          fmt::format("expert {}: {} replicas on {} ranks with slots", e, replicas[e], live));
  if (!feasible(replicas, slots))
    return make_error(errc::invalid_argument, "these replica counts do not fit in the slots");
  const double total = sum_tokens(tokens);
  const auto p = make_problem(tokens, replicas, slots, 1e-9 * std::max(1.0, total));
  const auto a = greedy(p);
  if (!a.ok)
    return make_error(errc::invalid_argument, "greedy LPT strands a replica with these counts");
  return finish(hosts_of(p, a), tokens, slots, false);
}

namespace {

/// EPLB's balanced packing with a fixed number of slots per rank: replicas
/// heaviest first (ties: lower expert), each onto the least loaded rank with a
/// free slot (ties: lower id), skipping ranks that host that expert already.
/// Should only ranks hosting it have free slots, it takes the place of a
/// replica of another expert on a full rank, and that replica goes to the free slot.
layout eplb_pack(std::span<const uint64_t> tokens, std::span<const uint32_t> replicas,
                 uint32_t ranks, uint32_t per_rank) {
  std::vector<expert_id> items;
  for (expert_id e = 0; e < tokens.size(); ++e)
    items.insert(items.end(), replicas[e], e);
  std::stable_sort(items.begin(), items.end(), [&](expert_id a, expert_id b) {
    return heavier(tokens[a], replicas[a], tokens[b], replicas[b]);
  });
  layout l = make_layout(layout_hosts(tokens.size()), tokens, ranks);
  for (auto e : items) {
    const double x = share(tokens, e, replicas[e]);
    rank_id best = no_rank, open = no_rank;
    for (rank_id r = 0; r < ranks; ++r) {
      if (l.held[r].size() >= per_rank)
        continue;
      open = r;
      if (!l.on(e, r) && (best == no_rank || l.load[r] < l.load[best]))
        best = r;
    }
    CMESH_CHECK(open != no_rank);
    if (best == no_rank) { // only ranks hosting e have room: trade with a full rank
      for (rank_id r = 0; r < ranks && best == no_rank; ++r) {
        if (l.on(e, r))
          continue;
        for (auto f : l.held[r])
          if (!l.on(f, open)) {
            relocate(l, tokens, f, r, open);
            best = r;
            break;
          }
      }
      CMESH_CHECK(best != no_rank);
    }
    l.hosts[e].push_back(best);
    l.held[best].push_back(e);
    l.load[best] += x;
  }
  return l;
}

} // namespace

expected<placement> place_eplb(std::span<const uint64_t> tokens, uint32_t ranks,
                               uint32_t slots_per_rank) {
  if (tokens.empty() || ranks == 0 || slots_per_rank == 0)
    return make_error(errc::invalid_argument, "no experts, ranks or slots");
  const uint64_t total = static_cast<uint64_t>(ranks) * slots_per_rank;
  if (tokens.size() > total)
    return make_error(errc::invalid_argument,
                      fmt::format("{} experts do not fit in {} ranks of {} slots", tokens.size(),
                                  ranks, slots_per_rank));
  const auto replicas = eplb_replicas(tokens, total, ranks, {}, false);
  auto l = eplb_pack(tokens, replicas, ranks, slots_per_rank);
  const std::vector<uint32_t> slots(ranks, slots_per_rank);
  return finish(std::move(l.hosts), tokens, slots, false);
}

} // namespace cmesh::recovery
