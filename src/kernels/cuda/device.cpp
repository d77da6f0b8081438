// query_accelerators() for builds with CUDA (compiled only when CMESH_HAVE_CUDA).
// No call here may abort: a machine without a driver or a GPU is normal in CI.
#include "kernels/device.hpp"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <string>
#ifdef CMESH_HAVE_NCCL
#include <nccl.h>
#endif

namespace cmesh::kernels {

namespace {

void add_note(accelerator_report& r, const std::string& text) {
  if (!r.note.empty())
    r.note += "; ";
  r.note += text;
}

} // namespace

accelerator_report query_accelerators() {
  accelerator_report r;
  r.cuda_compiled = true;
  if (cudaRuntimeGetVersion(&r.cuda_runtime_version) != cudaSuccess)
    r.cuda_runtime_version = 0;
  if (cudaDriverGetVersion(&r.cuda_driver_version) != cudaSuccess)
    r.cuda_driver_version = 0; // 0 also means "no driver installed"

  int count = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&count); err != cudaSuccess) {
    // With no driver at all the runtime says "driver version is insufficient";
    // say plainly that there is none.
    add_note(r, std::string(r.cuda_driver_version == 0 ? "no CUDA driver installed; " : "") +
                  "cudaGetDeviceCount: " + cudaGetErrorString(err));
    count = 0;
    (void)cudaGetLastError(); // clear it so that later calls do not report it again
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (const cudaError_t err = cudaGetDeviceProperties(&prop, i); err != cudaSuccess) {
      add_note(r, "device " + std::to_string(i) + ": " + cudaGetErrorString(err));
      (void)cudaGetLastError();
      continue;
    }
    r.devices.push_back(device_info{i, prop.name, prop.totalGlobalMem, prop.major, prop.minor});
  }
  if (r.devices.empty() && r.note.empty())
    r.note = "no CUDA device is visible";

#ifdef CMESH_HAVE_NCCL
  r.nccl_compiled = true;
  int v = 0;
  if (const ncclResult_t res = ncclGetVersion(&v); res == ncclSuccess)
    r.nccl_version = v;
  else
    add_note(r, std::string("ncclGetVersion: ") + ncclGetErrorString(res));
  // The library loaded may be older than the header (see nccl_communicator.cpp).
  r.nccl_revoke = ::dlsym(RTLD_DEFAULT, "ncclCommRevoke") != nullptr;
#endif
  return r;
}

} // namespace cmesh::kernels
