// One job, one configuration: `cmesh coordinator` and `cmesh worker`s
// started by hand (as under mpirun or srun), one worker with a config that
// differs from the job's. It must be refused at registration, saying which
// keys differ, and the job must go on with a correct worker for its rank.
#include "node_harness.hpp"

#include <fstream>
#include <sstream>

using namespace cmesh;
using namespace cmesh::testing;
using namespace std::chrono_literals;

namespace {


/// The first line of `text` that holds `needle` ("" when none does).
std::string line_with(const std::string& text, const std::string& needle) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (line.find(needle) != std::string::npos)
      return line;
  return {};
}

/// Exit code of a child, waiting up to `timeout` (-1: still running).
int exit_code(child_process& c, std::chrono::milliseconds timeout) {
  auto st = c.wait(timeout);
  return st ? exit_code_of(*st) : -1;
}

struct mismatch {
  std::string toml;     // rank 1's config file
  std::string key;      // the key the refusal must name ...
  std::string worker;   // ... with rank 1's value
  std::string job;      // ... and the job's
};

} // namespace

TEST_CASE("a worker whose configuration is not the job's is refused; a correct one finishes the job") {
  for (const auto& m : {mismatch{"[train]\nlr = 0.01\n", "train.lr", "0.01", "0.003"},
                        mismatch{"[model]\nexperts = 8\n", "model.experts", "8", "4"}}) {
    CAPTURE(m.key);
    const auto base = "/tmp/cmesh_job_config_" + std::to_string(getpid());
    const auto port = std::to_string(free_port());
    {
      std::ofstream(base + ".toml") << m.toml;
    }
    const std::string job = "--steps 4 --log-every 2";
    auto env = [&](int rank) {
      return std::vector<std::pair<std::string, std::string>>{
        {"CMESH_COORDINATOR", "127.0.0.1:" + port},
        {"CMESH_RANK", std::to_string(rank)},
        {"CMESH_WORLD_SIZE", "2"}};
    };
    // The coordinator is given the job's flags: its configuration is the job's.
    auto coord = spawn_cmesh("coordinator --port " + port + " -n 2 " + job, base + ".c");
    auto w0 = spawn_cmesh("worker " + job, base + ".w0", env(0));
    auto bad = spawn_cmesh("worker " + job + " --config " + base + ".toml", base + ".w1", env(1));
    CHECK(exit_code(bad, 60s) == 2); // a usage error
    const auto err = line_with(slurp(base + ".w1"), "cmesh: error:");
    INFO("refused worker: " << slurp(base + ".w1"));
    // The whole reason, on one line.
    CHECK(err.find("configuration mismatch with the job") != std::string::npos);
    CHECK(err.find(m.key + " = " + m.worker + " (the job's: " + m.job + ")") != std::string::npos);

    // The job waited for rank 1; a correct worker for it finishes the job.
    auto good = spawn_cmesh("worker " + job, base + ".w1b", env(1));
    CHECK(exit_code(coord, 120s) == 0);
    CHECK(exit_code(w0, 30s) == 0);
    CHECK(exit_code(good, 30s) == 0);
    const auto out = slurp(base + ".c");
    INFO("coordinator: " << out);
    CHECK(line_with(out, "rejected registration").find(m.key) != std::string::npos);
    CHECK(out.find("all 2 workers done") != std::string::npos);
    for (auto suffix : {".toml", ".c", ".w0", ".w1", ".w1b"})
      std::remove((base + suffix).c_str());
  }
}

TEST_CASE("cmesh launch ends the job on a worker's usage error instead of restarting it") {
  // The workers read this at join (the launcher does not): each exits 2.
  auto r = run_cmesh("launch -n 2 --steps 4 --restart-delay-ms 100",
                     {{"CMESH_REGISTER_TIMEOUT_MS", "soon"}}, 120s);
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("CMESH_REGISTER_TIMEOUT_MS") != std::string::npos);
  CHECK(r.output.find("ended with a usage error (exit 2") != std::string::npos);
  CHECK(r.output.find("restarting worker") == std::string::npos);
}
