// Small deterministic hashing shared by the data loader, initialisation and
// the tests' input generators.
#pragma once

#include <cstdint>

namespace cmesh {

/// The splitmix64 finaliser: a well-mixed 64-bit value from any 64-bit input.
constexpr uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

} // namespace cmesh
