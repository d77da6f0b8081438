#include "kernels/device.hpp"

#include <doctest/doctest.h>

#include <string>

namespace k = cmesh::kernels;

TEST_CASE("query_accelerators is consistent with the build") {
  const auto r = k::query_accelerators();
  const std::string text = k::describe(r);
  MESSAGE("accelerators: " << text);
  CHECK(!text.empty());

#ifdef CMESH_HAVE_CUDA
  CHECK(r.cuda_compiled);
  CHECK(r.cuda_runtime_version > 0);
#else
  CHECK_FALSE(r.cuda_compiled);
  CHECK(r.note == "built without CUDA");
  CHECK(r.cuda_runtime_version == 0);
  CHECK(r.devices.empty());
#endif

#ifdef CMESH_HAVE_NCCL
  CHECK(r.nccl_compiled);
  CHECK(r.nccl_version > 0);
  // ncclCommRevoke came with 2.28.7: the lookup agrees with the version.
  CHECK(r.nccl_revoke == (r.nccl_version >= 22807));
#else
  CHECK_FALSE(r.nccl_compiled);
  CHECK(r.nccl_version == 0);
#endif

  if (r.devices.empty()) {
    CHECK_FALSE(r.note.empty());
    CHECK(text.find("0 devices") != std::string::npos);
    CHECK(text.find(r.note) != std::string::npos);
  }
  for (size_t i = 0; i < r.devices.size(); ++i) {
    const auto& d = r.devices[i];
    CAPTURE(i);
    CHECK(d.index == static_cast<int>(i));
    CHECK(!d.name.empty());
    CHECK(d.memory_bytes > 0);
    CHECK(d.cc_major >= 1);
  }
}

TEST_CASE("query_accelerators can be called again") {
  // A failed device query must not poison later ones.
  const auto a = k::query_accelerators();
  const auto b = k::query_accelerators();
  CHECK(a.devices.size() == b.devices.size());
  CHECK(a.cuda_driver_version == b.cuda_driver_version);
}

TEST_CASE("describe formats a report") {
  k::accelerator_report r;
  r.cuda_compiled = true;
  r.nccl_compiled = true;
  r.cuda_runtime_version = 13000;
  r.cuda_driver_version = 0;
  r.nccl_version = 22809;
  r.nccl_revoke = true;
  r.note = "no CUDA-capable device is detected";
  CHECK(k::describe(r) ==
        "CUDA 13.0 (driver: none), NCCL 2.28.9, 0 devices: no CUDA-capable device is detected");

  r.cuda_driver_version = 13010;
  r.note.clear();
  r.devices.push_back(k::device_info{0, "NVIDIA H200", size_t{144} << 30, 9, 0});
  r.devices.push_back(k::device_info{1, "NVIDIA H200", size_t{144} << 30, 9, 0});
  CHECK(k::describe(r) == "CUDA 13.0 (driver: 13.1), NCCL 2.28.9, 2 devices: "
                          "[0] NVIDIA H200 (144.0 GiB, sm_90); [1] NVIDIA H200 (144.0 GiB, sm_90)");

  r.nccl_version = 22803;
  r.nccl_revoke = false;
  r.devices.resize(1);
  CHECK(k::describe(r) == "CUDA 13.0 (driver: 13.1), NCCL 2.28.3 (no ncclCommRevoke), 1 device: "
                          "[0] NVIDIA H200 (144.0 GiB, sm_90)");

  k::accelerator_report none;
  none.note = "built without CUDA";
  CHECK(k::describe(none) ==
        "CUDA: not compiled in, NCCL: not compiled in, 0 devices: built without CUDA");
}
