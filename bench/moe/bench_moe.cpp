// MoE placement benchmark: the expert-placement policies of src/recovery on a
// seeded router trace.
//
// The trace: `batches` batches of `tokens` tokens, each routed to `top_k`
// distinct experts drawn from a Zipf(s) popularity (the expert of popularity
// rank i has weight 1 / i^s) over a seeded random permutation of the experts.
// Every policy that replicates gets the same slots: ceil(experts / ranks) +
// `spare` per rank, so ranks * spare extra replicas.
//
// Tables (each its own function, so more can follow: memory per rank, bytes
// moved per step, move time):
//   1. Imbalance (max over mean rank load): each batch placed from its own
//      counts (mean and worst over the batches), and one placement from the
//      trace's totals (on the totals, and its worst batch); the time each
//      policy took over all of it, and its ratio to greedy LPT's. Goal: ours
//      (plan_placement) at most 1.05.
//
//   cmesh_bench_moe [--seed N] [--experts N] [--ranks N] [--zipf S]
//                   [--batches N] [--tokens N] [--top-k K] [--spare N]
#include "recovery/placement.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace cmesh;
using namespace cmesh::recovery;

struct options {
  uint64_t seed = 1;
  uint32_t experts = 64;
  uint32_t ranks = 8;
  double zipf = 1.2;
  uint32_t batches = 64;
  uint32_t tokens = 16384;
  uint32_t top_k = 2;
  uint32_t spare = 2; // extra slots per rank

  uint32_t slots_per_rank() const { return (experts + ranks - 1) / ranks + spare; }
  uint32_t replica_budget() const { return slots_per_rank() * ranks - experts; }
};

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "cmesh_bench_moe: %s\n", msg.c_str());
  std::exit(2);
}

options parse(int argc, char** argv) {
  options o;
  auto value = [&](int& i) -> std::string {
    if (i + 1 >= argc)
      die(std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--seed")
      o.seed = std::strtoull(value(i).c_str(), nullptr, 10);
    else if (a == "--experts")
      o.experts = static_cast<uint32_t>(std::atoi(value(i).c_str()));
    else if (a == "--ranks")
      o.ranks = static_cast<uint32_t>(std::atoi(value(i).c_str()));
    else if (a == "--zipf")
      o.zipf = std::atof(value(i).c_str());
    else if (a == "--batches")
      o.batches = static_cast<uint32_t>(std::atoi(value(i).c_str()));
    else if (a == "--tokens")
      o.tokens = static_cast<uint32_t>(std::atoi(value(i).c_str()));
    else if (a == "--top-k")
      o.top_k = static_cast<uint32_t>(std::atoi(value(i).c_str()));
    else if (a == "--spare")
      o.spare = static_cast<uint32_t>(std::atoi(value(i).c_str()));
    else if (a == "--help" || a == "-h") {
      std::puts("cmesh_bench_moe [--seed N] [--experts N] [--ranks N] [--zipf S] [--batches N]\n"
                "                [--tokens N] [--top-k K] [--spare N]");
      std::exit(0);
    } else
      die("unknown option " + a);
  }
  if (o.experts == 0 || o.ranks == 0 || o.batches == 0 || o.tokens == 0)
    die("--experts, --ranks, --batches and --tokens must be at least 1");
  if (o.top_k == 0 || o.top_k > o.experts)
    die("--top-k must be between 1 and --experts");
  if (!(o.zipf >= 0) || !std::isfinite(o.zipf))
    die("--zipf must be finite and >= 0");
  return o;
}

/// Per batch, tokens routed to each expert; and their sum over the batches.
struct trace {
  std::vector<std::vector<uint64_t>> batches;
  std::vector<uint64_t> totals;
};

/// Sampling by inverse CDF on the generator's raw bits, so the trace is the
/// same for a seed on every standard library.
trace make_trace(const options& o) {
  std::mt19937_64 rng(o.seed);
  std::vector<uint32_t> perm(o.experts);
  std::iota(perm.begin(), perm.end(), 0);
  for (size_t i = perm.size(); i > 1; --i) // Fisher-Yates on raw bits
    std::swap(perm[i - 1], perm[rng() % i]);
  std::vector<double> cdf(o.experts);
  double sum = 0;
  for (uint32_t i = 0; i < o.experts; ++i)
    cdf[i] = (sum += 1.0 / std::pow(static_cast<double>(i + 1), o.zipf));
  auto draw = [&] {
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * sum;
    const auto at = std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin();
    return perm[std::min<size_t>(static_cast<size_t>(at), o.experts - 1)];
  };
  trace t;
  t.totals.assign(o.experts, 0);
  std::vector<uint32_t> picked;
  for (uint32_t b = 0; b < o.batches; ++b) {
    std::vector<uint64_t> counts(o.experts, 0);
    for (uint32_t n = 0; n < o.tokens; ++n) {
      picked.clear();
      while (picked.size() < o.top_k) { // top-k: k distinct experts
        const auto e = draw();
        if (std::find(picked.begin(), picked.end(), e) == picked.end())
          picked.push_back(e);
      }
      for (auto e : picked)
        ++counts[e];
    }
    for (uint32_t e = 0; e < o.experts; ++e)
      t.totals[e] += counts[e];
    t.batches.push_back(std::move(counts));
  }
  return t;
}

/// A placement policy: token counts -> placement.
struct policy {
  std::string name;
  std::function<expected<placement>(const std::vector<uint64_t>&)> place;
};

std::vector<policy> policies(const options& o) {
  placement_options lpt;
  lpt.ranks = o.ranks;
  lpt.capacity = o.slots_per_rank();
  lpt.search_nodes = 0;
  placement_options lpt_rep = lpt;
  lpt_rep.replication_budget = o.replica_budget();
  placement_options solver = lpt_rep;
  solver.search_nodes = 2000; // as the trainers run it per micro-batch
  plan_options plan;
  plan.replication_budget = o.replica_budget();
  const std::vector<uint32_t> slots(o.ranks, o.slots_per_rank());
  return {
      {"greedy LPT, no replicas", [=](const auto& t) { return place_experts(t, lpt); }},
      {"greedy LPT + replicas", [=](const auto& t) { return place_experts(t, lpt_rep); }},
      {"place_experts (LPT+rep+2000-node search)",
       [=](const auto& t) { return place_experts(t, solver); }},
      {"EPLB-style", [=](const auto& t) { return place_eplb(t, o.ranks, o.slots_per_rank()); }},
      {"ours (plan_placement)",
       [=](const auto& t) -> expected<placement> {
         auto p = plan_placement(t, slots, {}, plan);
         if (!p)
           return p.error();
         return std::move(p->placed);
       }},
  };
}

placement must(expected<placement> p, const std::string& who) {
  if (!p)
    die(who + ": " + describe(p.error()));
  return std::move(*p);
}

/// max over mean of the rank loads `p` gives `tokens`.
double imbalance_of(const placement& p, const std::vector<uint64_t>& tokens, uint32_t ranks) {
  auto loads = rank_loads(tokens, p.expert_ranks, ranks);
  if (!loads)
    die("rank_loads: " + describe(loads.error()));
  return imbalance(*loads);
}

struct imbalance_row {
  double batch_mean = 0, batch_worst = 0; // each batch placed from its own counts
  double totals = 0, totals_worst = 0;    // one placement from the totals
  size_t replicas = 0;                    // of the totals' placement
  double seconds = 0;
};

imbalance_row measure(const policy& p, const options& o, const trace& t) {
  imbalance_row row;
  const auto start = std::chrono::steady_clock::now();
  for (const auto& b : t.batches) {
    const double x = must(p.place(b), p.name).imbalance;
    row.batch_mean += x / static_cast<double>(t.batches.size());
    row.batch_worst = std::max(row.batch_worst, x);
  }
  const auto once = must(p.place(t.totals), p.name);
  row.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  row.totals = once.imbalance;
  for (const auto& b : t.batches)
    row.totals_worst = std::max(row.totals_worst, imbalance_of(once, b, o.ranks));
  for (const auto& rs : once.expert_ranks)
    row.replicas += rs.size();
  return row;
}

/// Table 1: imbalance and time per policy.
void imbalance_table(const options& o, const trace& t) {
  std::printf("\n1. Imbalance (max / mean rank load), %u batches placed one by one, and once from "
              "the totals\n",
              o.batches);
  std::printf("%-42s %19s %19s %8s %10s %7s\n", "", "each batch placed", "once, from totals",
              "replicas", "time", "time");
  std::printf("%-42s %9s %9s %9s %9s %8s %10s %7s\n", "policy", "mean", "worst", "totals",
              "wst batch", "(totals)", "ms", "/ LPT");
  double lpt_s = 0, ours_worst = 0, ours_totals = 0;
  for (const auto& p : policies(o)) {
    const auto row = measure(p, o, t);
    if (lpt_s == 0)
      lpt_s = row.seconds;
    if (p.name.rfind("ours", 0) == 0) {
      ours_worst = row.batch_worst;
      ours_totals = row.totals;
    }
    std::printf("%-42s %9.4f %9.4f %9.4f %9.4f %8zu %10.2f %7.1f\n", p.name.c_str(), row.batch_mean,
                row.batch_worst, row.totals, row.totals_worst, row.replicas, row.seconds * 1e3,
                lpt_s > 0 ? row.seconds / lpt_s : 0.0);
  }
  std::printf("(time: the %u + 1 placements of a policy; wst batch: the totals' placement on its "
              "worst batch)\n",
              o.batches);
  const bool met = ours_worst <= 1.05 && ours_totals <= 1.05;
  std::printf("goal: ours at most 1.05 (worst batch %.4f, totals %.4f): %s\n", ours_worst,
              ours_totals, met ? "met" : "NOT met");
}

} // namespace

int main(int argc, char** argv) {
  const auto o = parse(argc, argv);
  if (o.experts > static_cast<uint64_t>(o.ranks) * o.slots_per_rank())
    die("the experts do not fit");
  std::printf("cmesh_bench_moe: seed %llu, %u experts over %u ranks, Zipf(s=%.2f) over a seeded "
              "permutation, top-%u routing, %u batches of %u tokens\n",
              static_cast<unsigned long long>(o.seed), o.experts, o.ranks, o.zipf, o.top_k,
              o.batches, o.tokens);
  std::printf(
      "slots: %u per rank (%u experts per rank + %u spare) = %u slots, %u extra replicas for "
      "every policy that replicates\n",
      o.slots_per_rank(), o.slots_per_rank() - o.spare, o.spare, o.slots_per_rank() * o.ranks,
      o.replica_budget());
  const auto t = make_trace(o);
  imbalance_table(o, t);
  return 0;
}
