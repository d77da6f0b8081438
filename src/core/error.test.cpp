#include "core/env.hpp"
#include "core/error.hpp"

#include <doctest/doctest.h>

#include <cstdlib>

using namespace cmesh;

TEST_CASE("errors carry their code and context") {
  auto e = make_error(errc::peer_lost, "rank 3");
  CHECK(code_of(e) == errc::peer_lost);
  CHECK(describe(e) == "peer_lost: rank 3");
  CHECK(code_of(caf::error{}) == errc::ok);
  CHECK(describe(make_error(errc::timeout)) == "timeout");
}

TEST_CASE("launch environment: CMESH_* wins, then OpenMPI, then Slurm") {
  for (auto* v : {"CMESH_RANK", "CMESH_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                  "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "CMESH_LOCAL_RANK",
                  "OMPI_COMM_WORLD_LOCAL_RANK"})
    unsetenv(v);
  std::string err;
  auto d = read_launch_env(err);
  CHECK(err.empty());
  CHECK(d.source == "default");
  CHECK(d.world_size == 1);

  setenv("SLURM_PROCID", "2", 1);
  setenv("SLURM_NTASKS", "4", 1);
  setenv("SLURM_LOCALID", "0", 1);
  auto s = read_launch_env(err);
  CHECK(err.empty());
  CHECK(s.source == "slurm");
  CHECK(s.rank == 2);
  CHECK(s.local_rank == 0);

  setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "3", 1);
  CHECK(read_launch_env(err).source == "openmpi");

  setenv("CMESH_RANK", "5", 1);
  setenv("CMESH_WORLD_SIZE", "4", 1);
  auto bad = read_launch_env(err);
  CHECK(bad.source == "cmesh");
  CHECK(err.find("outside world size") != std::string::npos);

  err.clear();
  setenv("CMESH_RANK", "x1", 1);
  read_launch_env(err);
  CHECK(err.find("not an integer") != std::string::npos);
  for (auto* v : {"CMESH_RANK", "CMESH_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                  "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"})
    unsetenv(v);
}
