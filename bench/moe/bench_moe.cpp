// MoE benchmark: the expert-placement policies of src/recovery on a seeded
// router trace, the memory resident experts save, and the bytes they move.
//
// The trace: `batches` batches of `tokens` tokens, each routed to `top_k`
// distinct experts drawn from a Zipf(s) popularity (the expert of popularity
// rank i has weight 1 / i^s) over a seeded random permutation of the experts.
// Every policy that replicates gets the same slots: ceil(experts / ranks) +
// `spare` per rank, so ranks * spare extra replicas.
//
// Tables (each its own function; every figure beside its baseline from the
// same run, since the machines are shared and noisy):
//   1. Imbalance (max over mean rank load): each batch placed from its own
//      counts (mean and worst over the batches), and one placement from the
//      trace's totals (on the totals, and its worst batch); the time each
//      policy took over all of it, and its ratio to greedy LPT's. Goal: ours
//      (plan_placement) at most 1.05.
//   2. Memory per rank for experts: `cmesh launch` jobs (the binary beside
//      this one) at 1x1, 1x2 and 1x4 with train.experts = "resident" and
//      "replicated", 16 experts of 256 per layer, 10 steps; each rank's
//      expert_mib and peak RSS from its "done" and "stats" lines. Goal: 1x4
//      resident at most 30% of 1x1.
//   3. Bytes each rank receives per micro-batch for the experts, 64 experts
//      over 4 ranks, in one process (4 models in 4 threads): resident
//      experts (tokens travel: the expert exchange's all-to-alls, counted)
//      against full sharding (expert weights travel: every expert unit's
//      fetch and reduce, counted at a ring's (S-1)/S per rank), at two
//      expert sizes.
//
//   cmesh_bench_moe [--tables 1,2,3] [--seed N] [--experts N] [--ranks N]
//                   [--zipf S] [--batches N] [--tokens N] [--top-k K]
//                   [--spare N]
// --seed also seeds table 3's micro-batches; the other options are table 1's.
#include "common/launch.hpp"
#include "model/data.hpp"
#include "model/moe_lm.hpp"
#include "model/thread_hub.hpp"
#include "recovery/placement.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <unistd.h>
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
  std::array<bool, 4> tables{false, true, true, true}; // [t]: print table t

  uint32_t slots_per_rank() const { return (experts + ranks - 1) / ranks + spare; }
  uint32_t replica_budget() const { return slots_per_rank() * ranks - experts; }
};

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "cmesh_bench_moe: %s\n", msg.c_str());
  std::exit(2);
}

/// "1,3" -> tables 1 and 3.
std::array<bool, 4> parse_tables(const std::string& list) {
  std::array<bool, 4> t{};
  size_t at = 0;
  while (at <= list.size()) {
    const size_t end = std::min(list.find(',', at), list.size());
    const std::string item = list.substr(at, end - at);
    if (item != "1" && item != "2" && item != "3")
      die("--tables takes a comma-separated list of 1, 2 and 3, not '" + list + "'");
    t[static_cast<size_t>(item[0] - '0')] = true;
    at = end + 1;
  }
  return t;
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
    else if (a == "--tables")
      o.tables = parse_tables(value(i));
    else if (a == "--help" || a == "-h") {
      std::puts("cmesh_bench_moe [--tables 1,2,3] [--seed N] [--experts N] [--ranks N] [--zipf S]\n"
                "                [--batches N] [--tokens N] [--top-k K] [--spare N]");
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

/// Table 1 with its trace's description.
void placement_table(const options& o) {
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
}

// ---- Table 2: memory per rank for experts, resident against replicated ----

/// One `cmesh launch` job's figures, by rank.
struct job_figures {
  std::map<uint32_t, double> expert_mib, rss_mib; // "done" and "stats" lines
  int status = -1;
  std::string tail; // the output's end, when the job failed
};

/// Runs `cmesh launch -n ranks` (one replica group) on 16 experts of 256
/// with train.experts = `mode` for 10 steps, in `dir`.
job_figures memory_job(const std::string& dir, uint32_t ranks, const std::string& mode) {
  const std::string cfg = fmt::format("{}/{}x{}.toml", dir, mode, ranks);
  {
    std::ofstream f(cfg);
    f << "[model]\nexperts = 16\nexpert_ffn = 256\n[train]\nexperts = \"" << mode << "\"\n";
  }
  auto run = bench::run_launch(
      fmt::format("{}/{}x{}", dir, mode, ranks),
      fmt::format("-n {} --replicas 1 --config {} --steps 10 --log-every 10", ranks, cfg), 180);
  std::remove(cfg.c_str());
  job_figures out;
  out.status = run.status;
  // The fields of the lines in any order: only the keys are relied on.
  const std::regex done(R"(cmesh: rank ([0-9]+) done \([^)\n]*expert_mib=([0-9.]+))");
  const std::regex stats(R"(cmesh: rank ([0-9]+) stats [^\n]*max_rss_mb=([0-9.]+))");
  auto collect = [&](const std::regex& re, std::map<uint32_t, double>& into) {
    for (auto it = std::sregex_iterator(run.output.begin(), run.output.end(), re);
         it != std::sregex_iterator(); ++it)
      into[static_cast<uint32_t>(std::stoul((*it)[1].str()))] = std::stod((*it)[2].str());
  };
  collect(done, out.expert_mib);
  collect(stats, out.rss_mib);
  if (run.status != 0 || out.expert_mib.size() != ranks || out.rss_mib.size() != ranks)
    out.tail = run.output.substr(run.output.size() - std::min<size_t>(run.output.size(), 2000));
  return out;
}

double mean_of(const std::map<uint32_t, double>& by_rank) {
  double sum = 0;
  for (const auto& [rank, v] : by_rank)
    sum += v;
  return by_rank.empty() ? NAN : sum / static_cast<double>(by_rank.size());
}

double largest_of(const std::map<uint32_t, double>& by_rank) {
  double m = NAN;
  for (const auto& [rank, v] : by_rank)
    m = std::isnan(m) ? v : std::max(m, v);
  return m;
}

/// A temporary directory of this process's own, removed with it.
struct temp_dir {
  std::string path;
  temp_dir() {
    std::string templ = "/tmp/cmesh_bench_moe_XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr)
      die("cannot make a temporary directory under /tmp");
    path = templ;
  }
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
};

/// Says which job failed, and how it ended.
void report_failure(const char* what, uint32_t ranks, const job_figures& j) {
  std::printf("!! %s 1x%u: exit status %d, %zu of %u ranks reported; its output ends:\n%s\n", what,
              ranks, j.status, j.expert_mib.size(), ranks, j.tail.c_str());
}

/// Table 2: per-rank memory for experts, resident against replicated.
/// False when a job failed or did not report from every rank.
bool memory_table() {
  std::printf("\n2. Memory per rank for experts (expert_mib: weights, gradient, master, AdamW "
              "moments, replay window),\n   train.experts resident vs replicated; `cmesh launch "
              "-n S --replicas 1`, 16 experts of 256 per layer, 10 steps\n");
  std::fflush(stdout); // the six jobs take a while
  const temp_dir dir;
  const uint32_t layouts[] = {1, 2, 4};
  std::map<uint32_t, job_figures> rep, res;
  for (uint32_t s : layouts) {
    rep[s] = memory_job(dir.path, s, "replicated");
    res[s] = memory_job(dir.path, s, "resident");
  }
  std::printf("%-6s %12s %12s %12s %12s %23s\n", "", "replicated", "resident", "resident /",
              "resident /", "peak RSS MiB, max rank");
  std::printf("%-6s %12s %12s %12s %12s %11s %11s\n", "layout", "MiB/rank", "MiB/rank", "repl. 1x1",
              "res. 1x1", "replicated", "resident");
  const double rep1 = mean_of(rep[1].expert_mib), res1 = mean_of(res[1].expert_mib);
  for (uint32_t s : layouts) {
    const double r = mean_of(res[s].expert_mib);
    std::printf("1x%-4u %12.3f %12.3f %12.3f %12.3f %11.1f %11.1f\n", s,
                mean_of(rep[s].expert_mib), r, r / rep1, r / res1, largest_of(rep[s].rss_mib),
                largest_of(res[s].rss_mib));
  }
  bool ok = true;
  for (uint32_t s : layouts) {
    if (!rep[s].tail.empty())
      report_failure("replicated", s, rep[s]), ok = false;
    if (!res[s].tail.empty())
      report_failure("resident", s, res[s]), ok = false;
  }
  std::printf("(MiB/rank: mean over the ranks of each rank's expert_mib; peak RSS: the largest "
              "rank's max_rss_mb)\n");
  // Against both baselines: resident 1x1 holds copies replicated 1x1 does
  // not (the master and the reduced gradient), so it is the larger one.
  const double res4 = mean_of(res[4].expert_mib), vs_rep = res4 / rep1, vs_res = res4 / res1;
  auto verdict = [](double x) { return x <= 0.30 ? "met" : "NOT met"; };
  std::printf("goal: 1x4 resident at most 30%% of 1x1: %.3f of replicated 1x1 (%s), %.3f of "
              "resident 1x1 (%s)\n",
              vs_rep, verdict(vs_rep), vs_res, verdict(vs_res));
  return ok;
}

// ---- Table 3: bytes received per micro-batch for the experts ----

/// An expert exchange over a thread_hub that counts the bytes this rank
/// receives from the other ranks (its own blocks stay in memory).
class counting_exchange final : public model::expert_exchange {
public:
  counting_exchange(model::thread_hub& hub, size_t ranks, size_t me) : hub_(hub), ranks_(ranks), me_(me) {}
  size_t ranks() const override { return ranks_; }
  size_t rank() const override { return me_; }
  bool exchange(const float* in, const std::vector<size_t>& send, float* out,
                const std::vector<size_t>& recv) override {
    rows_bytes += move(in, send, out, recv, sizeof(float));
    return true;
  }
  bool exchange_counts(const int64_t* in, int64_t* out, size_t per_rank) override {
    const std::vector<size_t> c(ranks_, per_rank);
    counts_bytes += move(in, c, out, c, sizeof(int64_t));
    return true;
  }
  uint64_t rows_bytes = 0, counts_bytes = 0; // received from other ranks

private:
  // One all-to-all; returns the bytes that came from other ranks.
  uint64_t move(const void* in, const std::vector<size_t>& send, void* out,
                const std::vector<size_t>& recv, size_t size) {
    std::vector<size_t> sb, rb;
    uint64_t from_others = 0;
    for (size_t j = 0; j < ranks_; ++j) {
      sb.push_back(send[j] * size);
      rb.push_back(recv[j] * size);
      if (j != me_)
        from_others += rb.back();
    }
    hub_.all_to_all(me_, static_cast<const char*>(in), sb, static_cast<char*>(out), rb);
    return from_others;
  }
  model::thread_hub& hub_;
  size_t ranks_, me_;
};

/// Full sharding's weight stream over whole weights held here: fetch
/// copies a unit out of them, reduce drops the gradient. It counts the
/// bytes of every expert unit (tensors with expert >= 0) fetched and
/// reduced: what a ring all_gather / reduce_scatter of the unit would move.
class counting_stream final : public model::parameter_stream {
public:
  explicit counting_stream(model::model& m)
      : ts_(m.tensors()), whole_(m.parameters().begin(), m.parameters().end()) {}
  const float* fetch(size_t first, size_t last) override {
    auto [a, b] = range(first, last);
    w_.assign(whole_.data() + a, whole_.data() + b);
    if (is_expert(first, last))
      fetched_bytes += (b - a) * sizeof(float);
    return w_.data();
  }
  void release(size_t, size_t) override {}
  float* gradient(size_t first, size_t last) override {
    auto [a, b] = range(first, last);
    g_.assign(b - a, 0.0f);
    return g_.data();
  }
  void reduce(size_t first, size_t last) override {
    auto [a, b] = range(first, last);
    if (is_expert(first, last))
      reduced_bytes += (b - a) * sizeof(float);
  }
  uint64_t fetched_bytes = 0, reduced_bytes = 0; // whole expert units

private:
  std::pair<size_t, size_t> range(size_t first, size_t last) const {
    return {ts_[first].offset, ts_[last - 1].offset + ts_[last - 1].size};
  }
  // A unit is an expert's when its tensors are (the model's units are
  // whole experts; a mixed one would make the count meaningless).
  bool is_expert(size_t first, size_t last) const {
    size_t experts = 0;
    for (size_t t = first; t < last; ++t)
      experts += ts_[t].expert >= 0 ? 1 : 0;
    if (experts != 0 && experts != last - first)
      die("a streamed unit mixes expert and dense tensors");
    return experts != 0;
  }
  const std::vector<model::tensor_info>& ts_;
  std::vector<float> whole_, w_, g_;
};

/// What one rank received for the experts in its micro-batch.
struct rank_bytes {
  uint64_t rows = 0, counts = 0;     // expert exchange, from other ranks
  uint64_t fetched = 0, reduced = 0; // stream: whole expert units
  double kept = 0;                   // token-expert assignments within capacity, of all
};

/// One micro-batch per rank, batches.size() models in threads of their
/// own, each with a counting exchange (`exchange`: the experts split over
/// the ranks in static blocks, as resident experts are), a counting stream
/// (`stream`), or both.
std::vector<rank_bytes> run_group(const model::moe_config& c,
                                  const std::vector<model::batch>& batches, bool exchange,
                                  bool stream) {
  const size_t ranks = batches.size();
  model::thread_hub hub(ranks);
  std::vector<std::unique_ptr<model::model>> models;
  std::vector<std::unique_ptr<counting_exchange>> xs;
  std::vector<std::unique_ptr<counting_stream>> ss;
  for (size_t r = 0; r < ranks; ++r) {
    models.push_back(model::make_moe_lm(c));
    xs.push_back(std::make_unique<counting_exchange>(hub, ranks, r));
    ss.push_back(std::make_unique<counting_stream>(*models[r]));
    if ((exchange && !models[r]->set_expert_exchange(xs[r].get()))
        || (stream && !models[r]->set_parameter_stream(ss[r].get())))
      die("the model refuses an expert exchange or a parameter stream");
  }
  std::vector<model::step_stats> stats(ranks);
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] { stats[r] = models[r]->forward_backward(batches[r]); });
  for (auto& t : threads)
    t.join();
  std::vector<rank_bytes> out(ranks);
  for (size_t r = 0; r < ranks; ++r) {
    const double routed = static_cast<double>(stats[r].tokens * c.top_k * c.layers);
    out[r] = {xs[r]->rows_bytes, xs[r]->counts_bytes, ss[r]->fetched_bytes, ss[r]->reduced_bytes,
              1.0 - static_cast<double>(stats[r].dropped) / routed};
  }
  return out;
}

/// Bytes of every expert's weights, all layers.
uint64_t expert_weight_bytes(const model::moe_config& c) {
  uint64_t n = 0;
  for (const auto& t : model::moe_lm_tensors(c))
    if (t.expert >= 0)
      n += t.size * sizeof(float);
  return n;
}

/// One row of table 3: the model at `expert_ffn`, resident against full
/// sharding on the same micro-batches.
void traffic_row(model::moe_config c, size_t expert_ffn, const std::vector<model::batch>& batches) {
  c.expert_ffn = expert_ffn;
  const double S = static_cast<double>(batches.size()), KiB = 1024.0;
  const auto resident = run_group(c, batches, true, false);
  const auto sharded = run_group(c, batches, false, true);
  const auto both = run_group(c, batches, true, true);
  double tokens = 0, tokens_max = 0, counts = 0, kept = 0;
  for (const auto& r : resident) {
    const double b = static_cast<double>(r.rows + r.counts);
    tokens += b / S;
    counts += static_cast<double>(r.counts) / S;
    kept += r.kept / S;
    tokens_max = std::max(tokens_max, b);
  }
  // A ring all_gather (fetch) or reduce_scatter (reduce) of a unit over S
  // ranks brings each rank (S-1)/S of it. Every rank fetches every expert:
  // the same figure on each, so rank 0's.
  auto ring = [&](const rank_bytes& r) {
    return static_cast<double>(r.fetched + r.reduced) * (S - 1) / S;
  };
  const double weights = ring(sharded[0]);
  const double units = static_cast<double>(expert_weight_bytes(c));
  std::printf("%10zu %9.2f  %9.1f %9.1f %7.1f %6.3f  %9.1f %7.2f %9.1f  %9.1f\n", expert_ffn,
              units / (KiB * KiB), tokens / KiB, tokens_max / KiB, counts / KiB, kept,
              weights / KiB, static_cast<double>(sharded[0].fetched) / units, ring(both[0]) / KiB,
              weights / tokens);
}

/// Table 3: bytes each rank receives per micro-batch for the experts.
void traffic_table(uint64_t seed) {
  model::moe_config c;
  c.d_model = 64;
  c.layers = 2;
  c.experts = 64;
  c.top_k = 2;
  model::train_config t;
  t.micro_batch = 4;
  t.seq_len = 64;
  t.seed = seed;
  const size_t ranks = 4;
  const auto corpus = model::corpus::synthetic();
  std::vector<model::batch> batches; // rank r: micro-batch r of step 0
  for (size_t r = 0; r < ranks; ++r)
    batches.push_back(model::make_micro_batch(*corpus, t, 0, r));
  std::printf("\n3. Bytes each rank receives per micro-batch for the experts: %zu experts "
              "(top-%zu) over %zu ranks,\n   d_model %zu, %zu layers, %zu sequences of %zu tokens "
              "per rank (synthetic corpus, seed %llu), fp32, one micro-batch per rank\n",
              c.experts, c.top_k, ranks, c.d_model, c.layers, t.micro_batch, t.seq_len,
              static_cast<unsigned long long>(seed));
  std::printf("%10s %9s  %-34s  %-27s  %9s\n", "", "experts'", "resident: tokens travel",
              "full sharding: weights", "full /");
  std::printf("%10s %9s  %9s %9s %7s %6s  %9s %7s %9s  %9s\n", "expert_ffn", "MiB", "KiB/rank",
              "max rank", "counts", "kept", "KiB/rank", "fetches", "+exchange", "resident");
  for (size_t ffn : {size_t{128}, size_t{512}})
    traffic_row(c, ffn, batches);
  std::printf(
      "(experts' MiB: every expert's weights, all layers. resident: bytes from other ranks in the\n"
      " expert exchange's all-to-alls (rows out, outputs back, and the same for the gradients),\n"
      " mean and largest over the ranks; counts: the per-expert row counts among them; kept: the\n"
      " token-expert assignments within capacity (only those travel). full sharding: each model\n"
      " computes all its experts itself (no exchange): every expert unit's fetches and reduce at\n"
      " (S-1)/S of its bytes, as a ring all_gather / reduce_scatter; fetches: per expert unit;\n"
      " +exchange: the same count with the experts split over the ranks as well)\n");
}

} // namespace

int main(int argc, char** argv) {
  const auto o = parse(argc, argv);
  if (o.tables[1])
    placement_table(o);
  bool ok = true;
  if (o.tables[2])
    ok = memory_table();
  if (o.tables[3])
    traffic_table(o.seed);
  return ok ? 0 : 1;
}
