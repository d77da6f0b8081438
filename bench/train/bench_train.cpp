// Training benchmark: the built-in MoE model under `cmesh launch`.
//
//  1. Throughput at 1x1, 2x1 and 2x2 (replica groups x ranks per group), the
//     same OpenBLAS threads per process: tokens/s, step time and the share
//     of it spent waiting on collectives, averaged over the steps after a
//     warm-up; the per-process throughput at 2x1 against 1x1 (goal: at
//     least 70%).
//  2. The matrix products inside the step (the workers' gemm counters, per
//     shape) beside OpenBLAS's own sgemm on the same shapes, timed by this
//     process in the same run.
//  3. Peak resident memory per rank at 1x1 and 1x2 on a wider model, beside
//     the parameter and optimizer bytes computed from the parameter count
//     (goal: at 1x2 each rank holds at most 60% of 1x1's).
// Every figure comes from the workers' output: their progress lines
// (`step ... ms  comm ... ms`) and the statistics each rank prints after
// its "done" report (`cmesh: rank R stats ...`, and with CMESH_GEMM_SHAPES
// set one `cmesh: rank R gemm shape=...` line per product shape).
//
//  4. bf16 activations against fp32 ones (--activations-only alone).
//  5. Replica verification: the step time with --verify-every off, at its
//     default and at every step (--verify-only alone).
//  6. Durable checkpointing (--durable-only alone; not in the default run,
//     it takes minutes): at 2x1 and 1x1, on the default model and on one of 26.5 M
//     parameters (a temporary config), the step time with the checkpoint
//     shadow off, on (--shadow), writing to a local tier (--checkpoint-dir)
//     and to a shared one too (--checkpoint-shared), with the checkpoints
//     written and skipped; then a checkpoint's bytes on disk and the start
//     of a run resumed from it against a fresh one and a read(2) of the bytes.
//
//   cmesh_bench_train [--steps N] [--warmup N] [--quick] [--activations-only] [--verify-only]
//                     [--durable-only]
#include "actors/trainer.hpp"
#include "common/launch.hpp"
#include "core/env.hpp"
#include "kernels/gemm.hpp"
#include "model/config.hpp"
#include "model/moe_lm.hpp"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

namespace {

// Committed updates the trainer keeps for replay, each one shard (as
// `cmesh launch` runs it: the trainer's default).
const size_t replay_window = cmesh::actors::trainer_options{}.replay_window;

// A `cmesh launch` that has not ended after this long is killed (SIGTERM,
// then SIGKILL 10 s later) and counted as failed.
constexpr int launch_timeout_s = 240;

struct step_line {
  int step = 0;
  double tokens_per_s = 0, step_ms = 0, comm_ms = 0;
};

struct rank_stats {
  double gemm_gflops = 0, gemm_ms = 0, step_ms_total = 0, max_rss_mb = 0, verify_ms = 0;
  uint64_t gemm_calls = 0;
};

struct gemm_shape {
  bool trans_a = false, trans_b = false;
  size_t m = 0, n = 0, k = 0;
  uint64_t calls = 0;
  double ms = 0;
  double flops() const {
    return 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k)
           * static_cast<double>(calls);
  }
};

struct run_out {
  int status = -1;
  std::string output;
  std::vector<step_line> steps;          // the first member's progress lines
  std::map<int, rank_stats> stats;       // by rank
  std::map<int, std::vector<gemm_shape>> shapes; // by rank
};

run_out launch(const std::string& args) {
  static int serial = 0;
  auto base = fmt::format("/tmp/cmesh_bench_train_{}_{}", getpid(), serial++);
  auto l = cmesh::bench::run_launch(base, args, launch_timeout_s, "CMESH_GEMM_SHAPES=1");
  run_out r;
  r.status = l.status;
  r.output = std::move(l.output);
  if (r.status != 0) {
    // The end of its output says why (it goes to stderr, beside the tables).
    std::vector<std::string> tail;
    std::istringstream all(r.output);
    for (std::string l; std::getline(all, l);)
      if (l.find(" gemm shape=") == std::string::npos)
        tail.push_back(l);
    fmt::print(stderr, "cmesh launch {} ended with status {}; its last lines:\n", args, r.status);
    for (size_t i = tail.size() > 12 ? tail.size() - 12 : 0; i < tail.size(); ++i)
      fmt::print(stderr, "  {}\n", tail[i]);
  }

  std::regex step_re("^step +([0-9]+) +loss +[-0-9.a-z]+ +aux +[-0-9.a-z]+ +tokens/s +([0-9.]+) +"
                     "step +([0-9.]+) ms +comm +([0-9.]+) ms");
  std::regex stats_re("cmesh: rank ([0-9]+) stats gemm_gflops=([0-9.]+) gemm_ms=([0-9.]+) "
                      "gemm_calls=([0-9]+) step_ms_total=([0-9.]+) max_rss_mb=([0-9.]+) "
                      "verify_ms=([0-9.]+)");
  std::regex shape_re("cmesh: rank ([0-9]+) gemm shape=([NT])([NT]) m=([0-9]+) n=([0-9]+) "
                      "k=([0-9]+) calls=([0-9]+) ms=([0-9.]+)");
  std::istringstream lines(r.output);
  std::string line;
  while (std::getline(lines, line)) {
    std::smatch m;
    if (std::regex_search(line, m, step_re)) {
      r.steps.push_back({std::stoi(m[1].str()), std::stod(m[2].str()), std::stod(m[3].str()),
                         std::stod(m[4].str())});
    } else if (std::regex_search(line, m, stats_re)) {
      auto& s = r.stats[std::stoi(m[1].str())];
      s.gemm_gflops = std::stod(m[2].str());
      s.gemm_ms = std::stod(m[3].str());
      s.gemm_calls = std::stoull(m[4].str());
      s.step_ms_total = std::stod(m[5].str());
      s.max_rss_mb = std::stod(m[6].str());
      s.verify_ms = std::stod(m[7].str());
    } else if (std::regex_search(line, m, shape_re)) {
      gemm_shape g;
      g.trans_a = m[2].str() == "T";
      g.trans_b = m[3].str() == "T";
      g.m = std::stoull(m[4].str());
      g.n = std::stoull(m[5].str());
      g.k = std::stoull(m[6].str());
      g.calls = std::stoull(m[7].str());
      g.ms = std::stod(m[8].str());
      r.shapes[std::stoi(m[1].str())].push_back(g);
    }
  }
  return r;
}

/// Averages over the progress lines after the warm-up.
struct throughput {
  size_t steps = 0;
  double tokens_per_s = 0; // the job's: tokens of the steps / their time
  double step_ms = 0, comm_ms = 0;
};

throughput summarise(const std::vector<step_line>& lines, int warmup) {
  throughput t;
  double tokens = 0, step_ms = 0, comm_ms = 0;
  for (auto& l : lines) {
    if (l.step <= warmup)
      continue;
    ++t.steps;
    tokens += l.tokens_per_s * l.step_ms / 1e3;
    step_ms += l.step_ms;
    comm_ms += l.comm_ms;
  }
  if (t.steps == 0)
    return t;
  t.tokens_per_s = tokens / (step_ms / 1e3);
  t.step_ms = step_ms / static_cast<double>(t.steps);
  t.comm_ms = comm_ms / static_cast<double>(t.steps);
  return t;
}

/// OpenBLAS's own sgemm rate on one shape (row-major, compact operands, the
/// trainer's thread count): the best of three batches of at least `min_s`.
double raw_sgemm_gflops(const gemm_shape& g, double min_s) {
  std::vector<float> a(g.m * g.k), b(g.k * g.n), c(g.m * g.n, 0.0f);
  uint32_t x = 12345;
  auto next = [&x] {
    x = x * 1664525u + 1013904223u;
    return static_cast<float>(x >> 8) / static_cast<float>(1u << 24) - 0.5f;
  };
  for (auto& v : a)
    v = next();
  for (auto& v : b)
    v = next();
  const int m = static_cast<int>(g.m), n = static_cast<int>(g.n), k = static_cast<int>(g.k);
  const int lda = g.trans_a ? m : k, ldb = g.trans_b ? k : n;
  auto product = [&] {
    cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
                g.trans_b ? CblasTrans : CblasNoTrans, m, n, k, 1.0f, a.data(), lda, b.data(),
                ldb, 0.0f, c.data(), n);
  };
  product();
  product();
  const double flops = 2.0 * static_cast<double>(g.m) * static_cast<double>(g.n)
                       * static_cast<double>(g.k);
  double best = 0;
  for (int batch = 0; batch < 3; ++batch) {
    const auto t0 = cmesh::mono_ns();
    double secs = 0;
    uint64_t count = 0;
    do {
      product();
      ++count;
      secs = static_cast<double>(cmesh::mono_ns() - t0) / 1e9;
    } while (secs < min_s);
    best = std::max(best, flops * static_cast<double>(count) / secs / 1e9);
  }
  return best;
}

const char* verdict(bool met) { return met ? "met" : "MISSED"; }

double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

// 4. bf16 activations against fp32 ones, in this process: what the
// forward pass keeps for the backward pass, and the time of a
// forward_backward, on a model deep and wide enough for activations to
// matter.
void activations_table(bool quick, int blas_threads) {
  cmesh::model::moe_config ac;
  ac.d_model = 256;
  ac.ffn = 1024;
  ac.expert_ffn = 512;
  ac.experts = 8;
  ac.context = 8;
  ac.layers = quick ? 4 : 8;
  const size_t sequences = quick ? 4 : 8, seq_len = quick ? 128 : 256;
  cmesh::model::batch b;
  b.sequences = sequences;
  b.seq_len = seq_len;
  std::mt19937 rng(3);
  for (size_t i = 0; i < sequences * (seq_len + 1); ++i)
    b.tokens.push_back(static_cast<uint8_t>(rng() % 256));
  fmt::print("## activations: fp32 against bf16 (d_model 256, ffn 1024, 8 experts of 512, {} "
             "layers, context 8; {} tokens per forward_backward; one process, {} OpenBLAS "
             "thread(s))\n\n| activations | saved for the backward pass MiB | "
             "forward_backward ms (best of 3) | loss |\n|---|---|---|---|\n",
             ac.layers, sequences * seq_len, blas_threads);
  double saved[2] = {0, 0}, ms[2] = {0, 0};
  const char* kinds[2] = {"fp32", "bf16"};
  for (int k = 0; k < 2; ++k) {
    ac.activations = kinds[k];
    auto m = cmesh::model::make_moe_lm(ac);
    double best = 1e30, loss = 0;
    for (int rep = 0; rep < 3; ++rep) {
      m->zero_gradients();
      const auto t0 = std::chrono::steady_clock::now();
      loss = m->forward_backward(b).loss;
      best = std::min(best, std::chrono::duration<double, std::milli>(
                              std::chrono::steady_clock::now() - t0).count());
    }
    saved[k] = static_cast<double>(m->saved_activation_bytes());
    ms[k] = best;
    fmt::print("| {} | {:.1f} | {:.1f} | {:.4f} |\n", kinds[k], mib(saved[k]), best, loss);
  }
  fmt::print("| bf16 / fp32 | {:.2f} | {:.2f} | |\n\n", saved[1] / saved[0], ms[1] / ms[0]);
  fmt::print("bf16 packs the saved tensors at half the bytes and unpacks one layer at a\n"
             "time into a pool of float buffers; the fp32 logits and the pool are the rest.\n"
             "OpenBLAS here has no bf16 GEMM, so the rounding and packing cost time.\n\n");
}

// 5. Replica verification (train.verify_every): `cmesh launch` at 2x1 with
// the check off, at its default and at every step, interleaved round by
// round so that a change of load hits each alike. Each worker times its
// own hashing and comparing (`verify_ms` in its stats line): that share of
// its committed steps' time is the cost, measured in the run; the step
// times beside it swing between rounds of one setting by more than that on
// a shared machine. The hash alone on the same bytes, timed here, is the
// floor.
bool verify_table(int steps, int warmup, bool quick) {
  const auto defaults = cmesh::model::parse_config("");
  const size_t every_default = defaults ? defaults->train.verify_every : 0;
  const int rounds = quick ? 2 : 5;
  struct variant {
    std::string name;
    size_t every;
    std::vector<double> step_ms, share; // one of each per round: mean step, worst rank's share
  };
  std::vector<variant> vs = {{"off (0)", 0, {}, {}},
                             {fmt::format("default ({})", every_default), every_default, {}, {}},
                             {"every step (1)", 1, {}, {}}};
  bool ran = true;
  for (int round = 0; round < rounds; ++round)
    for (auto& v : vs) {
      auto r = launch(fmt::format("-n 2 --steps {} --log-every 1 --verify-every {}", steps,
                                  v.every));
      auto t = summarise(r.steps, warmup);
      if (r.status != 0 || t.steps == 0 || r.stats.size() != 2) {
        ran = false;
        continue;
      }
      v.step_ms.push_back(t.step_ms);
      double worst = 0;
      for (auto& [rank, st] : r.stats)
        worst = std::max(worst, st.verify_ms / st.step_ms_total);
      v.share.push_back(worst);
    }
  auto median = [](std::vector<double> x) {
    if (x.empty())
      return static_cast<double>(NAN);
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  // The hash alone on one rank's state at 2x1: the whole model's weights
  // and both moments (a group of one rank holds every shard).
  const size_t params = defaults ? cmesh::model::moe_lm_parameter_count(defaults->model) : 0;
  std::vector<float> p(params, 0.5f), m(params, 0.25f), v(params, 0.125f), sc(2, 1.0f);
  double best_us = 1e30;
  uint64_t sink = 0;
  for (int rep = 0; rep < 20; ++rep) {
    const auto t0 = cmesh::mono_ns();
    sink ^= cmesh::actors::hash_state(p, m, v, sc);
    best_us = std::min(best_us, static_cast<double>(cmesh::mono_ns() - t0) / 1e3);
  }
  const double off = median(vs[0].step_ms);
  fmt::print("## replica verification at 2x1 by --verify-every ({} steps; step ms: mean over "
             "steps {}..{}; medians of {} interleaved rounds)\n\n"
             "| --verify-every | step ms | against off | verification's share of the step "
             "(measured, worst rank) | hash alone per step (this process) |\n"
             "|---|---|---|---|---|\n",
             steps, warmup + 1, steps, rounds);
  for (auto& x : vs) {
    const double ms = median(x.step_ms);
    const double alone = x.every == 0 ? 0.0 : best_us / 1e3 / static_cast<double>(x.every);
    fmt::print("| {} | {:.2f} | {:+.1f}% | {:.3f}% | {:.4f} ms ({:.3f}%) |\n", x.name, ms,
               100.0 * (ms / off - 1.0), 100.0 * median(x.share), alone, 100.0 * alone / off);
  }
  const double at_default = median(vs[1].share);
  fmt::print("\nOne verification hashes {:.2f} MB (the fp32 weights and both AdamW moments of\n"
             "{} parameters; {:.0f} us alone here, {:.1f} GB/s, XXH3, best of 20, checksum\n"
             "{:x}) and adds one int64 per member to the commit vote; the measured share also\n"
             "holds the comparison. Goal: the default costs under 0.5% of the step: {}.\n"
             "'against off' is the step time's change, noise included.\n\n",
             12.0 * static_cast<double>(params) / 1e6, params, best_us,
             12.0 * static_cast<double>(params) / (best_us * 1e3), sink & 0xff,
             verdict(every_default > 0 && at_default < 0.005));
  return ran;
}

// 6. Durable checkpointing (--durable-only alone): the step time at 2x1 and 1x1
// with the checkpoint shadow and its writes on against off, on the default
// model and on one of about 26 M parameters, variants interleaved round by
// round; then each model's checkpoint on disk and what resuming from it
// costs at the start of a run.

double median_of(std::vector<double> x) {
  if (x.empty())
    return NAN;
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

std::string load_average() {
  std::string a = "?", b, c;
  if (std::ifstream f("/proc/loadavg"); f)
    f >> a >> b >> c;
  return fmt::format("{} {} {}", a, b, c);
}

struct shadow_counts {
  uint64_t written = 0, failures = 0, skipped = 0, last = 0;
};

/// The workers' `cmesh: rank R shadow ...` lines by rank (or, with `who`, the
/// checkpointer process's `checkpointer position P ...` lines by position).
std::map<int, shadow_counts> shadow_lines(const std::string& output,
                                          const std::string& who = "rank ([0-9]+) shadow") {
  std::regex re("cmesh: " + who
                + " .* written=([0-9]+) write_failures=([0-9]+) "
                  "write_skipped=([0-9]+) last_written=([0-9]+)");
  std::map<int, shadow_counts> out;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (!std::regex_search(line, m, re))
      continue;
    out[std::stoi(m[1].str())] = {std::stoull(m[2].str()), std::stoull(m[3].str()),
                                  std::stoull(m[4].str()), std::stoull(m[5].str())};
  }
  return out;
}

/// The `checkpoint: step N written to ROOT/...` lines: checkpoints one tier got.
size_t tier_writes(const std::string& output, const std::string& root) {
  const auto tail = " written to " + root + "/";
  size_t n = 0;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);)
    n += line.find("checkpoint: step ") != std::string::npos
         && line.find(tail) != std::string::npos;
  return n;
}

struct durable_model {
  std::string name, config; // config: a --config file, or empty (the defaults)
  size_t params = 0;
  int steps = 0, warmup = 0, every = 0, rounds = 0;
  int load_steps = 0, load_every = 0; // the run that writes the checkpoint to resume from
  int procs = 2; // 2: 2x1; 1: 1x1, where the shadow has a core of its own on 2 cores
  std::string args() const { return config.empty() ? "" : " --config " + config; }
  int due() const { return steps / every + (steps % every != 0); } // the last step's too
};

enum durable_level { d_off, d_shadow, d_local, d_shared, d_process };

struct durable_variant {
  const char* name;
  durable_level level;
  std::vector<double> step_ms, written, skipped; // one of each per run that passed
};

/// One `cmesh launch` of a variant, in fresh directories removed after it:
/// its mean step after the warm-up and its shadows' counters, checked.
bool durable_run(const durable_model& m, durable_variant& v) {
  static int serial = 0;
  const auto base = fmt::format("/tmp/cmesh_bench_durable_{}_{}", getpid(), serial++);
  const auto local = base + "/local", shared = base + "/shared";
  std::string flags;
  if (v.level == d_shadow)
    flags = " --shadow";
  if (v.level >= d_local)
    flags = fmt::format(" --checkpoint-dir {} --checkpoint-every {}", local, m.every);
  if (v.level >= d_shared)
    flags += " --checkpoint-shared " + shared;
  if (v.level == d_process)
    flags += " --checkpointer";
  auto r = launch(fmt::format("-n {} --steps {} --log-every 1{}{}", m.procs, m.steps, m.args(),
                              flags));
  const auto t = summarise(r.steps, m.warmup);
  // The checkpointer process holds one shadow per shard position (S = 1).
  const auto sh = v.level == d_process
                    ? shadow_lines(r.output, "checkpointer position ([0-9]+)")
                    : shadow_lines(r.output);
  const size_t want_lines = v.level == d_process ? 1 : static_cast<size_t>(m.procs);
  const size_t local_n = tier_writes(r.output, local), shared_n = tier_writes(r.output, shared);
  std::error_code ec;
  std::filesystem::remove_all(base, ec);
  uint64_t written = 0, skipped = 0, failures = 0, most = 0;
  for (auto& [rank, c] : sh) {
    written += c.written, skipped += c.skipped, failures += c.failures;
    most = std::max(most, c.written);
  }
  std::string why;
  if (r.status != 0)
    why = fmt::format("exit status {}", r.status);
  else if (t.steps == 0)
    why = "no progress lines after the warm-up";
  else if (v.level != d_off && sh.size() != want_lines)
    why = fmt::format("{} shadow line(s), not {}", sh.size(), want_lines);
  else if (failures > 0)
    why = fmt::format("{} write failure(s)", failures);
  else if (v.level >= d_local && (most == 0 || local_n == 0))
    why = "no checkpoint written";
  else if (v.level >= d_shared && shared_n == 0)
    why = "no checkpoint written to the shared tier";
  if (!why.empty()) {
    fmt::print(stderr, "durable: {}, {}: {}\n", m.name, v.name, why);
    return false;
  }
  v.step_ms.push_back(t.step_ms);
  v.written.push_back(static_cast<double>(written));
  v.skipped.push_back(static_cast<double>(skipped));
  return true;
}

struct durable_result {
  bool ran = true;
  double all_tiers = NAN; // shadow + both tiers against off, percent
  double process = NAN;   // ... with the shadow in the checkpointer process
};

/// The rounds of one model's four variants, and its rows of the table.
durable_result durable_rows(const durable_model& m) {
  std::vector<durable_variant> vs = {{"off", d_off, {}, {}, {}},
                                     {"shadow only (--shadow)", d_shadow, {}, {}, {}},
                                     {"shadow + local tier", d_local, {}, {}, {}},
                                     {"shadow + local + shared tiers", d_shared, {}, {}, {}},
                                     {"checkpointer process + both tiers (--checkpointer)",
                                      d_process, {}, {}, {}}};
  durable_result res;
  for (int round = 0; round < m.rounds; ++round)
    for (auto& v : vs)
      res.ran = durable_run(m, v) && res.ran;
  const double off = median_of(vs[0].step_ms);
  for (auto& v : vs) {
    const double ms = median_of(v.step_ms);
    std::string written = "-", skipped = "-";
    if (v.level >= d_local && !v.written.empty()) {
      written = fmt::format("{:.0f} / {}", median_of(v.written), m.due());
      skipped = fmt::format("{:.0f}", median_of(v.skipped));
    }
    fmt::print("| {} | {} | {:.1f} | {:+.1f}% | {} | {} | {}/{} |\n", m.name, v.name, ms,
               100.0 * (ms / off - 1.0), written, skipped, v.step_ms.size(), m.rounds);
  }
  res.all_tiers = 100.0 * (median_of(vs[3].step_ms) / off - 1.0);
  res.process = 100.0 * (median_of(vs[4].step_ms) / off - 1.0);
  return res;
}

struct first_step {
  int status = -1;
  double start_ms = NAN; // the first progress line's arrival less its step time
  int step = 0;          // the step that line reports
  bool resumed = false;  // a `cmesh: resuming from` line came
};

/// A `cmesh launch` read line by line as it prints: when its first step
/// began, counted from just before it was started.
first_step timed_launch(const std::string& args) {
  const auto cmd = fmt::format("timeout -k 10 {} {}/cmesh launch {} 2>&1", launch_timeout_s,
                               cmesh::bench::self_dir(), args);
  std::regex step_re("^step +([0-9]+) .* step +([0-9.]+) ms");
  first_step f;
  const auto t0 = cmesh::mono_ns();
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p)
    return f;
  char* buf = nullptr;
  size_t cap = 0;
  for (ssize_t n; (n = ::getline(&buf, &cap, p)) > 0;) {
    const double at = static_cast<double>(cmesh::mono_ns() - t0) / 1e6;
    const std::string line(buf, static_cast<size_t>(n));
    std::smatch m;
    if (line.rfind("cmesh: resuming from ", 0) == 0)
      f.resumed = true;
    else if (std::isnan(f.start_ms) && std::regex_search(line, m, step_re)) {
      f.step = std::stoi(m[1].str());
      f.start_ms = at - std::stod(m[2].str());
    }
  }
  std::free(buf);
  f.status = ::pclose(p);
  return f;
}

/// read(2) of every file of a directory, 8 MiB at a time into one buffer:
/// milliseconds; `bytes` the bytes read. NAN when a file does not open.
double read_dir_ms(const std::string& dir, uint64_t& bytes) {
  std::vector<char> buf(8u << 20);
  bytes = 0;
  const auto t0 = cmesh::mono_ns();
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (!e.is_regular_file())
      continue;
    const int fd = ::open(e.path().c_str(), O_RDONLY);
    if (fd < 0)
      return NAN;
    for (ssize_t n; (n = ::read(fd, buf.data(), buf.size())) > 0;)
      bytes += static_cast<uint64_t>(n);
    ::close(fd);
  }
  return static_cast<double>(cmesh::mono_ns() - t0) / 1e6;
}

/// The oldest step directory under `root` before step `steps` (a resumed
/// run then has steps to do); empty when there is none.
std::string oldest_step_dir(const std::string& root, int steps, int& step) {
  std::string best;
  step = steps;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(root, ec)) {
    const auto name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("step-", 0) != 0)
      continue;
    const int s = std::atoi(name.c_str() + 5);
    if (s > 0 && s < step)
      step = s, best = e.path().string();
  }
  return best;
}

/// One model's checkpoint: written by a run of `load_steps`, then, round
/// by round, read here with read(2), resumed from by a run of the same
/// steps and config, and a fresh run beside it. One row of the table.
bool load_row(const durable_model& m, int rounds) {
  const auto root = fmt::format("/tmp/cmesh_bench_durable_{}_load", getpid());
  const auto same = fmt::format("-n 2 --steps {} --log-every 1{}", m.load_steps, m.args());
  auto w = launch(fmt::format("{} --checkpoint-dir {} --checkpoint-every {} --checkpoint-keep 100",
                              same, root, m.load_every));
  int from = 0;
  const auto dir = w.status == 0 ? oldest_step_dir(root, m.load_steps, from) : std::string();
  std::vector<double> read_ms, fresh_ms, resumed_ms;
  uint64_t bytes = 0;
  bool ok = !dir.empty();
  for (int round = 0; ok && round < rounds; ++round) {
    read_ms.push_back(read_dir_ms(dir, bytes));
    const auto r = timed_launch(fmt::format("{} --resume {}", same, dir));
    const auto f = timed_launch(same);
    ok = r.status == 0 && r.resumed && r.step == from + 1 && f.status == 0 && !f.resumed
         && f.step == 1 && !std::isnan(read_ms.back());
    resumed_ms.push_back(r.start_ms);
    fresh_ms.push_back(f.start_ms);
  }
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
  if (!ok) {
    fmt::print(stderr, "durable: {}: checkpoint load not measured (writer status {}, step "
                       "directory '{}')\n", m.name, w.status, dir);
    fmt::print("| {} | not measured: a run failed | | | | | |\n", m.name);
    return false;
  }
  const double rd = median_of(read_ms), fr = median_of(fresh_ms), rs = median_of(resumed_ms);
  fmt::print("| {} | {} ({:.1f} MB, step {}) | {:.1f} ({:.2f} GB/s) | {:.0f} | {:.0f} | {:.0f} | "
             "{:.1f}x |\n", m.name, bytes, static_cast<double>(bytes) / 1e6, from, rd,
             static_cast<double>(bytes) / (rd * 1e6), fr, rs, rs - fr, (rs - fr) / rd);
  return true;
}

/// The config of the larger model: 26.5 M parameters (most of them in 8
/// experts of 4 layers) and a global batch of 4 x 32 tokens, so that a
/// step stays near 0.3 s on 2 cores.
const char* big_model_toml = "[model]\nd_model = 512\ncontext = 4\nlayers = 4\nffn = 1024\n"
                             "experts = 8\ntop_k = 2\nexpert_ffn = 640\n"
                             "[train]\nglobal_batch = 4\nmicro_batch = 2\nseq_len = 32\n";

void durable_text(const std::vector<durable_model>& models, const std::vector<double>& all_tiers,
                  const std::vector<double>& process, int blas_threads) {
  fmt::print("\nstep ms: rank 0's mean step (its progress lines) after the warm-up, median of\n"
             "the rounds; rank 0 is in the group that writes. 'written / due': checkpoints\n"
             "the shadows wrote in one run (their `written` counters, summed over the\n"
             "ranks; only group 0 writes, the last step's included, after the measured\n"
             "steps) against those due; 'skipped': due while the previous write still ran.\n"
             "Every run exited 0, had a shadow line per rank and no write failure, and each tier\n"
             "logged its writes (else it is left out of 'runs' and said on stderr).\n"
             "--checkpointer: the shadow in a `cmesh checkpointer` process (its line\n"
             "instead of the ranks'); rank 0 copies each update into a bulk buffer and\n"
             "posts it over UCX, and the copy, the optimizer and the writes run in the\n"
             "other process.\n\n");
  std::string measured, in_process;
  for (size_t i = 0; i < models.size(); ++i) {
    measured += fmt::format("{}{} {:+.1f}%", i ? ", " : "", models[i].name, all_tiers[i]);
    in_process += fmt::format("{}{} {:+.1f}%", i ? ", " : "", models[i].name, process[i]);
  }
  fmt::print("Goal: with the shadow and both tiers on, training under 1% slower than off\n"
             "where the shadow has a core of its own: the 1x1 rows, one trainer process\n"
             "of {} OpenBLAS thread(s) on {} cores, leave its shadow and disk actor the\n"
             "other core (the disk and memory bandwidth stay shared). At 2x1 the two\n"
             "trainer processes take both cores, and the writing group's shadow (which\n"
             "applies every committed update with the optimizer) and its disk actor take\n"
             "time from them: what checkpointing costs when nothing is spare.\n"
             "Shadow + both tiers against off: {}.\n"
             "The same in the checkpointer process: {}.\n"
             "For scale, Checkmate (NSDI '24) checkpoints every iteration at the\n"
             "throughput of no checkpointing (its shadow nodes take the gradients off the\n"
             "network), and CheckFreq (FAST '21) keeps its overhead at most 3.5%\n"
             "(pipelined snapshot and persist, the frequency tuned to that bound).\n\n",
             blas_threads, std::thread::hardware_concurrency(), measured, in_process);
}

void load_text() {
  fmt::print("\nbytes: the step directory's files (manifest and shard files: fp32 weights\n"
             "and both AdamW moments). read(2): this process reads them, 8 MiB at a time\n"
             "into one buffer, right after they were written: from the page cache, not the\n"
             "disk. Launch to first step: from just before `cmesh launch -n 2` is started\n"
             "to when rank 0's first step began (its first progress line's arrival, read\n"
             "through a pipe, less that step's time), fresh against resumed with --resume\n"
             "<step dir> (same config and steps, not --exact, like the writer); medians.\n"
             "Load overhead: resumed less fresh, the whole cost of resuming as a run sees\n"
             "it: each worker checks the checkpoint (reads and hashes every piece) before\n"
             "joining, then the trainer loads its shard (at 2x1: everything), both ranks at\n"
             "once on the same cores. 'x read' compares it with one read(2) of the bytes.\n"
             "On the small model it is within the launch's own variation.\n\n");
}

bool durable_table(int steps, int warmup, bool quick, int blas_threads) {
  const auto defaults = cmesh::model::parse_config("");
  const auto big = cmesh::model::parse_config(big_model_toml);
  if (!defaults || !big || cmesh::model::validate(*big, 2, 1)) {
    fmt::print(stderr, "cmesh_bench_train: the durable table's configs do not parse\n");
    return false;
  }
  const auto big_path = fmt::format("/tmp/cmesh_bench_train_durable_{}.toml", getpid());
  std::ofstream(big_path) << big_model_toml;
  const auto p0 = cmesh::model::moe_lm_parameter_count(defaults->model);
  const auto p1 = cmesh::model::moe_lm_parameter_count(big->model);
  // name, config, params, steps, warm-up, --checkpoint-every, rounds; the
  // writer of the checkpoint resumed from: its steps and --checkpoint-every.
  std::vector<durable_model> models = {
    {fmt::format("default ({:.2f} M params), 2x1", static_cast<double>(p0) / 1e6), "", p0, steps,
     warmup, 10, quick ? 2 : 5, 30, 10},
    {fmt::format("26M ({:.1f} M params), 2x1", static_cast<double>(p1) / 1e6), big_path, p1,
     quick ? 12 : 20, 6, 4, quick ? 1 : 3, 6, 2}};
  // 1x1: one trainer process on the 2 cores, so its shadow and disk actor
  // have a core of their own (the goal's setting).
  for (size_t i = 0, n = models.size(); i < n; ++i) {
    auto one = models[i];
    one.name.replace(one.name.size() - 3, 3, "1x1");
    one.procs = 1;
    models.push_back(one);
  }
  const auto load_start = load_average();
  fmt::print("# durable checkpointing at 2x1 and 1x1 (`cmesh launch -n 2`, `-n 1`), {} cores, {} OpenBLAS "
             "thread(s) per process, load average {} at the start\n\n",
             std::thread::hardware_concurrency(), blas_threads, load_start);
  for (auto& m : models)
    fmt::print("- {}: {} steps, warm-up {}, --checkpoint-every {}, {} interleaved "
               "rounds{}\n", m.name, m.steps, m.warmup, m.every, m.rounds,
               m.config.empty() ? " (the built-in defaults)"
                                : "; config: " + std::regex_replace(std::string(big_model_toml),
                                                                    std::regex("\n"), " "));
  fmt::print("\n## step time with the checkpoint shadow and its writes, against off\n\n"
             "| model (params) | variant | step ms | against off | checkpoints written / due "
             "(per run) | skipped (per run) | runs |\n|---|---|---|---|---|---|---|\n");
  bool ran = true;
  std::vector<double> all_tiers, process;
  for (auto& m : models) {
    auto r = durable_rows(m);
    ran = r.ran && ran;
    all_tiers.push_back(r.all_tiers);
    process.push_back(r.process);
  }
  durable_text(models, all_tiers, process, blas_threads);
  const int load_rounds = quick ? 1 : 3;
  fmt::print("## a checkpoint on disk, and the start of a run resumed from it ({} rounds)\n\n"
             "| model (params) | bytes of a step directory | read(2) ms (this process) | "
             "launch to first step, fresh ms | resumed ms | load overhead ms | x read |\n"
             "|---|---|---|---|---|---|---|\n", load_rounds);
  for (auto& m : models)
    if (m.procs == 2)
      ran = load_row(m, load_rounds) && ran;
  load_text();
  std::remove(big_path.c_str());
  fmt::print("Load average {} at the start, {} at the end.\n", load_start, load_average());
  return ran;
}

} // namespace

int main(int argc, char** argv) {
  int steps = 60, warmup = 10;
  bool quick = false, activations_only = false, verify_only = false, durable_only = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc)
      steps = std::atoi(argv[++i]);
    else if (a == "--warmup" && i + 1 < argc)
      warmup = std::atoi(argv[++i]);
    else if (a == "--quick")
      quick = true;
    else if (a == "--activations-only")
      activations_only = true;
    else if (a == "--verify-only")
      verify_only = true;
    else if (a == "--durable-only")
      durable_only = true;
    else {
      fmt::print(stderr, "usage: cmesh_bench_train [--steps N] [--warmup N] [--quick] "
                         "[--activations-only] [--verify-only] [--durable-only]\n");
      return 2;
    }
  }
  if (quick)
    steps = std::min(steps, 30), warmup = std::min(warmup, 5);
  if (steps <= warmup) {
    fmt::print(stderr, "cmesh_bench_train: --steps must exceed --warmup\n");
    return 2;
  }
  const int blas_threads = cmesh::kernels::cpu::blas_threads();
  if (activations_only) {
    activations_table(quick, blas_threads);
    return 0;
  }
  if (verify_only)
    return verify_table(steps, warmup, quick) ? 0 : 1;
  if (durable_only)
    return durable_table(steps, warmup, quick, blas_threads) ? 0 : 1;
  const auto defaults = cmesh::model::parse_config("");
  if (!defaults) {
    fmt::print(stderr, "cmesh_bench_train: default config: {}\n", cmesh::describe(defaults.error()));
    return 1;
  }
  const auto& tc = defaults->train;
  const auto& mc = defaults->model;
  std::string load = "?";
  if (std::ifstream f("/proc/loadavg"); f)
    f >> load; // other work on the cores skews every figure below
  fmt::print("# training benchmark: the built-in MoE model, {} steps (averages over steps {}..{}), "
             "{} OpenBLAS thread(s) per process, {} cores (load average {} at the start)\n\n",
             steps, warmup + 1, steps, blas_threads, std::thread::hardware_concurrency(), load);
  fmt::print("Default model: d_model {}, ffn {}, {} experts (top {}) of width {}, {} layers, "
             "{} parameters; global batch {} x {} tokens, micro-batch {}.\n\n",
             mc.d_model, mc.ffn, mc.experts, mc.top_k, mc.expert_ffn, mc.layers,
             cmesh::model::moe_lm_parameter_count(mc), tc.global_batch, tc.seq_len,
             tc.micro_batch);
  bool all_ran = true;

  // 1. Throughput by layout.
  struct layout {
    const char* name;
    int procs, replicas;
    bool overlap = true; // train.overlap
  };
  const std::vector<layout> layouts = {
    {"1x1", 1, 1}, {"2x1", 2, 2}, {"2x1, overlap off", 2, 2, false}, {"2x2", 4, 2}};
  const auto off_path = fmt::format("/tmp/cmesh_bench_train_overlap_{}.toml", getpid());
  std::ofstream(off_path) << "[train]\noverlap = false\n";
  std::map<std::string, throughput> tp;
  run_out one_by_one;
  fmt::print("## throughput by layout (replica groups x ranks per group)\n\n");
  fmt::print("| layout | processes | tokens/s (job) | tokens/s per process | step ms | comm ms | "
             "comm share of step | GEMM share of step (rank 0) |\n"
             "|---|---|---|---|---|---|---|---|\n");
  for (auto& l : layouts) {
    auto r = launch(fmt::format("-n {} --replicas {} --steps {} --log-every 1{}", l.procs,
                                l.replicas, steps, l.overlap ? "" : " --config " + off_path));
    auto t = summarise(r.steps, warmup);
    if (r.status != 0 || t.steps == 0) {
      all_ran = false;
      fmt::print("| {} | {} | run failed (status {}) | | | | | |\n", l.name, l.procs, r.status);
      continue;
    }
    tp[l.name] = t;
    std::string gemm_share = "-";
    if (auto s = r.stats.find(0); s != r.stats.end() && s->second.step_ms_total > 0)
      gemm_share = fmt::format("{:.0f}%", 100.0 * s->second.gemm_ms / s->second.step_ms_total);
    fmt::print("| {} | {} | {:.0f} | {:.0f} | {:.1f} | {:.1f} | {:.1f}% | {} |\n", l.name,
               l.procs, t.tokens_per_s, t.tokens_per_s / l.procs, t.step_ms, t.comm_ms,
               100.0 * t.comm_ms / t.step_ms, gemm_share);
    if (std::string(l.name) == "1x1")
      one_by_one = std::move(r);
  }
  std::remove(off_path.c_str());
  fmt::print("\n");
  if (tp.count("1x1") && tp.count("2x1")) {
    double frac = (tp["2x1"].tokens_per_s / 2) / tp["1x1"].tokens_per_s;
    fmt::print("Per-process throughput at 2x1: {:.0f}% of 1x1's (goal: at least 70%): {}\n\n",
               100.0 * frac, verdict(frac >= 0.70));
  } else {
    fmt::print("Per-process throughput at 2x1 against 1x1: not measured (a run failed)\n\n");
  }
  fmt::print("tokens/s (job) is the global batch's tokens over the step time, as the\n"
             "progress lines print it; per process divides it by the processes. comm is\n"
             "the first member's time waiting on collectives within the step. With\n"
             "train.overlap (the default) each unit's gradient is summed over the groups\n"
             "on a thread of the trainer's own during the last backward pass; 'overlap\n"
             "off' sums the whole gradient after it. 2x2 runs 4 processes on {} cores\n"
             "(for information).\n\n",
             std::thread::hardware_concurrency());

  // 2. GEMM inside the step against OpenBLAS alone.
  fmt::print("## matrix products inside the step (1x1 run) against OpenBLAS sgemm alone\n\n");
  auto shapes = one_by_one.shapes[0];
  auto st = one_by_one.stats.find(0);
  if (shapes.empty() || st == one_by_one.stats.end()) {
    all_ran = false;
    fmt::print("no gemm counters in the 1x1 run's output\n\n");
  } else {
    std::sort(shapes.begin(), shapes.end(),
              [](const gemm_shape& a, const gemm_shape& b) { return a.ms > b.ms; });
    cmesh::kernels::cpu::set_blas_threads(blas_threads);
    openblas_set_num_threads(blas_threads);
    double shapes_ms = 0;
    for (auto& g : shapes)
      shapes_ms += g.ms;
    // Shapes of at least 2% of the time get a row each; the rest (mostly
    // expert products, one shape per token count an expert receives) one
    // row together, their sgemm-alone time the sum of each shape's.
    constexpr double own_row = 0.02;
    fmt::print("| product | m | n | k | calls/step | share of GEMM time | in-step GFLOP/s | "
               "sgemm alone GFLOP/s | in-step / alone |\n"
               "|---|---|---|---|---|---|---|---|---|\n");
    double flops_all = 0, ms_all = 0, alone_s_all = 0;
    double flops_rest = 0, ms_rest = 0, alone_s_rest = 0;
    uint64_t calls_rest = 0;
    size_t rest = 0;
    for (auto& g : shapes) {
      const bool own = g.ms >= own_row * shapes_ms;
      const double alone = raw_sgemm_gflops(g, own ? (quick ? 0.01 : 0.03) : 0.002);
      const double alone_s = g.flops() / (alone * 1e9);
      flops_all += g.flops();
      ms_all += g.ms;
      alone_s_all += alone_s;
      if (!own) {
        ++rest;
        flops_rest += g.flops();
        ms_rest += g.ms;
        alone_s_rest += alone_s;
        calls_rest += g.calls;
        continue;
      }
      const double in_step = g.flops() / (g.ms * 1e6);
      fmt::print("| {}{} | {} | {} | {} | {:.1f} | {:.1f}% | {:.2f} | {:.2f} | {:.2f} |\n",
                 g.trans_a ? 'T' : 'N', g.trans_b ? 'T' : 'N', g.m, g.n, g.k,
                 static_cast<double>(g.calls) / steps, 100.0 * g.ms / shapes_ms, in_step, alone,
                 in_step / alone);
    }
    if (rest > 0) {
      const double in_step = flops_rest / (ms_rest * 1e6), alone = flops_rest / alone_s_rest / 1e9;
      fmt::print("| {} other shapes | | | | {:.1f} | {:.1f}% | {:.2f} | {:.2f} | {:.2f} |\n", rest,
                 static_cast<double>(calls_rest) / steps, 100.0 * ms_rest / shapes_ms, in_step,
                 alone, in_step / alone);
    }
    const double in_step_all = flops_all / (ms_all * 1e6);
    const double alone_all = flops_all / alone_s_all / 1e9;
    uint64_t calls_all = 0;
    for (auto& g : shapes)
      calls_all += g.calls;
    fmt::print("| all {} shapes | | | | {:.1f} | 100% | {:.2f} | {:.2f} | {:.2f} |\n\n",
               shapes.size(), static_cast<double>(calls_all) / steps, in_step_all, alone_all,
               in_step_all / alone_all);
    const auto& rs = st->second;
    fmt::print("Rank 0 spent {:.0f} ms in sgemm ({} products, {:.2f} GFLOP/s) over {:.0f} ms of\n"
               "committed steps: {:.0f}% of the step. The shapes above cover {:.1f}% of that\n"
               "time (a product whose shape found the per-shape table full counts in the\n"
               "totals only). calls/step: over all {} steps, warm-up included.\n"
               "N/T: op(A), op(B) as stored or transposed: forward products are NN,\n"
               "backward ones TN (weight gradient) and NT (input gradient). 'alone' is this\n"
               "process calling cblas_sgemm on compact operands in a loop (hot caches), best\n"
               "of three batches, {} OpenBLAS thread(s) like the workers.\n\n",
               rs.gemm_ms, rs.gemm_calls, rs.gemm_gflops, rs.step_ms_total,
               100.0 * rs.gemm_ms / rs.step_ms_total, 100.0 * ms_all / rs.gemm_ms, steps,
               blas_threads);
  }

  // 3. Peak resident memory per rank at 1x1 and 1x2, with the two sharding
  // modes at 1x2. Enough steps to fill the replay window, so the peak
  // includes it.
  const size_t mem_steps = replay_window + (quick ? 2 : 6);
  const std::string mem_model = "[model]\nd_model = 1024\nffn = 2048\nexpert_ffn = 1024\n"
                                "layers = 4\ncontext = 4\n"
                                "[train]\nglobal_batch = 4\nmicro_batch = 2\n";
  const auto mem_cfg = cmesh::model::parse_config(mem_model);
  if (!mem_cfg) {
    fmt::print(stderr, "cmesh_bench_train: memory config: {}\n",
               cmesh::describe(mem_cfg.error()));
    return 1;
  }
  const auto tensors = cmesh::model::moe_lm_tensors(mem_cfg->model);
  const size_t params = cmesh::model::moe_lm_parameter_count(mem_cfg->model);
  // The largest unit full sharding streams (a layer's dense FFN, its router,
  // one expert, the embedding with the mixing, the output layer): its
  // weights and its gradient are the only whole tensors a rank holds.
  size_t largest_unit = 0;
  {
    std::map<std::string, size_t> units;
    for (const auto& t : tensors) {
      auto name = t.name;
      if (t.layer < 0)
        name = name.rfind("out.", 0) == 0 ? "out" : "pre";
      else
        name = name.substr(0, name.rfind('.')); // layerL.ffn, layerL.moe.router, ...expertE
      units[name] += t.size;
    }
    for (auto& [n, sz] : units)
      largest_unit = std::max(largest_unit, sz);
  }
  fmt::print("## peak resident memory per rank (d_model 1024, ffn 2048, 4 experts of 1024, "
             "4 layers, context 4; {:.1f} M parameters; {} steps)\n\n",
             static_cast<double>(params) / 1e6, mem_steps);
  const size_t window = std::min(mem_steps, replay_window);
  auto shard_of = [&](size_t S) { // the largest shard
    auto split = cmesh::actors::split_shards(params, S, cmesh::actors::norm_block);
    return static_cast<double>(*std::max_element(split.counts.begin(), split.counts.end()));
  };
  // Per rank, fp32, in bytes: parameters, gradient and AdamW state, and the
  // replay window of committed updates (a shard each).
  //   optimizer sharding: whole working weights and gradient, the moments
  //     and (S > 1) the shard's reduced gradient a shard each;
  //   full sharding: the master, the moments and the reduced gradient a
  //     shard each, plus the largest unit's weights and gradient, twice
  //     with prefetch (the next unit's gathered, the last one's reduced).
  auto state_bytes = [&](size_t S, bool full, bool prefetch = true) {
    const double P = static_cast<double>(params), sh = shard_of(S);
    if (S == 1)
      return 4.0 * (4.0 * P);
    if (!full)
      return 4.0 * (2.0 * P + 3.0 * sh);
    return 4.0 * (4.0 * sh + (prefetch ? 4.0 : 2.0) * static_cast<double>(largest_unit));
  };
  auto window_bytes = [&](size_t S, size_t kept) {
    return 4.0 * static_cast<double>(kept) * shard_of(S);
  };
  struct mem_case {
    const char* name;
    int procs;
    const char* sharding;
    bool prefetch = true;
    double rss = NAN;
  };
  std::vector<mem_case> mem = {{"1x1", 1, "optimizer"},
                               {"1x2 optimizer", 2, "optimizer"},
                               {"1x2 full", 2, "full"},
                               {"1x2 full, no overlap", 2, "full", false}};
  fmt::print("| layout, sharding | max RSS per rank MiB (measured) | params+grads+AdamW MiB "
             "(computed) | replay window MiB ({} updates) | RSS less both | step ms (mean) | "
             "waiting on comm ms (mean) |\n|---|---|---|---|---|---|---|\n",
             window);
  const auto cfg_path = fmt::format("/tmp/cmesh_bench_train_{}.toml", getpid());
  for (auto& c : mem) {
    {
      std::ofstream f(cfg_path);
      f << mem_model << "sharding = \"" << c.sharding << "\"\noverlap = "
        << (c.prefetch ? "true" : "false") << "\n";
    }
    auto r = launch(fmt::format("-n {} --replicas 1 --config {} --steps {} --log-every 1",
                                c.procs, cfg_path, mem_steps));
    const size_t S = static_cast<size_t>(c.procs);
    const bool full = std::string(c.sharding) == "full";
    const double st = state_bytes(S, full, c.prefetch), win = window_bytes(S, window);
    if (r.status != 0 || r.stats.size() != S) {
      all_ran = false;
      fmt::print("| {} | run failed (status {}) | {:.1f} | {:.1f} | | | |\n", c.name, r.status,
                 mib(st), mib(win));
      continue;
    }
    c.rss = 0;
    std::string per_rank;
    for (auto& [rank, s] : r.stats) {
      c.rss = std::max(c.rss, s.max_rss_mb);
      per_rank += fmt::format("{}{:.0f}", per_rank.empty() ? "" : " / ", s.max_rss_mb);
    }
    const auto t = summarise(r.steps, 1);
    fmt::print("| {} | {} | {:.1f} | {:.1f} | {:.1f} | {:.0f} | {:.0f} |\n", c.name, per_rank,
               mib(st), mib(win), c.rss - mib(st + win),
               r.stats.begin()->second.step_ms_total / static_cast<double>(mem_steps), t.comm_ms);
  }
  std::remove(cfg_path.c_str());
  fmt::print("\n1x2 / 1x1 per rank, goal \"at 1x2 each rank's parameter and optimizer memory at "
             "most 60% of 1x1's\":\n\n| figure | 1x2 optimizer / 1x1 | 1x2 full / 1x1 | goal "
             "(<= 60%, full sharding) |\n|---|---|---|---|\n");
  auto ratio_row = [&](const char* what, double opt, double full) {
    fmt::print("| {} | {:.0f}% | {:.0f}% | {} |\n", what, 100.0 * opt, 100.0 * full,
               verdict(full <= 0.60));
  };
  ratio_row("computed: params + grads + AdamW", state_bytes(2, false) / state_bytes(1, false),
            state_bytes(2, true) / state_bytes(1, false));
  ratio_row("computed: the same + replay window",
            (state_bytes(2, false) + window_bytes(2, window))
              / (state_bytes(1, false) + window_bytes(1, window)),
            (state_bytes(2, true) + window_bytes(2, window))
              / (state_bytes(1, false) + window_bytes(1, window)));
  if (!std::isnan(mem[0].rss) && !std::isnan(mem[1].rss) && !std::isnan(mem[2].rss))
    ratio_row("measured: max RSS of the largest rank", mem[1].rss / mem[0].rss,
              mem[2].rss / mem[0].rss);
  else
    fmt::print("| measured: max RSS of the largest rank | not measured | | |\n");
  fmt::print("\nWith train.sharding = \"optimizer\" the working weights and the gradient stay\n"
             "whole on every rank; only the fp32 master, the AdamW moments and the replay\n"
             "window ({} committed updates of a shard each) are sharded. With \"full\" the\n"
             "weights and gradients stream through the group a unit at a time (largest unit\n"
             "here {:.2f} M elements): a rank holds its shard of everything plus one unit's\n"
             "weights and gradient, two of each with prefetch (train.overlap, the default:\n"
             "the next unit is gathered and the last one's gradient reduce-scattered on a\n"
             "thread of the trainer's own while a unit computes). 'RSS less both' is the\n"
             "rest: runtime, communicators, activations, allocator slack. Step ms: rank 0's\n"
             "mean over the run, the first step included; full sharding gathers the weights\n"
             "twice per micro-batch and reduce-scatters per micro-batch, unit by unit.\n"
             "Waiting on comm: rank 0's time blocked in collectives per step (after the\n"
             "first step).\n\n",
             replay_window, static_cast<double>(largest_unit) / 1e6);

  activations_table(quick, blas_threads);
  all_ran = verify_table(steps, warmup, quick) && all_ran;
  return all_ran ? 0 : 1;
}
