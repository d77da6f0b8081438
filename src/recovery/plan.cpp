#include "recovery/plan.hpp"

#include <algorithm>

namespace cmesh::recovery {

expected<recovery_plan> plan_recovery(std::span<const group_id> healthy_in,
                                      std::span<const joiner_shards> joiners_in,
                                      uint32_t shard_count, uint64_t rotation) {
  if (shard_count == 0)
    return make_error(errc::invalid_argument, "shard_count must be > 0");
  std::vector<group_id> healthy(healthy_in.begin(), healthy_in.end());
  std::sort(healthy.begin(), healthy.end());
  healthy.erase(std::unique(healthy.begin(), healthy.end()), healthy.end());
  if (healthy.empty())
    return make_error(errc::invalid_argument, "no healthy group to copy shards from");

  std::vector<joiner_shards> joiners(joiners_in.begin(), joiners_in.end());
  std::sort(joiners.begin(), joiners.end(),
            [](const joiner_shards& a, const joiner_shards& b) { return a.group < b.group; });
  for (size_t i = 0; i < joiners.size(); ++i) {
    const auto g = joiners[i].group;
    if (i > 0 && joiners[i - 1].group == g)
      return make_error(errc::invalid_argument, "joiner group " + std::to_string(g) + " listed twice");
    if (std::binary_search(healthy.begin(), healthy.end(), g))
      return make_error(errc::invalid_argument,
                        "joiner group " + std::to_string(g) + " is also listed as a healthy source");
    auto& shards = joiners[i].shards;
    if (shards.empty()) {
      shards.resize(shard_count);
      for (uint32_t s = 0; s < shard_count; ++s)
        shards[s] = s;
    }
    std::sort(shards.begin(), shards.end());
    shards.erase(std::unique(shards.begin(), shards.end()), shards.end());
    if (shards.back() >= shard_count)
      return make_error(errc::invalid_argument,
                        "joiner group " + std::to_string(g) + ": shard " +
                            std::to_string(shards.back()) + " >= shard_count " +
                            std::to_string(shard_count));
  }

  recovery_plan plan;
  uint64_t next = rotation;
  for (const auto& j : joiners)
    for (auto s : j.shards)
      plan.sources.push_back({j.group, s, healthy[next++ % healthy.size()]});

  std::string js;
  for (const auto& j : joiners)
    js += (js.empty() ? "" : " ") + std::to_string(j.group);
  std::string hs;
  for (auto g : healthy)
    hs += (hs.empty() ? "" : " ") + std::to_string(g);
  plan.reason = std::to_string(plan.sources.size()) + " shard copies for joiner groups [" + js +
                "] round-robin over healthy groups [" + hs + "]";
  return plan;
}

expected<recovery_plan> plan_recovery(std::span<const group_id> healthy, const joiner_shards& joiner,
                                      uint32_t shard_count, uint64_t rotation) {
  return plan_recovery(healthy, std::span<const joiner_shards>(&joiner, 1), shard_count, rotation);
}

} // namespace cmesh::recovery
