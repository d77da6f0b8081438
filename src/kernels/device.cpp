#include "kernels/device.hpp"

#include <fmt/format.h>

namespace cmesh::kernels {

namespace {

std::string cuda_version_text(int v) {
  return fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
}

std::string nccl_version_text(int v) {
  // NCCL >= 2.9 encodes major*10000 + minor*100 + patch; older ones major*1000 + minor*100 + patch.
  if (v >= 10000)
    return fmt::format("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100);
  return fmt::format("{}.{}.{}", v / 1000, (v % 1000) / 100, v % 100);
}

} // namespace

#ifndef CMESH_HAVE_CUDA
// With CUDA, kernels/cuda/device.cpp defines this.
accelerator_report query_accelerators() {
  accelerator_report r;
  r.note = "built without CUDA";
  return r;
}
#endif

std::string describe(const accelerator_report& r) {
  std::string out;
  if (r.cuda_compiled) {
    out = fmt::format("CUDA {} (driver: {})", cuda_version_text(r.cuda_runtime_version),
                      r.cuda_driver_version > 0 ? cuda_version_text(r.cuda_driver_version)
                                                : std::string("none"));
  } else {
    out = "CUDA: not compiled in";
  }
  if (r.nccl_compiled)
    out += r.nccl_version > 0
             ? fmt::format(", NCCL {}{}", nccl_version_text(r.nccl_version),
                           r.nccl_revoke ? "" : " (no ncclCommRevoke)")
             : std::string(", NCCL: unknown version");
  else
    out += ", NCCL: not compiled in";
  out += fmt::format(", {} device{}", r.devices.size(), r.devices.size() == 1 ? "" : "s");
  for (size_t i = 0; i < r.devices.size(); ++i) {
    const auto& d = r.devices[i];
    out += fmt::format("{} [{}] {} ({:.1f} GiB, sm_{}{})", i == 0 ? ":" : ";", d.index, d.name,
                       static_cast<double>(d.memory_bytes) / (1024.0 * 1024.0 * 1024.0),
                       d.cc_major, d.cc_minor);
  }
  if (!r.note.empty())
    out += (r.devices.empty() ? ": " : "; note: ") + r.note;
  return out;
}

} // namespace cmesh::kernels
