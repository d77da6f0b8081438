#include "core/job_config.hpp"

#include <map>
#include <set>

#include <xxhash.h>

namespace cmesh {

std::string config_text(const config_list& c) {
  std::string out;
  for (const auto& [key, value] : c)
    out += key + " = " + value + "\n";
  return out;
}

uint64_t config_digest(const config_list& c) {
  const auto text = config_text(c);
  return XXH64(text.data(), text.size(), 0);
}

std::vector<std::string> config_differences(const config_list& job, const config_list& worker) {
  // First value of each key (emplace keeps the first).
  std::map<std::string, std::string> theirs;
  for (const auto& [key, value] : worker)
    theirs.emplace(key, value);
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (const auto& [key, value] : job) {
    if (!seen.insert(key).second)
      continue;
    auto it = theirs.find(key);
    if (it == theirs.end())
      out.push_back(key + " missing (the job's: " + value + ")");
    else if (it->second != value)
      out.push_back(key + " = " + it->second + " (the job's: " + value + ")");
  }
  for (const auto& [key, value] : worker)
    if (seen.insert(key).second)
      out.push_back(key + " = " + value + " (the job has no such key)");
  return out;
}

} // namespace cmesh
