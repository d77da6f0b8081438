// The cmesh command as a user runs it: real processes, exit codes, output.
#include "node_harness.hpp"


using namespace cmesh;
using namespace cmesh::testing;
using namespace std::chrono_literals;

namespace {

size_t count_lines(const std::string& s) {
  return static_cast<size_t>(std::count(s.begin(), s.end(), '\n'));
}

} // namespace

TEST_CASE("cmesh --help and version") {
  auto h = run_cmesh("--help");
  CHECK(h.exit_code == 0);
  CHECK(h.output.find("launch") != std::string::npos);
  CHECK(h.output.find("coordinator") != std::string::npos);
  auto v = run_cmesh("version");
  CHECK(v.exit_code == 0);
  CHECK(v.output.find("cmesh 0.") != std::string::npos);
  CHECK(v.output.find("UCX") != std::string::npos);
}

TEST_CASE("a bad flag is a one-line error and exit 2") {
  auto r = run_cmesh("launch -n 2 --job ring --no-such-flag");
  CHECK(r.exit_code == 2);
  CHECK(count_lines(r.output) == 1);
  CHECK(r.output.find("error") != std::string::npos);
  auto r2 = run_cmesh("launch -n 0");
  CHECK(r2.exit_code == 2);
  CHECK(count_lines(r2.output) == 1);
  auto r3 = run_cmesh("frobnicate");
  CHECK(r3.exit_code == 2);
}

TEST_CASE("a worker that cannot reach its coordinator fails within its timeout") {
  auto r = run_cmesh("worker", {{"CMESH_COORDINATOR", "127.0.0.1:1"},
                                {"CMESH_CONNECT_TIMEOUT_MS", "1000"},
                                {"CMESH_RANK", "0"},
                                {"CMESH_WORLD_SIZE", "1"}},
                     30s);
  CHECK(r.exit_code == 3);
  CHECK(count_lines(r.output) == 1);
  CHECK(r.output.find("cannot reach coordinator at 127.0.0.1:1") != std::string::npos);
  CHECK(r.took < 10s);

  auto missing = run_cmesh("worker", {{"CMESH_COORDINATOR", ""}, {"CMESH_RANK", "0"}, {"CMESH_WORLD_SIZE", "1"}});
  CHECK(missing.exit_code == 2);
  CHECK(missing.output.find("CMESH_COORDINATOR") != std::string::npos);

  auto bad = run_cmesh("worker", {{"CMESH_COORDINATOR", "nonsense"}, {"CMESH_RANK", "0"}, {"CMESH_WORLD_SIZE", "1"}});
  CHECK(bad.exit_code == 2);
  CHECK(count_lines(bad.output) == 1);
}

TEST_CASE("cmesh launch -n 4 passes the token and exits 0") {
  auto r = run_cmesh("launch -n 4 --job ring --laps 5");
  INFO(r.output);
  CHECK(r.exit_code == 0);
  for (int rank = 0; rank < 4; ++rank)
    CHECK(r.output.find("rank " + std::to_string(rank) + " done") != std::string::npos);
  CHECK(r.output.find("4 workers done") != std::string::npos);
  CHECK(r.output.find("hops=20") != std::string::npos); // 5 laps of 4 hops, seen by rank 0
}

TEST_CASE("cmesh coordinator and workers started by hand, as under mpirun or srun") {
  // Workers get their rank the way OpenMPI gives it.
  coordinator_options o;
  auto port_probe = coordinator(o);
  REQUIRE_FALSE(port_probe.start());
  auto port = port_probe.port();
  port_probe.stop(); // free the port for the real coordinator
  auto coord = child_process::spawn(bin_dir() + "/cmesh",
                                    {"coordinator", "--job", "ring", "--port", std::to_string(port), "-n", "2"},
                                    {});
  std::vector<child_process> workers;
  for (int r = 0; r < 2; ++r)
    workers.push_back(child_process::spawn(
      bin_dir() + "/cmesh", {"worker", "--job", "ring", "--laps", "2"},
      {{"CMESH_COORDINATOR", "127.0.0.1:" + std::to_string(port)},
       {"OMPI_COMM_WORLD_RANK", std::to_string(r)},
       {"OMPI_COMM_WORLD_SIZE", "2"},
       {"CMESH_RANK", ""},
       {"CMESH_WORLD_SIZE", ""}}));
  auto st = coord.wait(120s);
  REQUIRE(st);
  CHECK(describe_wait_status(*st) == "exit 0");
  for (auto& w : workers) {
    auto ws = w.wait(30s);
    REQUIRE(ws);
    CHECK(describe_wait_status(*ws) == "exit 0");
  }
}
