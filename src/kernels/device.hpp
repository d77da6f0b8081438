// What accelerator support this build has and what the machine offers:
// CUDA runtime and driver, NCCL, and the visible devices. Never aborts: a
// machine without a GPU or driver reports zero devices and says why in `note`.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace cmesh::kernels {

struct device_info {
  int index = 0;
  std::string name;
  std::size_t memory_bytes = 0;
  int cc_major = 0, cc_minor = 0; // compute capability
};

struct accelerator_report {
  bool cuda_compiled = false;   // built with CMESH_HAVE_CUDA
  bool nccl_compiled = false;   // built with CMESH_HAVE_NCCL
  int cuda_runtime_version = 0; // 1000 * major + 10 * minor (13000 = 13.0); 0 without CUDA
  int cuda_driver_version = 0;  // same encoding; 0 when no driver is installed
  int nccl_version = 0;         // NCCL_VERSION_CODE style (22809 = 2.28.9); 0 without NCCL
  bool nccl_revoke = false;     // the loaded NCCL has ncclCommRevoke (2.28.7+): a failure keeps
                                // the communicator shrinkable; without it survivors re-initialise
  std::vector<device_info> devices;
  std::string note; // why there are no devices, or what went wrong; empty when all is well
};

/// Asks the CUDA runtime (and NCCL) on builds that have them; on builds
/// without CUDA returns cuda_compiled=false and note "built without CUDA".
accelerator_report query_accelerators();

/// One paragraph for logs and `cmesh` diagnostics, e.g.
/// "CUDA 13.0 (driver: none), NCCL 2.28.9, 0 devices: no CUDA-capable device is detected".
std::string describe(const accelerator_report& r);

} // namespace cmesh::kernels
