#include "recovery/verify.hpp"

#include "core/check.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>

namespace cmesh::recovery {

replica_verdict compare_replicas(std::span<const uint32_t> groups, size_t ranks_per_group,
                                 std::span<const uint64_t> hashes) {
  CMESH_CHECK(ranks_per_group >= 1);
  CMESH_CHECK(hashes.size() == groups.size() * ranks_per_group);
  replica_verdict v;
  const size_t n = groups.size();
  std::vector<std::string> parts;
  for (size_t p = 0; p < ranks_per_group; ++p) {
    std::map<uint64_t, size_t> votes;
    for (size_t i = 0; i < n; ++i)
      ++votes[hashes[i * ranks_per_group + p]];
    if (votes.size() <= 1)
      continue;
    v.agree = false;
    v.positions.push_back(static_cast<uint32_t>(p));
    auto top = std::max_element(votes.begin(), votes.end(),
                                [](auto& a, auto& b) { return a.second < b.second; });
    if (2 * top->second <= n) {
      v.no_majority = true;
      std::vector<std::string> each;
      for (size_t i = 0; i < n; ++i)
        each.push_back(fmt::format("g{} {:016x}", groups[i], hashes[i * ranks_per_group + p]));
      parts.push_back(fmt::format("shard {}: no majority ({})", p, fmt::join(each, ", ")));
      continue;
    }
    std::vector<uint32_t> off;
    for (size_t i = 0; i < n; ++i)
      if (hashes[i * ranks_per_group + p] != top->first) {
        off.push_back(groups[i]);
        v.minority.push_back(groups[i]);
      }
    std::sort(off.begin(), off.end());
    parts.push_back(fmt::format("shard {}: group{} {} differ{} from the {} of {} groups that "
                                "agree",
                                p, off.size() > 1 ? "s" : "", fmt::join(off, ","),
                                off.size() > 1 ? "" : "s", top->second, n));
  }
  std::sort(v.minority.begin(), v.minority.end());
  v.minority.erase(std::unique(v.minority.begin(), v.minority.end()), v.minority.end());
  if (v.no_majority)
    v.minority.clear(); // nothing to trust: nobody is the minority
  v.reason = fmt::format("{}", fmt::join(parts, "; "));
  return v;
}

std::string differing_segments(std::span<const std::string> names,
                               std::span<const uint64_t> mine, std::span<const uint64_t> theirs,
                               size_t limit) {
  CMESH_CHECK(names.size() == mine.size() && mine.size() == theirs.size());
  std::vector<std::string> out;
  size_t more = 0;
  for (size_t k = 0; k < names.size(); ++k) {
    if (mine[k] == theirs[k])
      continue;
    if (out.size() < limit)
      out.push_back(names[k]);
    else
      ++more;
  }
  std::string s = fmt::format("{}", fmt::join(out, ", "));
  if (more > 0)
    s += fmt::format(" and {} more", more);
  return s;
}

} // namespace cmesh::recovery
