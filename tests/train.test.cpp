// Training the built-in MoE workload end to end under `cmesh launch`.
#include "node_harness.hpp"

#include <fstream>
#include <map>
#include <regex>
#include <set>

using namespace cmesh;
using namespace cmesh::testing;
using namespace std::chrono_literals;

namespace {

// Stated bounds of the default workload (see docs/design.md, Training).
constexpr double loss_threshold = 1.5; // nats per byte; log(256) = 5.55 at the start
constexpr int threshold_steps = 40;

std::string field(const std::string& out, const std::string& key) {
  std::smatch m;
  std::regex re(key + "=([0-9a-zA-Z.+-]+)");
  return std::regex_search(out, m, re) ? m[1].str() : std::string{};
}

std::map<int, double> loss_curve(const std::string& out) {
  std::map<int, double> curve;
  std::regex re("step +([0-9]+) +loss ([0-9.]+)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
       ++it)
    curve[std::stoi((*it)[1].str())] = std::stod((*it)[2].str());
  return curve;
}

/// The largest difference in loss between two curves of the same steps.
double largest_difference(const std::map<int, double>& a, const std::map<int, double>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (auto [step, loss] : a) {
    REQUIRE(b.count(step) == 1);
    worst = std::max(worst, std::abs(loss - b.at(step)));
  }
  return worst;
}

/// The final weights each rank reported, in the order of their lines.
std::vector<std::string> rank_weights(const std::string& out) {
  return captures(out, "rank [0-9]+ done [^\n]*weights=([0-9a-f]+)");
}

run_result train(const std::string& args) {
  auto r = run_cmesh("launch " + args, {}, 600s);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  // No faults are injected here: a worker that died (a crash, a sanitizer
  // report) and was restarted is a failure, even if the job recovered.
  CHECK(r.output.find("restarting worker") == std::string::npos);
  return r;
}

} // namespace

/// `cmesh launch` arguments of a layout R x S (replica groups x ranks each).
std::string layout(int replicas, int per_group) {
  return "-n " + std::to_string(replicas * per_group) + " --replicas " + std::to_string(replicas);
}

TEST_CASE("the loss falls below the threshold at 1x1, 2x1 and 2x2") {
  for (auto [R, S] : {std::pair{1, 1}, {2, 1}, {2, 2}}) {
    CAPTURE(R);
    CAPTURE(S);
    auto r = train(layout(R, S) + " --steps " + std::to_string(threshold_steps)
                   + " --log-every 25");
    auto loss = std::stod(field(r.output, "loss"));
    MESSAGE(R << "x" << S << ": loss " << loss << " after " << threshold_steps << " steps, "
              << field(r.output, "tokens/s") << " tokens/s");
    CHECK(loss < loss_threshold);
  }
}

TEST_CASE("with the same global batch the 2x1 and 2x2 loss curves match 1x1") {
  auto one = loss_curve(train("-n 1 --steps 40 --log-every 5").output);
  REQUIRE(one.size() >= 8);
  for (auto [R, S] : {std::pair{2, 1}, {2, 2}}) {
    auto other = loss_curve(train(layout(R, S) + " --steps 40 --log-every 5").output);
    const double worst = largest_difference(one, other);
    MESSAGE(R << "x" << S << ": largest difference in loss from 1x1: " << worst);
    CHECK(worst < 0.02); // only float summation order differs
  }
}

TEST_CASE("exact mode: final weights are bit-identical across layouts") {
  std::set<std::string> weights;
  for (auto [R, S] : {std::pair{1, 1}, {2, 1}, {4, 1}, {1, 2}, {2, 2}}) {
    auto r = train(layout(R, S) + " --exact --steps 12 --log-every 4");
    auto w = field(r.output, "weights");
    MESSAGE(R << "x" << S << " exact: weights " << w);
    REQUIRE(w.size() == 16);
    // Every rank ends with the same full weights.
    auto ranks = rank_weights(r.output);
    for (auto& rw : ranks)
      CHECK(rw == w);
    CHECK(ranks.size() == static_cast<size_t>(R * S));
    weights.insert(w);
  }
  CHECK(weights.size() == 1);
}

TEST_CASE("bf16 mixed precision: the loss falls at 1x1 and 2x2; overflowed steps are skipped") {
  auto path = "/tmp/cmesh_bf16_" + std::to_string(getpid()) + ".toml";
  {
    std::ofstream(path) << "[train]\nprecision = \"bf16\"\n";
  }
  auto one = train("-n 1 --config " + path + " --steps 40 --log-every 5");
  auto loss = std::stod(field(one.output, "loss"));
  MESSAGE("bf16 1x1: loss " << loss << " after 40 steps");
  CHECK(loss < loss_threshold);
  // Against fp32: the same curve within the rounding of bf16 weights and
  // gradients.
  auto fp32 = loss_curve(train("-n 1 --steps 40 --log-every 5").output);
  const double worst = largest_difference(fp32, loss_curve(one.output));
  MESSAGE("bf16 vs fp32: largest difference in loss " << worst);
  CHECK(worst < 0.1);

  // A loss scale far too large: gradients overflow, every rank skips the
  // same steps (the vote carries the overflow), the scale backs off and
  // training goes on; all ranks end with the same weights. 3 micro-batches
  // for 4 ranks: the experts' exchanges keep the ranks of a group in step.
  {
    std::ofstream(path) << "[train]\nprecision = \"bf16\"\nloss_scale = 1e38\n"
                           "global_batch = 12\n";
  }
  auto r = train(layout(2, 2) + " --config " + path + " --steps 40 --log-every 5");
  std::remove(path.c_str());
  std::map<std::string, int> skips; // step -> ranks that skipped it
  for (auto& step : captures(r.output, "step ([0-9]+) skipped: a gradient overflowed"))
    ++skips[step];
  MESSAGE("bf16 2x2 with loss scale 1e38: " << skips.size() << " step(s) skipped");
  CHECK(!skips.empty());
  for (auto& [step, ranks] : skips) {
    CAPTURE(step);
    CHECK(ranks == 4);
  }
  auto ranks = rank_weights(r.output);
  CHECK(std::set<std::string>(ranks.begin(), ranks.end()).size() == 1);
  CHECK(std::stod(field(r.output, "loss")) < 2.5);
}

TEST_CASE("full sharding: streamed weights and gradients train like whole ones") {
  auto path = "/tmp/cmesh_full_" + std::to_string(getpid()) + ".toml";
  {
    std::ofstream(path) << "[train]\nsharding = \"full\"\n";
  }
  auto one = loss_curve(train("-n 1 --steps 40 --log-every 5").output);
  REQUIRE(one.size() >= 8);
  for (auto [R, S] : {std::pair{1, 2}, {2, 2}}) {
    CAPTURE(R);
    CAPTURE(S);
    auto r = train(layout(R, S) + " --config " + path + " --steps 40 --log-every 5");
    CHECK(r.output.find("weights and gradients streamed over the 2 ranks") != std::string::npos);
    const double worst = largest_difference(one, loss_curve(r.output));
    MESSAGE(R << "x" << S << " fully sharded: largest difference in loss from 1x1: " << worst);
    CHECK(worst < 0.02); // only float summation order differs
    auto ranks = rank_weights(r.output);
    CHECK(ranks.size() == static_cast<size_t>(R * S));
    CHECK(std::set<std::string>(ranks.begin(), ranks.end()).size() == 1);
    // Gathered ahead on the collective lane (the default): most fetches
    // found their unit there. Without prefetch the same bits: the same
    // collectives in the same order, only on another thread.
    const std::regex ahead_re("([0-9]+) of ([0-9]+) unit fetches were gathered ahead");
    size_t reports = 0;
    for (std::sregex_iterator it(r.output.begin(), r.output.end(), ahead_re), end; it != end;
         ++it, ++reports) {
      CAPTURE(it->str());
      CHECK(std::stod((*it)[1].str()) > 0.8 * std::stod((*it)[2].str()));
    }
    CHECK(reports == static_cast<size_t>(R * S));
    if (R == 1) {
      std::ofstream(path) << "[train]\nsharding = \"full\"\noverlap = false\n";
      auto plain = train(layout(R, S) + " --config " + path + " --steps 40 --log-every 5");
      CHECK(plain.output.find("gathered ahead") == std::string::npos);
      auto plain_ranks = rank_weights(plain.output);
      REQUIRE(plain_ranks.size() == 2);
      CHECK(plain_ranks[0] == ranks[0]);
      std::ofstream(path) << "[train]\nsharding = \"full\"\n";
    }
  }
  // bf16, with 3 micro-batches for 4 ranks: a rank without one still takes
  // part in its group's gathers and reductions.
  {
    std::ofstream(path) << "[train]\nsharding = \"full\"\nprecision = \"bf16\"\n"
                           "global_batch = 12\n";
  }
  auto r = train(layout(2, 2) + " --config " + path + " --steps 40 --log-every 5");
  std::remove(path.c_str());
  auto loss = std::stod(field(r.output, "loss"));
  MESSAGE("bf16 2x2 fully sharded, 3 micro-batches: loss " << loss << " after 40 steps");
  CHECK(loss < loss_threshold);
  auto ranks = rank_weights(r.output);
  CHECK(std::set<std::string>(ranks.begin(), ranks.end()).size() == 1);
}

TEST_CASE("overlap: gradients summed unit by unit during the backward pass give the same bits") {
  // Groups of one and of two ranks, two groups: every element is a sum of
  // two (over the groups; and over the group's ranks, then the groups),
  // whatever the pieces, so summing unit by unit on the collective lane
  // must give the very bits of the whole-buffer sums after the backward
  // pass, in fp32 and bf16. 3 micro-batches: the groups run 2 and 1.
  auto path = "/tmp/cmesh_overlap_" + std::to_string(getpid()) + ".toml";
  for (int S : {1, 2}) {
    for (const std::string precision : {"fp32", "bf16"}) {
      CAPTURE(S);
      CAPTURE(precision);
      std::vector<std::string> weights;
      for (const std::string overlap : {"true", "false"}) {
        {
          std::ofstream(path) << "[train]\noverlap = " << overlap << "\nprecision = \""
                              << precision << "\"\nglobal_batch = 12\n";
        }
        auto r = train(layout(2, S) + " --config " + path + " --steps 30 --log-every 10");
        CHECK((r.output.find("summed over the groups unit by unit") != std::string::npos)
              == (overlap == "true"));
        auto ranks = rank_weights(r.output);
        REQUIRE(ranks.size() == static_cast<size_t>(2 * S));
        CHECK(std::set<std::string>(ranks.begin(), ranks.end()).size() == 1);
        weights.push_back(ranks[0]);
      }
      CHECK(weights[0] == weights[1]);
    }
  }
  // Resident experts at 2x2: dense units reduce-scattered by the packed
  // split, each expert unit summed over the groups by its hosts.
  std::vector<std::string> resident;
  for (const std::string overlap : {"true", "false"}) {
    {
      std::ofstream(path) << "[train]\noverlap = " << overlap
                          << "\nexperts = \"resident\"\nglobal_batch = 12\n";
    }
    auto r = train(layout(2, 2) + " --config " + path + " --steps 30 --log-every 10");
    CHECK((r.output.find("resident experts: gradients summed unit by unit") != std::string::npos)
          == (overlap == "true"));
    auto ranks = rank_weights(r.output);
    REQUIRE(ranks.size() == 4);
    CHECK(std::set<std::string>(ranks.begin(), ranks.end()).size() == 1);
    resident.push_back(ranks[0]);
  }
  CHECK(resident[0] == resident[1]);
  std::remove(path.c_str());
}

TEST_CASE("exact mode with experts split over the group: the bits of 1x1") {
  // 8 experts: static blocks over 4 ranks, and placed by the solver with
  // replicas of hot ones over 2. Each source's rows of an expert are one
  // product on one host, and its weight gradient reaches the fixed-point
  // sum as a piece from there.
  auto path = "/tmp/cmesh_exact_ep_" + std::to_string(getpid()) + ".toml";
  auto run = [&](const std::string& train_keys, const std::string& args) {
    {
      std::ofstream(path) << "[model]\nexperts = 8\n[train]\n" << train_keys;
    }
    auto r = train(args + " --config " + path + " --exact --steps 10 --log-every 5");
    if (args != layout(1, 1))
      CHECK(r.output.find("experts split over the") != std::string::npos);
    for (auto& w : rank_weights(r.output))
      CHECK(w == field(r.output, "weights"));
    return field(r.output, "weights");
  };
  const auto one = run("", layout(1, 1));
  const auto blocks = run("expert_placement = \"static\"\n", layout(1, 4));
  const auto replicated = run("expert_replicas = 2\n", layout(2, 2));
  std::remove(path.c_str());
  MESSAGE("1x1 " << one << ", 1x4 static " << blocks << ", 2x2 replicated " << replicated);
  REQUIRE(one.size() == 16);
  CHECK(blocks == one);
  CHECK(replicated == one);
}

TEST_CASE("resident experts: each rank holds only its experts") {
  // 16 experts over the 4 ranks of one group: a rank hosts 4 of them, and
  // holds their weights, gradient and optimizer state and no other's. The
  // bytes each rank holds for experts are measured (resident pages of the
  // model's buffers inside expert tensors, and the expert elements of its
  // state arrays) and printed with its done line.
  auto path = "/tmp/cmesh_resident_" + std::to_string(getpid()) + ".toml";
  auto run = [&](const std::string& experts, const std::string& args) {
    {
      std::ofstream(path) << "[model]\nexperts = 16\nexpert_ffn = 256\n[train]\nexperts = \""
                          << experts << "\"\n";
    }
    auto r = train(args + " --config " + path + " --steps 10 --log-every 5");
    std::vector<double> mib;
    for (auto& v : captures(r.output, "rank [0-9]+ done [^\n]*expert_mib=([0-9.]+)"))
      mib.push_back(std::stod(v));
    auto ranks = rank_weights(r.output);
    CHECK(std::set<std::string>(ranks.begin(), ranks.end()).size() == 1);
    return std::pair{mib, r.output};
  };
  const auto [one, one_out] = run("resident", layout(1, 1));
  const auto [four, four_out] = run("resident", layout(1, 4));
  const auto [replicated, replicated_out] = run("replicated", layout(1, 4));
  std::remove(path.c_str());
  REQUIRE(one.size() == 1);
  REQUIRE(four.size() == 4);
  REQUIRE(replicated.size() == 4);
  CHECK(four_out.find("holds 4 of 16 experts per layer") != std::string::npos);
  MESSAGE("MiB for experts per rank: resident 1x1 " << one[0] << ", resident 1x4 " << four[0]
          << " " << four[1] << " " << four[2] << " " << four[3] << ", replicated 1x4 "
          << replicated[0]);
  for (size_t r = 0; r < 4; ++r) {
    CHECK(four[r] <= 0.30 * one[0]);
    CHECK(four[r] < replicated[r]);
  }
  // The same training: only the order of float sums differs.
  CHECK(largest_difference(loss_curve(four_out), loss_curve(replicated_out)) < 0.02);
}

TEST_CASE("resident experts: exact runs end with the bits of 1x1, also after kills") {
  auto path = "/tmp/cmesh_resident_exact_" + std::to_string(getpid()) + ".toml";
  {
    std::ofstream(path) << "[model]\nexperts = 8\n[train]\nexperts = \"resident\"\n";
  }
  const std::string job = " --config " + path + " --exact --steps 30 --log-every 10";
  const auto one = field(train(layout(1, 1) + job).output, "weights");
  const auto four = field(train(layout(1, 4) + job).output, "weights");
  const auto two_by_two = field(train(layout(2, 2) + job).output, "weights");
  // A rank of each group killed in turn: its group is fenced, restarted,
  // and catches up its positions' states (a rank's own experts) from the
  // other group.
  auto killed = run_cmesh("launch " + layout(2, 2) + job
                            + " --restart-delay-ms 200 --chaos kill@8:3,kill@18:0",
                          {}, 600s);
  std::remove(path.c_str());
  INFO(killed.output);
  REQUIRE(killed.exit_code == 0);
  CHECK(killed.output.find("caught up") != std::string::npos);
  MESSAGE("exact, resident: 1x1 " << one << ", 1x4 " << four << ", 2x2 " << two_by_two
          << ", 2x2 with two kills " << field(killed.output, "weights"));
  REQUIRE(one.size() == 16);
  CHECK(four == one);
  CHECK(two_by_two == one);
  for (auto& w : rank_weights(killed.output))
    CHECK(w == one);
}

TEST_CASE("expert placement: balanced and replicated experts train like static blocks") {
  // 8 experts over the 2 ranks of each group. The rows each rank computes
  // are printed as "hosts" (max rank load / mean, over the step).
  auto path = "/tmp/cmesh_placement_" + std::to_string(getpid()) + ".toml";
  auto run = [&](const std::string& train_keys, const std::string& args) {
    {
      std::ofstream(path) << "[model]\nexperts = 8\n[train]\n" << train_keys;
    }
    return train(args + " --config " + path + " --steps 40 --log-every 5").output;
  };
  auto hosts = [](const std::string& out) {
    std::vector<double> h;
    for (auto& v : captures(out, "hosts ([0-9.]+)"))
      h.push_back(std::stod(v));
    return h;
  };
  const auto fixed = run("expert_placement = \"static\"\n", layout(1, 2));
  const auto balanced = run("expert_placement = \"balanced\"\n", layout(1, 2));
  const auto replicated = run("expert_replicas = 2\n", layout(2, 2));
  std::remove(path.c_str());
  auto hs = hosts(fixed), hb = hosts(balanced), hr = hosts(replicated);
  REQUIRE(hs.size() >= 8);
  REQUIRE(hb.size() == hs.size());
  REQUIRE(hr.size() == hs.size());
  double sum_s = 0, sum_b = 0;
  for (size_t i = 0; i < hs.size(); ++i) {
    sum_s += hs[i];
    sum_b += hb[i];
    CHECK(hb[i] <= 1.05);
    CHECK(hr[i] <= 1.05);
  }
  MESSAGE("host imbalance, mean over the printed steps: static " << sum_s / hs.size()
          << ", balanced " << sum_b / hb.size());
  CHECK(sum_b <= sum_s);
  // Where an expert runs changes sums' order only.
  CHECK(largest_difference(loss_curve(fixed), loss_curve(balanced)) < 0.02);
  CHECK(largest_difference(loss_curve(fixed), loss_curve(replicated)) < 0.02);
  auto ranks = rank_weights(replicated);
  CHECK(ranks.size() == 4);
  CHECK(std::set<std::string>(ranks.begin(), ranks.end()).size() == 1);
}

TEST_CASE("the device path: gradients summed by the device collectives give the host path's bits") {
  // --device emulated runs the device code path on the CPU, and the
  // gradient's sums on the device collectives (the host backend over the
  // emulated device's memory, where a GPU has NCCL): at 2x1 an all_reduce
  // over the groups; at 2x2 a reduce_scatter over the group in place, then
  // an all_reduce of the shard over its holders. Every element is a sum of
  // two (then of two sums of two), as on the host path
  // (train.gradient_collectives = "host"), so fp32 gives the same bits; at
  // 2x1 also the CPU model's (at 2x2 the CPU splits the experts over the
  // group, the device model does not). In bf16 the host path sums bf16
  // gradients and the device path fp32 ones: the loss curves agree closely.
  auto path = "/tmp/cmesh_devsum_" + std::to_string(getpid()) + ".toml";
  for (int S : {1, 2}) {
    for (const std::string precision : {"fp32", "bf16"}) {
      CAPTURE(S);
      CAPTURE(precision);
      std::map<std::string, std::string> weights;
      std::map<std::string, std::map<int, double>> curves;
      for (const std::string run : {"cpu", "device", "host"}) {
        CAPTURE(run);
        if (run == "cpu" && S > 1)
          continue;
        {
          // bf16: products rounded on the CPU too ("auto" rounds the
          // device's only), so the CPU run computes what the device does.
          std::ofstream(path) << (precision == "bf16" ? "[model]\nproducts = \"bf16\"\n" : "")
                              << "[train]\nprecision = \"" << precision
                              << "\"\nglobal_batch = 12\ngradient_collectives = \""
                              << (run == "host" ? "host" : "device") << "\"\n";
        }
        auto r = train(layout(2, S) + " --config " + path
                       + " --steps 30 --log-every 5 --device " + (run == "cpu" ? "cpu" : "emulated"));
        curves[run] = loss_curve(r.output);
        CHECK((r.output.find("gradients summed on the device") != std::string::npos)
              == (run == "device"));
        auto ranks = rank_weights(r.output);
        REQUIRE(ranks.size() == static_cast<size_t>(2 * S));
        CHECK(std::set<std::string>(ranks.begin(), ranks.end()).size() == 1);
        weights[run] = ranks[0];
      }
      if (S == 1)
        CHECK(weights["cpu"] == weights["host"]);
      if (precision == "fp32")
        CHECK(weights["device"] == weights["host"]);
      else
        CHECK(largest_difference(curves["device"], curves["host"]) < 0.02);
    }
  }
  std::remove(path.c_str());
}

TEST_CASE("--device cuda trains on GPUs, or says at once why it cannot") {
  // Two ranks (one GPU each, or both on one, each then an NCCL host of its
  // own); the gradient is summed over them by NCCL, the optimizer stays on
  // the host.
  auto r = run_cmesh("launch -n 2 --device cuda --steps 40 --log-every 10", {}, 600s);
  if (r.exit_code != 0) {
    INFO(r.output);
    MESSAGE("skipped the GPU run: " << r.output.substr(0, r.output.find('\n')));
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("--device cuda: ") != std::string::npos);
    CHECK((r.output.find("no CUDA device") != std::string::npos
           || r.output.find("built without CUDA") != std::string::npos));
    CHECK(r.took < 30s); // before any worker joined
    return;
  }
  INFO(r.output);
  auto gpu = loss_curve(r.output);
  auto cpu = loss_curve(train("-n 2 --steps 40 --log-every 10").output);
  const double worst = largest_difference(cpu, gpu);
  MESSAGE("--device cuda against the CPU: largest difference in loss " << worst << ", "
          << field(r.output, "tokens/s") << " tokens/s");
  CHECK(worst < 0.05); // cuBLAS and the GPU's exp/log round differently
  CHECK(r.output.find("gradients summed on the device") != std::string::npos);
  auto ranks = rank_weights(r.output);
  CHECK(std::set<std::string>(ranks.begin(), ranks.end()).size() == 1);
}

TEST_CASE("bad configs and layouts are clear errors") {
  auto path = "/tmp/cmesh_bad_config_" + std::to_string(getpid()) + ".toml";
  {
    std::ofstream(path) << "[model]\nexperts = 5\ntop_k = 7\n";
  }
  auto r = run_cmesh("launch -n 1 --config " + path);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("top_k") != std::string::npos);
  {
    std::ofstream(path) << "[train]\nlearning_rate = 1\n";
  }
  r = run_cmesh("launch -n 1 --config " + path);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("unknown key 'learning_rate'") != std::string::npos);
  std::remove(path.c_str());
  r = run_cmesh("launch -n 3 --replicas 2");
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("replica groups") != std::string::npos);
  // 4 experts (the default) cannot be split over a group of 3 ranks.
  r = run_cmesh("launch -n 3 --replicas 1");
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("does not divide over 3 ranks per group") != std::string::npos);
}
