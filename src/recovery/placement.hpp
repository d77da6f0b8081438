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
#include <string>
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

// ---------------------------------------------------------------------------
// The coordinator's placement: plan_placement.
//
// Budgets are in expert slots: `slots[r]` is how many experts (replicas
// included) rank r may hold, and slots.size() is the number of ranks. Every
// expert of a layer has the same size, so a slot is one expert's weights and
// optimizer state; a rank given 0 slots (a dead or drained rank) holds
// nothing. Loads and imbalance of a plan count the ranks with slots only: a
// rank that may hold nothing is not expected to carry tokens.
//
// Candidates, each a placement with every expert hosted at least once, never
// twice on one rank, and no rank over its slots:
//   fresh    EPLB-style replica counts (one more replica of the expert with
//            the most tokens per replica while the replication budget and
//            the slots allow and that expert has tokens), packed by greedy
//            LPT, then the branch and bound of place_experts (search_nodes),
//            then local improvement: moves and swaps of one replica off the
//            most loaded rank while they lower (max load, ranks at the max).
//   fresh, fewer replicas
//            the same with place_experts' replica counts (a replica is added
//            only while it lowers greedy LPT's max), when they differ:
//            filling every slot suits a flat load, stopping early a steep one.
//   kept     the current placement, repaired (see below), then local
//            improvement.
//   repacked the kept candidate's replica counts packed as `fresh`.
// The fresh and repacked ones are relabelled (ranks of equal slots swap
// names) to share the most experts with the current placement. Search and
// local improvement only lower the max, so every candidate is at most greedy
// LPT on its own replica counts. A first placement takes the fresh candidate
// of the lower max load (ties: fewer replicas).
//
// Repair (forced, whatever the cost). A rank holding more than its slots
// drops the excess: replicas of experts hosted elsewhere too go first (a
// drop, nothing to copy), then the lightest; an expert left with no rank goes
// to the least loaded rank with room. When the current placement holds more
// replicas than the budget or the slots allow, the replicas whose loss raises
// their expert's per-replica load least are dropped.
//
// The decision (all in seconds). The per-step load of a rank is its tokens
// divided by cost.window_steps; the step waits for the most loaded rank. A
// candidate saves (max_before - max_after) / window_steps * seconds_per_token
// per step, over cost.horizon_steps steps (0 unless the max drops by more
// than a rounding error); its moves (move and copy; a drop is free) cost
// expert_bytes / bytes_per_second each, one after the other. max_before is
// the repaired placement's, and a candidate is charged only the moves beyond
// the repair's: the forced moves are paid anyway. The candidate with the
// largest saving minus cost (ties: fewer moves, then the lower max, then the
// order above) is taken when that is > 0 and its max is not higher;
// otherwise the (repaired) current placement stays: "unchanged" when no
// candidate lowers the max, "does not pay" when one does. Only then may the
// result be worse than greedy LPT on its replica counts.

/// Cost model of a change of placement.
struct placement_cost {
  /// Steps the token counts were summed over (>= 1).
  uint64_t window_steps = 1;
  /// Steps the new placement is expected to serve before the next one.
  uint64_t horizon_steps = 1000;
  /// Seconds a rank's step grows per token routed to its experts.
  double seconds_per_token = 1e-6;
  /// Bytes one expert replica carries when it moves (weights and optimizer
  /// state); 0 when every rank already holds every expert's weights.
  uint64_t expert_bytes = 0;
  /// Bytes per second of one move (> 0 when expert_bytes > 0).
  double bytes_per_second = 10e9;
};

struct plan_options {
  /// Extra replicas allowed in total, beyond one per expert.
  uint32_t replication_budget = 0;
  /// Nodes of the branch and bound per packing (fresh, repacked); 0 = none. On the
  /// benchmark's trace (64 experts, 8 ranks) local improvement does most of
  /// the work: 2000 nodes lower the imbalance by about 1e-4 for 5x the time,
  /// 20000 nodes add nothing for 5x more.
  uint64_t search_nodes = 2000;
  placement_cost cost;
};

enum class plan_reason : uint8_t {
  first_placement,        // no current placement
  unchanged,              // nothing to gain: no candidate lowers the max load
  forced,                 // a rank lost slots, or the budget shrank: experts had to move
  rebalance_pays,         // the saving over the horizon exceeds the moves' cost
  rebalance_does_not_pay, // a candidate lowers the max load, but not by enough
};

std::string_view to_string(plan_reason r);

struct placement_plan {
  /// The placement to use (mean_load and imbalance over the ranks with slots).
  placement placed;
  /// From the current placement to `placed` (empty for a first placement).
  std::vector<expert_move> moves;
  plan_reason reason = plan_reason::first_placement;
  /// One line: the reason with its numbers.
  std::string detail;
  /// Max rank load of the current placement after the forced moves (0 for a
  /// first placement), and the saving and cost the decision weighed (s).
  double max_load_before = 0;
  double saving_s = 0;
  double cost_s = 0;
};

/// Plans the placement of `tokens[e]` (tokens routed to expert e over the
/// window) on slots.size() ranks, from `current` (per expert, its ranks; empty
/// for a first placement). Pure and deterministic. errc::invalid_argument when
/// there are no experts or no ranks, the slots cannot hold every expert once,
/// `current` has another expert count or names a rank out of range, an
/// expert with no rank or on a rank twice, or the cost model is unusable.
expected<placement_plan> plan_placement(std::span<const uint64_t> tokens,
                                        std::span<const uint32_t> slots,
                                        const std::vector<std::vector<rank_id>>& current,
                                        const plan_options& o);

/// The greedy LPT baseline for given replica counts: replicas by load
/// (tokens / replicas) descending, ties by expert, each to the rank with
/// room, not hosting that expert, with the least load (then fewer experts,
/// then lower id). errc::invalid_argument on bad sizes or counts (0, more
/// than the ranks with slots, more than the slots) or when the greedy pass
/// strands a replica.
expected<placement> place_lpt(std::span<const uint64_t> tokens,
                              std::span<const uint32_t> replicas,
                              std::span<const uint32_t> slots);

/// EPLB-style baseline (DeepSeek's expert-parallelism load balancer, its
/// global policy, which the hierarchical one is on a single node): fill all
/// ranks * slots_per_rank slots, one replica at a time to the expert with the
/// highest tokens per replica (ties: lower id; at most `ranks` replicas each),
/// then pack the replicas, heaviest first, each onto the least loaded rank
/// with a free slot (ties: lower id). One change: a rank already hosting
/// that expert is skipped, so two replicas never share a rank.
/// errc::invalid_argument when there are no experts, ranks or slots, or the
/// experts do not fit.
expected<placement> place_eplb(std::span<const uint64_t> tokens, uint32_t ranks,
                               uint32_t slots_per_rank);

} // namespace cmesh::recovery
