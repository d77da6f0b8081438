// Recovery benchmark.
//
//  1. Kill -> survivors' next committed step, p50 and p99 over seeded
//     SIGKILLs, for 4x1, 2x2 and 2x1 (replica groups x ranks per group);
//     then a fault (a step failing with every process alive) -> the next
//     committed step, through the epoch re-formed with the same members;
//     then a hang seen only by silence (SIGSTOP) -> the next committed step,
//     at two heartbeat timeouts.
//  2. Catch-up of a restarted group by model size: time from its catch-up
//     assignment to its admission, and the snapshot's transfer rate beside
//     this machine's memcpy rate and the host backend's broadcast of the
//     same bytes between two idle workers (the goal: at least half of it),
//     measured in the same run.
//  3. The survivors' stall while they serve a catch-up: rank 0's step times
//     between the catch-up's assignment and the joiner's admission, against
//     its step times alone before the restart, at 2x1 (the joiner on a core
//     of its own, as on a spare node) and 2x2 (the restarted group shares
//     the survivors' cores).
// Every figure comes from the launcher's JSON-lines event log (CLOCK_MONOTONIC
// timestamps shared by all processes) and the workers' log lines.
//
//   cmesh_bench_recovery [--kills N] [--seed S] [--quick] [--catchup-only]
//                        [--latency-only] [--stops-only] [--broadcast BYTES]
//
// --quick: 4 kills per layout and the two smaller models; --catchup-only:
// parts 2 and 3 alone (what a machine with more cores than this one's two
// is lent for: there a survivor's serving thread and the joiner each have a
// core of their own, beside the trainers'); --latency-only: part 1 alone;
// --stops-only: its SIGSTOP table alone.
#include "actors/supervisor.hpp"
#include "collectives/host/host_communicator.hpp"
#include "common/launch.hpp"
#include "core/env.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <tuple>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

namespace {

struct event {
  std::string name, line;
  double mono_ms = 0;
  std::string field(const std::string& key) const {
    std::smatch m;
    std::regex re("\"" + key + "\":(\"[^\"]*\"|\\[[^\\]]*\\]|[-0-9.a-z]+)");
    return std::regex_search(line, m, re) ? m[1].str() : std::string{};
  }
  double num(const std::string& key) const {
    auto f = field(key);
    return f.empty() ? -1 : std::stod(f);
  }
};

struct run_out {
  int status = -1;
  std::string output;
  std::vector<event> events;
};

run_out launch(const std::string& args) {
  static int serial = 0;
  auto base = fmt::format("/tmp/cmesh_bench_recovery_{}_{}", getpid(), serial++);
  auto l = cmesh::bench::run_launch(base, fmt::format("{} --events {}.jsonl", args, base), 900);
  run_out r;
  r.status = l.status;
  r.output = std::move(l.output);
  std::ifstream in(base + ".jsonl");
  std::string line;
  std::regex name_re("\"event\":\"([a-z_]+)\"");
  std::regex mono_re("\"mono_ms\":([0-9.]+)");
  while (std::getline(in, line)) {
    std::smatch a, b;
    if (std::regex_search(line, a, name_re) && std::regex_search(line, b, mono_re))
      r.events.push_back({a[1].str(), line, std::stod(b[1].str())});
  }
  std::remove((base + ".jsonl").c_str());
  return r;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty())
    return NAN;
  std::sort(v.begin(), v.end());
  auto i = static_cast<size_t>(std::min<double>(v.size() - 1, std::ceil(p * v.size()) - 1));
  return v[i];
}

/// Appends the time from event i to the next first commit, if any.
void to_next_commit(const std::vector<event>& ev, size_t i, std::vector<double>& out) {
  for (size_t j = i + 1; j < ev.size(); ++j)
    if (ev[j].name == "first_commit") {
      out.push_back(ev[j].mono_ms - ev[i].mono_ms);
      return;
    }
}

/// The index of the worker_lost that follows chaos event i for its rank,
/// if that rank was then a member of the running epoch; 0 otherwise. A
/// rank that is not a member (restarting or catching up) does not touch
/// the survivors' steps: it leaves no epoch change, and no first_commit,
/// to time.
size_t member_loss(const std::vector<event>& ev, size_t i) {
  for (size_t j = i + 1; j < ev.size(); ++j)
    if (ev[j].name == "worker_lost" && ev[j].num("rank") == ev[i].num("rank"))
      return ev[j].field("member") == "true" ? j : 0;
  return 0;
}

double max_of(const std::vector<double>& v) {
  return v.empty() ? NAN : *std::max_element(v.begin(), v.end());
}

/// For every chaos SIGKILL of a member of the running epoch, the time to
/// the next first_commit after it.
std::vector<double> kill_to_commit(const std::vector<event>& ev) {
  std::vector<double> out;
  for (size_t i = 0; i < ev.size(); ++i)
    if (ev[i].name == "chaos" && ev[i].field("signal").find("SIGKILL") != std::string::npos
        && member_loss(ev, i))
      to_next_commit(ev, i, out);
  return out;
}

/// From each chaos fault (SIGUSR2: a step fails, every process alive) to
/// the next committed step.
std::vector<double> fault_to_commit(const std::vector<event>& ev) {
  std::vector<double> out;
  for (size_t i = 0; i < ev.size(); ++i) {
    if (ev[i].name == "chaos" && ev[i].field("signal").find("SIGUSR2") != std::string::npos)
      to_next_commit(ev, i, out);
  }
  return out;
}

/// The host backend's broadcast of `bytes` between two workers (two UCP
/// workers of this process: the same shared-memory transports as two
/// processes), in chunks of a catch-up piece's size and eager protocol, on
/// an otherwise idle machine: the collectives' bandwidth the catch-up's is
/// held against. `cold`: the first broadcast of fresh workers, on a
/// one-shot transfer context (coll::transfer_context), sent-once buffers
/// as a catch-up's are; `warm`: the best of three after a first, on that kind and on a
/// training context (UCX's default FIFO), whichever is faster. NAN when it
/// fails.
struct bcast_rate {
  double cold = NAN, warm = NAN;
};
bcast_rate broadcast_gbps(size_t bytes, bool transfer) {
  using namespace cmesh::coll;
  auto make = [&](uint32_t rank) {
    return transfer ? transfer_context(rank) : host_context::create(rank, bulk_protocol::eager, false);
  };
  auto a = make(0);
  auto b = make(1);
  if (!a || !b)
    return {};
  const std::vector<std::string> addresses{(*a)->address(), (*b)->address()};
  const membership m{1, {0, 1}};
  auto alive = [](uint32_t) { return caf::error{}; };
  host_options o;
  o.chunk_bytes = cmesh::actors::supervisor_options{}.catchup_chunk_bytes;
  o.shared_memory_ring = false; // catch-up does not use it
  auto ca = make_host_communicator(*a, m, addresses, alive, o);
  auto cb = make_host_communicator(*b, m, addresses, alive, o);
  if (!ca || !cb)
    return {};
  const size_t n = bytes / sizeof(float);
  std::vector<float> x(n, 1.0f), y(n, 0.0f); // touched, as the catch-up's buffers are
  bcast_rate out;
  double best = 0;
  for (int rep = 0; rep < 4; ++rep) {
    caf::error ea, eb;
    const auto t0 = cmesh::mono_ns();
    std::thread t([&] { eb = (*cb)->broadcast(y.data(), n, dtype::float32, 0); });
    ea = (*ca)->broadcast(x.data(), n, dtype::float32, 0);
    t.join();
    const double dt = static_cast<double>(cmesh::mono_ns() - t0) / 1e9;
    if (ea || eb)
      return {};
    const double gbps = static_cast<double>(bytes) / dt / 1e9;
    if (rep == 0)
      out.cold = gbps;
    else
      best = std::max(best, gbps);
  }
  out.warm = best;
  return out;
}
bcast_rate broadcast_gbps(size_t bytes) {
  auto t = broadcast_gbps(bytes, true), d = broadcast_gbps(bytes, false);
  return {t.cold, std::max(t.warm, d.warm)};
}

double memcpy_gbps() {
  std::vector<char> a(256 << 20, 1), b(256 << 20, 0);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = cmesh::mono_ns();
    std::memcpy(b.data(), a.data(), a.size());
    auto dt = static_cast<double>(cmesh::mono_ns() - t0) / 1e9;
    best = std::max(best, static_cast<double>(a.size()) / dt / 1e9);
  }
  return best;
}

/// Part 1: kill -> the survivors' next committed step, over `kills` seeded
/// SIGKILLs in each layout.
void kill_latency_table(int kills, uint64_t seed) {
  fmt::print("## kill -> survivors' next committed step (goal: p50 < 1000 ms, p99 < 3000 ms)\n\n");
  fmt::print("| layout | kills of members timed | p50 ms | p99 ms | max ms | goal |\n|---|---|---|---|---|---|\n");
  for (auto [R, S] : {std::pair{4, 1}, {2, 2}, {2, 1}}) {
    std::vector<double> lat;
    int per_run = std::min(kills, 10);
    for (int done = 0, run = 0; done < kills; done += per_run, ++run) {
      auto r = launch(fmt::format("-n {} --replicas {} --steps {} --log-every 1000 "
                                  "--restart-delay-ms 300 --max-restarts 100 --chaos-kills {} "
                                  "--chaos-seed {}",
                                  R * S, R, 40 * per_run + 40, per_run,
                                  seed + 100 * (R * S) + 10 * S + run));
      auto l = kill_to_commit(r.events);
      lat.insert(lat.end(), l.begin(), l.end());
      if (r.status != 0)
        fmt::print(stderr, "note: a {}x{} run ended with status {}\n", R, S, r.status);
    }
    auto p50 = percentile(lat, 0.5), p99 = percentile(lat, 0.99);
    fmt::print("| {}x{} | {} | {:.0f} | {:.0f} | {:.0f} | {} |\n", R, S, lat.size(), p50, p99,
               max_of(lat),
               p50 < 1000 && p99 < 3000 ? "met" : "MISSED");
  }
  fmt::print("\nIn 2x2 a kill takes its whole group out (its partner is fenced and\n"
             "restarted too); with two groups a kill while the other group is out is\n"
             "skipped (no group would be left).\n\n");
}

/// Part 1b: a step that fails with every process alive (chaos fault@) ->
/// the next committed step, through the epoch re-formed with the same
/// members, at two grace periods.
void fault_latency_table(int faults, uint64_t seed) {
  fmt::print("## fault (a step fails, every process alive) -> next committed step\n\n");
  fmt::print("Without a re-form, the failed rank would wait 120 s for an epoch and its\n"
             "peers 30 s in a collective, then restart. Here nobody restarts.\n\n");
  fmt::print("| layout | --broken-grace-ms | faults timed | p50 ms | p99 ms | max ms | restarts |\n"
             "|---|---|---|---|---|---|---|\n");
  for (auto [R, S] : {std::pair{4, 1}, {2, 2}}) {
    for (int grace : {500, 100}) {
      auto r = launch(fmt::format("-n {} --replicas {} --steps {} --log-every 1000 "
                                  "--broken-grace-ms {} --chaos-faults {} --chaos-seed {}",
                                  R * S, R, 30 * faults + 40, grace, faults,
                                  seed + 100 * (R * S) + 10 * S));
      auto lat = fault_to_commit(r.events);
      size_t restarts = 0;
      for (auto& e : r.events)
        restarts += e.name == "restart" ? 1 : 0;
      if (r.status != 0)
        fmt::print(stderr, "note: a {}x{} fault run ended with status {}\n", R, S, r.status);
      fmt::print("| {}x{} | {} | {} | {:.0f} | {:.0f} | {:.0f} | {} |\n", R, S, grace, lat.size(),
                 percentile(lat, 0.5), percentile(lat, 0.99),
                 max_of(lat), restarts);
    }
  }
  fmt::print("\nThe time holds the rest of the step the fault fell in, the grace (the\n"
             "coordinator waits that long for a death that would explain the failure)\n"
             "and the retried step.\n\n");
}

/// One SIGSTOP of a member: when it was seen (silence), when the survivors
/// committed again, and how many epochs were announced in between.
struct stop_timing {
  double detect_ms = NAN, commit_ms = NAN;
  int epochs = 0;
};

/// For every chaos SIGSTOP of a member of the running epoch: the time to
/// its worker_lost (silence of its beacons or of its transport's
/// heartbeats) and to the next first_commit after
/// that, and the epochs announced meanwhile (one is the least: the epoch
/// without it). `false_losses` counts ranks found silent that nobody
/// stopped (a beacon late past the timeout on a busy machine).
std::vector<stop_timing> stop_to_commit(const std::vector<event>& ev, int& false_losses) {
  std::vector<stop_timing> out;
  std::map<double, bool> stopped; // rank -> under SIGSTOP
  for (size_t i = 0; i < ev.size(); ++i) {
    const auto& e = ev[i];
    if (e.name == "chaos" && e.field("signal").find("SIGCONT") != std::string::npos)
      stopped[e.num("rank")] = false;
    const bool by_silence = e.field("reason").find("silent") != std::string::npos
                            || e.field("reason").find("transport lost it") != std::string::npos;
    if (e.name == "worker_lost" && by_silence && !stopped[e.num("rank")])
      ++false_losses;
    if (e.name != "chaos" || e.field("signal") != "\"SIGSTOP\"")
      continue;
    stopped[e.num("rank")] = true;
    const size_t lost = member_loss(ev, i);
    if (!lost)
      continue;
    stop_timing t;
    t.detect_ms = ev[lost].mono_ms - e.mono_ms;
    for (size_t j = lost; j < ev.size(); ++j) {
      t.epochs += ev[j].name == "epoch" ? 1 : 0;
      if (ev[j].name == "first_commit") {
        t.commit_ms = ev[j].mono_ms - e.mono_ms;
        break;
      }
    }
    if (!std::isnan(t.commit_ms))
      out.push_back(t);
  }
  return out;
}

/// Part 1c: a rank that stops answering (SIGSTOP: a hung host, a process
/// the kernel froze), seen only by the silence of its heartbeats, -> the
/// survivors' next committed step, at two heartbeat timeouts.
void stop_latency_table(int stops, uint64_t seed) {
  fmt::print("## hang (SIGSTOP, seen only by silence) -> survivors' next committed step\n\n");
  fmt::print("Nothing closes a connection: the coordinator learns of it when the rank's\n"
             "beacons (every 100 ms) stop for --heartbeat-timeout-ms, or when a peer's\n"
             "transport (heartbeats every 100 ms, 800 ms of silence) reports it and the\n"
             "coordinator has not heard it for a third of its timeout, whichever comes\n"
             "first. It is continued (SIGCONT) a second after it is dropped, is fenced,\n"
             "restarts and catches up.\n\n");
  fmt::print("| layout | --heartbeat-timeout-ms | stops timed | stop->lost p50 / max ms | "
             "stop->commit p50 / p99 / max ms | epochs announced, lost->commit (mean) | "
             "ranks found silent that nobody stopped |\n|---|---|---|---|---|---|---|\n");
  std::mt19937_64 rng(seed);
  for (auto [R, S] : {std::pair{4, 1}, {2, 2}}) {
    for (int timeout : {1500, 500}) {
      std::vector<stop_timing> all;
      int false_losses = 0;
      const int per_run = std::min(stops, 10);
      for (int done = 0; done < stops; done += per_run) {
        // 60 steps apart: the stopped group is back, caught up, before the next.
        std::string plan;
        for (int k = 0; k < per_run; ++k)
          plan += fmt::format("{}stop@{}:{}:{}?", k ? "," : "", 30 + 60 * k,
                              rng() % static_cast<uint64_t>(R * S), timeout + 1000);
        auto r = launch(fmt::format("-n {} --replicas {} --steps {} --log-every 1000 "
                                    "--restart-delay-ms 300 --max-restarts 100 "
                                    "--heartbeat-timeout-ms {} --chaos {}",
                                    R * S, R, 60 * per_run + 40, timeout, plan));
        auto t = stop_to_commit(r.events, false_losses);
        all.insert(all.end(), t.begin(), t.end());
        if (r.status != 0)
          fmt::print(stderr, "note: a {}x{} stop run ended with status {}\n", R, S, r.status);
      }
      std::vector<double> detect, commit;
      double epochs = 0;
      for (auto& t : all)
        detect.push_back(t.detect_ms), commit.push_back(t.commit_ms), epochs += t.epochs;
      fmt::print("| {}x{} | {} | {} | {:.0f} / {:.0f} | {:.0f} / {:.0f} / {:.0f} | {:.2f} | {} |\n",
                 R, S, timeout, all.size(), percentile(detect, 0.5), max_of(detect),
                 percentile(commit, 0.5), percentile(commit, 0.99), max_of(commit),
                 all.empty() ? NAN : epochs / static_cast<double>(all.size()), false_losses);
    }
  }
  fmt::print("\nstop->lost is the shorter detector's bound (the coordinator's timeout, or the\n"
             "transport's 800 ms), less the time since the rank's last heartbeat (up to\n"
             "100 ms), plus the epoch manager's tick; lost->commit is about what\n"
             "a SIGKILL costs (part 1). One epoch announced per stop means the silence cost\n"
             "no extra re-formed epoch.\n\n");
}

struct size_case {
  const char* name;
  size_t d_model, ffn, expert_ffn;
  size_t steps;
  int kill_step;
  int restart_delay_ms; // long enough for a few steps of the survivors alone
};

} // namespace

int main(int argc, char** argv) {
  int kills = 20;
  uint64_t seed = 1;
  bool quick = false, catchup_only = false, latency_only = false, stops_only = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--kills" && i + 1 < argc)
      kills = std::atoi(argv[++i]);
    else if (a == "--seed" && i + 1 < argc)
      seed = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--quick")
      quick = true;
    else if (a == "--catchup-only")
      catchup_only = true;
    else if (a == "--latency-only")
      latency_only = true;
    else if (a == "--stops-only")
      stops_only = true;
    else if (a == "--broadcast" && i + 1 < argc) {
      const size_t bytes = std::strtoull(argv[++i], nullptr, 10);
      for (bool transfer : {true, false}) {
        auto r = broadcast_gbps(bytes, transfer);
        fmt::print("broadcast of {} bytes, {} context: cold {:.2f} GB/s, warm {:.2f} GB/s\n", bytes,
                   transfer ? "transfer" : "training", r.cold, r.warm);
      }
      return 0;
    } else {
      fmt::print(stderr, "usage: cmesh_bench_recovery [--kills N] [--seed S] [--quick] "
                 "[--catchup-only] [--latency-only] [--stops-only] [--broadcast BYTES]\n");
      return 2;
    }
  }
  if (quick)
    kills = 4;
  fmt::print("# recovery benchmark: {} seeded kills per layout, seed {}, {} cores\n\n", kills,
             seed, std::thread::hardware_concurrency());

  if (stops_only) {
    stop_latency_table(kills, seed);
    return 0;
  }
  if (!catchup_only) {
    kill_latency_table(kills, seed);
    fault_latency_table(kills, seed);
    stop_latency_table(kills, seed);
  }
  if (latency_only)
    return 0;

  // 2 and 3. Catch-up by model size, and the survivors' stall meanwhile.
  double mem = memcpy_gbps();
  fmt::print("## catch-up of a restarted group, by model size, and the survivors' stall\n\n");
  fmt::print("memcpy on this machine, same run: {:.2f} GB/s\n\n", mem);
  fmt::print("| layout | model | catch-up nice | params | state MB | assign->admitted ms | "
             "snapshot GB/s | of memcpy | of a warm broadcast (goal >= 0.5) / of a cold one | "
             "survivors' step ms: "
             "alone / joiner starting / serving | stall while serving | time lost serving | "
             "goal (<10%) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::map<long, bcast_rate> bcast; // by state MB, rounded: measured once each
  std::vector<size_case> cases = {{"default", 64, 128, 64, 200, 8, 1500},
                                  {"x4 width", 256, 512, 256, 70, 4, 2500},
                                  {"x8 width", 512, 1024, 512, 26, 3, 4500}};
  if (quick)
    cases.resize(2);
  // 2x1: the joiner has a core of its own, as a spare node would; 2x2: the
  // restarted group's two processes share the survivors' two cores.
  struct layout {
    int n, replicas;
    uint32_t victim; // a rank of the group that is killed; rank 0 survives and prints
  };
  struct row {
    double mb = NAN, secs = NAN, assign_ms = NAN;
    double alone = NAN, starting = NAN, serving = NAN;
    int n_alone = 0, n_starting = 0, n_serving = 0;
    double stall = NAN, lost_ms = NAN;
  };
  // One run of a case; nothing when it did not get through a catch-up.
  auto measure = [](const layout& lay, const size_case& c, int nice) -> std::optional<row> {
    auto cfg = fmt::format("/tmp/cmesh_bench_recovery_{}.toml", getpid());
    {
      std::ofstream f(cfg);
      f << "[model]\nd_model = " << c.d_model << "\nffn = " << c.ffn
        << "\nexpert_ffn = " << c.expert_ffn << "\n";
    }
    auto r = launch(fmt::format("-n {} --replicas {} --config {} --steps {} --log-every 1 "
                                "--restart-delay-ms {} --chaos kill@{}:{} --catchup-nice {}",
                                lay.n, lay.replicas, cfg, c.steps, c.restart_delay_ms, c.kill_step,
                                lay.victim, nice));
    std::remove(cfg.c_str());
    row out;
    std::smatch m;
    if (std::regex_search(r.output, m,
                          std::regex("snapshot of step [0-9]+ sent to rank [0-9]+ "
                                     "\\(([0-9.]+) MB in ([0-9.]+) s")))
      out.mb = std::stod(m[1].str()), out.secs = std::stod(m[2].str());
    // Rank 0's progress line of every step: "step N ... step X ms".
    std::map<double, double> step_ms;
    {
      std::regex re("(^|\n)step +([0-9]+) .*? step +([0-9.]+) ms");
      for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), re);
           it != std::sregex_iterator(); ++it)
        step_ms[std::stod((*it)[2].str())] = std::stod((*it)[3].str());
    }
    const event *fc = nullptr, *restart = nullptr, *cs = nullptr, *join = nullptr;
    for (auto& e : r.events) {
      if (!fc && e.name == "first_commit" && e.num("since_failure_ms") >= 0)
        fc = &e;
      if (fc && !restart && e.name == "restart")
        restart = &e;
      if (!cs && e.name == "catchup_start")
        cs = &e;
      if (cs && !join && e.name == "epoch" && e.field("joined") != "[]")
        join = &e;
    }
    if (!fc || !restart || !cs || !join || step_ms.empty())
      return std::nullopt;
    // Steps by window: alone (after the failure's first commit, before the
    // restarted processes exist), the joiner starting (restart to catch-up
    // assignment), serving (assignment to admission). A step is in the
    // window its number falls in; the step running at a boundary event
    // goes to the later window.
    auto mean_ms = [&](double from, double to) {
      double sum = 0;
      int n = 0;
      for (auto& [k, v] : step_ms)
        if (k > from && k <= to)
          sum += v, ++n;
      return std::pair{n ? sum / n : NAN, n};
    };
    std::tie(out.alone, out.n_alone) = mean_ms(fc->num("step") + 1, restart->num("step"));
    std::tie(out.starting, out.n_starting) = mean_ms(restart->num("step"), cs->num("step"));
    std::tie(out.serving, out.n_serving) = mean_ms(cs->num("step"), join->num("step"));
    out.stall = out.serving / out.alone - 1.0;
    out.lost_ms = out.n_serving * (out.serving - out.alone);
    out.assign_ms = join->mono_ms - cs->mono_ms;
    return out;
  };
  for (auto lay : {layout{2, 2, 1}, layout{4, 2, 3}})
  // Each case twice: catch-up threads at normal priority, then 10 lower
  // (--catchup-nice): on a shared host the catch-up then takes idle cores.
  for (int nice : {0, 10})
  for (auto& c : cases) {
    const auto lname = fmt::format("{}x{}", lay.replicas, lay.n / lay.replicas);
    // A catch-up of a small model lasts a few steps: the 2x1 cases run three
    // times and the row is the run with the median stall.
    const int runs = lay.n == 2 ? 3 : 1;
    std::vector<row> rows;
    for (int i = 0; i < runs; ++i)
      if (auto x = measure(lay, c, nice))
        rows.push_back(*x);
    if (rows.empty()) {
      fmt::print("| {} | {} | {} | - | - | no run got through a catch-up | | | | | | | |\n", lname,
                 c.name, nice);
      continue;
    }
    std::sort(rows.begin(), rows.end(), [](auto& a, auto& b) { return a.stall < b.stall; });
    const auto& x = rows[rows.size() / 2];
    std::string all;
    for (auto& y : rows)
      all += fmt::format("{}{:.1f}%", all.empty() ? "" : ", ", 100.0 * y.stall);
    double params = x.mb * 1e6 / 12.0;
    double gbps = x.mb / 1e3 / x.secs;
    const long key = std::lround(x.mb * 10);
    if (!bcast.count(key))
      bcast[key] = broadcast_gbps(static_cast<size_t>(x.mb * 1e6));
    const double of_warm = gbps / bcast[key].warm, of_cold = gbps / bcast[key].cold;
    fmt::print("| {} | {} | {} | {:.2f} M | {:.1f} | {:.0f} | {:.2f} | {:.2f} | {:.2f} of {:.2f} "
               "({}) / {:.2f} of {:.2f} | {:.1f} ({}) / {:.1f} ({}) / {:.1f} ({}) | {:.1f}%{} | "
               "{:.0f} ms | {} |\n",
               lname, c.name, nice, params / 1e6, x.mb, x.assign_ms, gbps, gbps / mem, of_warm,
               bcast[key].warm, of_warm >= 0.5 ? "met" : "MISSED", of_cold, bcast[key].cold,
               x.alone,
               x.n_alone, x.starting, x.n_starting, x.serving, x.n_serving, 100.0 * x.stall,
               rows.size() > 1 ? " (runs: " + all + ")" : std::string(), x.lost_ms,
               x.stall < 0.10 ? "met" : "MISSED");
  }
  fmt::print(
    "\nStep times are rank 0's (a survivor and, in 2x2, a catch-up source), means over the\n"
    "steps in each window (how many in parentheses): alone = after the failure's first\n"
    "commit until the restart; joiner starting = the restarted processes start up, load\n"
    "and register; serving = from the catch-up assignment to the admission (snapshot,\n"
    "streamed updates, the join window). The stall is serving over alone; the time lost\n"
    "is the serving steps' excess over the alone mean. 2x1 rows: the run with the median\n"
    "stall of three (all three in parentheses). In 2x1 the joiner runs on the core\n"
    "the dead rank left, as a spare node would; in 2x2 the restarted group's two\n"
    "processes share the two cores with the survivors, so the figure there is mostly\n"
    "oversubscription. assign->admitted includes the source's next step boundary and the\n"
    "500 ms join window. With --catchup-nice 10 the threads serving and receiving the\n"
    "catch-up run 10 nice levels lower. Snapshot GB/s: the state over the source's time\n"
    "from sending its first piece to the joiner's acknowledgement of its last (over the\n"
    "actor mesh; start-up and the request excluded). It is\n"
    "held against the host backend's broadcast of the same bytes between two idle\n"
    "workers of one process, same run: warm (the best of three after a first, on a\n"
    "one-shot transfer context or a training one, whichever is faster; the\n"
    "collectives' bandwidth, the goal's measure) and cold (the first broadcast of fresh\n"
    "workers on a transfer context: sent-once buffers, as a catch-up's are). A survivor serves\n"
    "from a thread beside its trainer's, on a core the trainer keeps busy.\n\n");

  fmt::print("## peers, published figures (for scale; other hardware and scale)\n\n");
  fmt::print("| system | figure |\n|---|---|\n");
  fmt::print("| FT-HSDP (Meta, arXiv 2602.00277) | stall per failure 3 min (vs 10 min for "
             "synchronous restart) at O(100K) GPUs |\n");
  fmt::print("| torchft | lighthouse heartbeats every 100 ms, 1 s timeout to drop a replica "
             "(pytorch/torchft issue 35) |\n");
  fmt::print("| NVIDIA resiliency ext. in-process restart | restarts the training function in "
             "the same process; no per-failure figure published in its docs |\n");
  return 0;
}
