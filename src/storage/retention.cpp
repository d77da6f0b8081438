#include "storage/retention.hpp"

#include <algorithm>

namespace cmesh::storage {

std::vector<uint64_t> retention_plan(std::span<const uint64_t> steps, size_t keep_last,
                                     uint64_t keep_every) {
  std::vector<uint64_t> sorted(steps.begin(), steps.end());
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  // The newest is never deleted, whatever the caller asked.
  const size_t keep = std::max<size_t>(keep_last, 1);
  const size_t older = sorted.size() > keep ? sorted.size() - keep : 0;
  std::vector<uint64_t> out;
  for (size_t i = 0; i < older; ++i)
    if (keep_every == 0 || sorted[i] % keep_every != 0)
      out.push_back(sorted[i]);
  return out;
}

} // namespace cmesh::storage
