#include "chaos/plan.hpp"

#include "core/hash.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <set>

namespace cmesh::chaos {

namespace {

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  for (;;) {
    auto pos = s.find(sep, start);
    out.push_back(s.substr(start, pos == std::string_view::npos ? pos : pos - start));
    if (pos == std::string_view::npos)
      return out;
    start = pos + 1;
  }
}

template <class T>
bool number(std::string_view s, T& out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc{} && p == s.data() + s.size() && !s.empty();
}

} // namespace

expected<std::vector<action>> parse_plan(std::string_view text, uint32_t world_size) {
  std::vector<action> plan;
  if (text.empty())
    return plan;
  for (auto item : split(text, ',')) {
    auto bad = [&](const std::string& why) {
      return make_error(errc::invalid_argument,
                        fmt::format("chaos action '{}': {} (forms: kill@STEP:RANK, "
                                    "kill@STEP:RANK? (survivable), stop@STEP:RANK:MS[?], "
                                    "hang@STEP:RANK[?], fault@STEP:RANK[:TIMES], flip@STEP:RANK, crash@STEP:RANK, "
                                    "crash-shadow@STEP:RANK, "
                                    "kill-source@STEP, kill-all@STEP, corrupt@STEP, kill-checkpointer@STEP)",
                                    item, why));
    };
    auto at = item.find('@');
    if (at == std::string_view::npos)
      return bad("no @STEP");
    auto verb = item.substr(0, at);
    auto args = split(item.substr(at + 1), ':');
    action a;
    if (!number(args[0], a.at_step))
      return bad("the step is not a number");
    // A trailing '?' on a kill, a stop or a hang: skipped when its
    // target's group is then the last live one.
    if ((verb == "kill" || verb == "stop" || verb == "hang") && args.back().ends_with('?')) {
      a.survivable = true;
      args.back().remove_suffix(1);
    }
    if (verb == "kill" || verb == "stop" || verb == "hang" || verb == "fault" || verb == "flip"
        || verb == "crash" || verb == "crash-shadow") {
      a.kind = verb == "kill"           ? action_kind::kill
               : verb == "stop"         ? action_kind::stop
               : verb == "hang"         ? action_kind::hang
               : verb == "flip"         ? action_kind::flip
               : verb == "crash"        ? action_kind::crash
               : verb == "crash-shadow" ? action_kind::crash_shadow
                                        : action_kind::fault;
      size_t want = a.kind == action_kind::stop ? 3 : 2;
      if (a.kind == action_kind::fault && args.size() == 3) {
        if (!number(args[2], a.times) || a.times < 1 || a.times > 100)
          return bad("the fault count is not a number from 1 to 100");
        want = 3;
      }
      if (args.size() != want)
        return bad(fmt::format("expected {} fields after @", want));
      if (!number(args[1], a.rank))
        return bad("the rank is not a number");
      if (a.rank >= world_size)
        return bad(fmt::format("rank {} is outside the {} workers", a.rank, world_size));
      if (a.kind == action_kind::stop && (!number(args[2], a.stop_ms) || a.stop_ms <= 0))
        return bad("the stop time is not a positive number of milliseconds");
    } else if (verb == "kill-source" || verb == "kill-all" || verb == "corrupt"
               || verb == "kill-checkpointer") {
      a.kind = verb == "kill-source" ? action_kind::kill_source
               : verb == "kill-all"  ? action_kind::kill_all
               : verb == "corrupt"   ? action_kind::corrupt
                                     : action_kind::kill_checkpointer;
      if (args.size() != 1)
        return bad(fmt::format("{} takes only a step", verb));
    } else {
      return bad("unknown action");
    }
    plan.push_back(a);
  }
  std::stable_sort(plan.begin(), plan.end(),
                   [](const action& x, const action& y) { return x.at_step < y.at_step; });
  return plan;
}

std::vector<action> random_plan(uint64_t seed, uint64_t first_step, uint64_t last_step,
                                uint32_t world_size, const random_counts& n) {
  std::vector<action> plan;
  if (last_step < first_step || world_size == 0)
    return plan;
  const uint64_t span = last_step - first_step + 1;
  uint64_t counter = 0;
  auto draw = [&] { return splitmix64(seed + 0x9e3779b97f4a7c15ull * ++counter); };
  std::set<uint64_t> taken;
  // `count` steps not taken yet (as many as are left), in the order drawn.
  auto steps = [&](size_t count) {
    count = std::min<uint64_t>(count, span - taken.size());
    std::set<uint64_t> mine;
    while (mine.size() < count) {
      auto s = first_step + draw() % span;
      if (!taken.count(s))
        mine.insert(s);
    }
    taken.insert(mine.begin(), mine.end());
    return mine;
  };
  auto rank = [&] { return static_cast<uint32_t>(draw() % world_size); };
  for (auto s : steps(n.kills))
    plan.push_back({action_kind::kill, s, rank(), 0, true});
  for (auto s : steps(n.faults))
    plan.push_back({action_kind::fault, s, rank(), 0, false});
  const auto lo = std::max<int64_t>(n.stop_min_ms, 1);
  const auto width = static_cast<uint64_t>(std::max(n.stop_max_ms, lo) - lo) + 1;
  for (auto s : steps(n.stops)) {
    auto r = rank();
    plan.push_back({action_kind::stop, s, r, lo + static_cast<int64_t>(draw() % width), true});
  }
  for (auto s : steps(n.hangs))
    plan.push_back({action_kind::hang, s, rank(), 0, true});
  std::stable_sort(plan.begin(), plan.end(),
                   [](const action& x, const action& y) { return x.at_step < y.at_step; });
  return plan;
}

std::string to_string(const std::vector<action>& plan) {
  std::string out;
  for (auto& a : plan) {
    if (!out.empty())
      out += ',';
    switch (a.kind) {
      case action_kind::kill:
        out += fmt::format("kill@{}:{}{}", a.at_step, a.rank, a.survivable ? "?" : "");
        break;
      case action_kind::stop:
        out += fmt::format("stop@{}:{}:{}{}", a.at_step, a.rank, a.stop_ms, a.survivable ? "?" : "");
        break;
      case action_kind::kill_source: out += fmt::format("kill-source@{}", a.at_step); break;
      case action_kind::kill_all: out += fmt::format("kill-all@{}", a.at_step); break;
      case action_kind::kill_checkpointer:
        out += fmt::format("kill-checkpointer@{}", a.at_step);
        break;
      case action_kind::corrupt: out += fmt::format("corrupt@{}", a.at_step); break;
      case action_kind::hang:
        out += fmt::format("hang@{}:{}{}", a.at_step, a.rank, a.survivable ? "?" : "");
        break;
      case action_kind::flip: out += fmt::format("flip@{}:{}", a.at_step, a.rank); break;
      case action_kind::crash: out += fmt::format("crash@{}:{}", a.at_step, a.rank); break;
      case action_kind::crash_shadow:
        out += fmt::format("crash-shadow@{}:{}", a.at_step, a.rank);
        break;
      case action_kind::fault:
        out += fmt::format("fault@{}:{}", a.at_step, a.rank);
        if (a.times != 1)
          out += fmt::format(":{}", a.times);
        break;
    }
  }
  return out;
}

} // namespace cmesh::chaos
