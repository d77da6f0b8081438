// For tests that need a GPU: they skip, saying why, where there is none.
#pragma once

#include "kernels/device.hpp"

#include <doctest/doctest.h>

#include <string>

namespace cmesh::kernels {

/// Empty when a CUDA device is there; otherwise why not.
inline const std::string& no_device_reason() {
  static const std::string why = [] {
    auto r = query_accelerators();
    if (!r.devices.empty())
      return std::string();
    return r.note.empty() ? std::string("no device") : r.note;
  }();
  return why;
}

} // namespace cmesh::kernels

/// Returns from the test case with a message when there is no CUDA device.
#define CMESH_SKIP_WITHOUT_DEVICE()                                             \
  do {                                                                          \
    if (const auto& why = ::cmesh::kernels::no_device_reason(); !why.empty()) { \
      MESSAGE("skipped: no CUDA device: " << why);                              \
      return;                                                                   \
    }                                                                           \
  } while (false)
