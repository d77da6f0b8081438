// Who a replica group is: its id and the incarnation it runs as.
//
// A replica group that restarts (new processes, or a spare node taking its
// place) registers with a NEW incarnation id, higher than the old one. To
// the coordinator it is a new member: the old incarnation is out for good,
// and the new one joins like any other group (after catching up).
#pragma once

#include <compare>
#include <cstdint>
#include <string>
#include <vector>

namespace cmesh::recovery {

using group_id = uint32_t;
using incarnation_id = uint64_t;

/// One incarnation of one replica group.
struct member {
  group_id group = 0;
  incarnation_id incarnation = 0;

  auto operator<=>(const member&) const = default;
};

/// "g2#5": group 2, incarnation 5.
inline std::string to_string(const member& m) {
  return "g" + std::to_string(m.group) + "#" + std::to_string(m.incarnation);
}

/// "[g0#1 g2#5]".
inline std::string to_string(const std::vector<member>& ms) {
  std::string out = "[";
  for (size_t i = 0; i < ms.size(); ++i) {
    if (i > 0)
      out += ' ';
    out += to_string(ms[i]);
  }
  return out + "]";
}

} // namespace cmesh::recovery
