// MoE expert placement: which ranks host which experts (and how many replicas
// of the hot ones), so that the most loaded rank carries as few tokens as
// possible. A pure, deterministic function of the per-expert token counts and
// the options.
//
// Load. Expert e with t_e tokens and r_e replicas puts t_e / r_e on each rank
// hosting one of them (the router splits its tokens evenly). A rank's load
// is the sum over what it hosts; imbalance = max rank load / mean rank load
// (1 when there is no load at all).
//
// Constraints. At most `capacity` experts (replicas included) per rank, and
// two replicas of one expert never share a rank.
//
// Algorithm.
//   1. Greedy LPT: items (expert replicas) by load descending, ties by expert
//      id then replica; each goes to the rank with room, not already hosting
//      that expert, with the least load, ties by fewer experts, then lower
//      rank id.
//   2. Replication, while the budget allows: try one more replica of the
//      experts hosted on a most loaded rank, hottest per-replica load first
//      (ties by expert id); re-run step 1, and keep the first that lowers
//      (max load, number of ranks at the max) lexicographically. Stop when
//      none does.
//   3. Exact search: a depth-first branch and bound over the items of the
//      final replica counts, best rank first (its first leaf is step 1's
//      answer), pruned by the bound max(current max, total / ranks), at most
//      `search_nodes` nodes. When it finishes under the limit the max load is
//      optimal for those replica counts; else the best found (never worse
//      than LPT). The node count, not time, bounds it, so it is
//      deterministic.
#pragma once

#include "core/error.hpp"

#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <vector>

namespace cmesh::recovery {

using expert_id = uint32_t;
using rank_id = uint32_t;

struct placement_options {
  /// Ranks the experts are spread over (>= 1).
  uint32_t ranks = 1;
  /// Experts (replicas included) a rank may host; 0 = no limit.
  uint32_t capacity = 0;
  /// Extra replicas that may be added in total.
  uint32_t replication_budget = 0;
  /// Nodes of exact search after the greedy pass; 0 = greedy only.
  uint64_t search_nodes = 100000;
};

struct placement {
  /// Per expert: the ranks hosting one of its replicas, ascending.
  std::vector<std::vector<rank_id>> expert_ranks;
  /// Per rank: the experts it hosts, ascending.
  std::vector<std::vector<expert_id>> rank_experts;
  /// Per rank: the tokens routed to it.
  std::vector<double> rank_load;
  double max_load = 0;
  double mean_load = 0;
  /// max_load / mean_load, 1 when there is no load.
  double imbalance = 1;
  /// True when the exact search finished: max_load is optimal for these
  /// replica counts.
  bool optimal = false;
};

/// max / mean of `rank_load`, 1 when it is empty or all zero.
double imbalance(std::span<const double> rank_load);

/// Places `tokens[e]` (tokens routed to expert e) on `o.ranks` ranks.
/// errc::invalid_argument when there are no experts or ranks, or the experts
/// do not fit (experts > ranks * capacity).
expected<placement> place_experts(std::span<const uint64_t> tokens, const placement_options& o);

/// The rank loads of an explicit placement (expert_ranks per expert, as in
/// placement::expert_ranks) with `ranks` ranks. errc::invalid_argument when
/// the sizes differ, an expert has no rank, or a rank is out of range.
expected<std::vector<double>> rank_loads(std::span<const uint64_t> tokens,
                                         const std::vector<std::vector<rank_id>>& expert_ranks,
                                         uint32_t ranks);

enum class move_kind : uint8_t {
  move, // `to` takes the expert from `from`, which drops it
  copy, // `to` gets a new replica copied from `from`, which keeps it
  drop, // `from` drops a replica that is no longer needed (to = no_rank)
};

std::string_view to_string(move_kind k);

constexpr rank_id no_rank = std::numeric_limits<rank_id>::max();

struct expert_move {
  expert_id expert = 0;
  rank_id from = 0;
  rank_id to = 0;
  move_kind kind = move_kind::move;

  bool operator==(const expert_move&) const = default;
};

/// What changes from `before` to `after` (each: per expert, its ranks).
/// Per expert, ranks that lose it are paired in ascending order with ranks
/// that gain it (moves); gains left over copy, in turn, from the ranks that
/// keep it (from its old ranks when none keeps it) (copies); losses left
/// over are drops. Sorted by expert, then moves,
/// copies, drops, each ascending. errc::invalid_argument when the expert
/// counts differ or an expert has no rank, or a rank twice, in either.
expected<std::vector<expert_move>> moves_between(const std::vector<std::vector<rank_id>>& before,
                                                 const std::vector<std::vector<rank_id>>& after);

inline expected<std::vector<expert_move>> moves_between(const placement& before,
                                                        const placement& after) {
  return moves_between(before.expert_ranks, after.expert_ranks);
}

} // namespace cmesh::recovery
