#include "recovery/placement.hpp"

#include "core/check.hpp"

#include <algorithm>
#include <iterator>
#include <numeric>
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

struct problem {
  std::vector<item> items; // load descending, then expert, then replica
  uint32_t ranks = 1;
  uint32_t capacity = 0;   // 0 = unbounded
  size_t experts = 0;
  double eps = 0;

  bool room(uint32_t count) const { return capacity == 0 || count < capacity; }
};

problem make_problem(std::span<const uint64_t> tokens, const std::vector<uint32_t>& replicas,
                     const placement_options& o, double eps) {
  problem p;
  p.ranks = o.ranks;
  p.capacity = o.capacity;
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
      if (!p.room(count[r]) || hosts[static_cast<size_t>(r) * p.experts + it.expert])
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
    bound_ = total / p.ranks;
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
    bool empty_tried = false;
    for (rank_id r = 0; r < p_.ranks; ++r) {
      if (!p_.room(count_[r]) || hosts_[static_cast<size_t>(r) * p_.experts + it.expert])
        continue;
      if (count_[r] == 0) { // empty ranks are interchangeable: try one
        if (empty_tried)
          continue;
        empty_tried = true;
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

  std::vector<uint32_t> replicas(tokens.size(), 1);
  auto best = greedy(make_problem(tokens, replicas, o, eps));
  CMESH_CHECK(best.ok);

  // Replication: one more replica of a hot expert on a most loaded rank,
  // while that helps and the budget and the slots allow.
  uint64_t placed = tokens.size();
  for (uint32_t budget = o.replication_budget; budget > 0; --budget) {
    if (o.capacity != 0 && placed >= slots)
      break;
    const auto p = make_problem(tokens, replicas, o, eps);
    std::vector<expert_id> hot;
    for (size_t i = 0; i < p.items.size(); ++i) {
      const auto e = p.items[i].expert;
      if (best.load[best.rank_of[i]] >= best.max - eps && replicas[e] < o.ranks && tokens[e] > 0)
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
      auto trial = greedy(make_problem(tokens, replicas, o, eps));
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

  const auto p = make_problem(tokens, replicas, o, eps);
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

} // namespace cmesh::recovery
