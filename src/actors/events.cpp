#include "actors/events.hpp"

#include "core/env.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <chrono>
#include <cstring>

namespace cmesh::actors {

std::string json_quote(std::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20)
          out += fmt::format("\\u{:04x}", c);
        else
          out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

namespace {

struct value_text {
  std::string operator()(int64_t v) const { return std::to_string(v); }
  std::string operator()(uint64_t v) const { return std::to_string(v); }
  std::string operator()(double v) const { return fmt::format("{:.3f}", v); }
  std::string operator()(bool v) const { return v ? "true" : "false"; }
  std::string operator()(const std::string& v) const { return json_quote(v); }
  std::string operator()(const std::vector<uint32_t>& v) const {
    return fmt::format("[{}]", fmt::join(v, ","));
  }
};

} // namespace

std::string format_event(std::string_view event, const event_fields& fields, double ts,
                         double mono_ms) {
  std::string line = fmt::format("{{\"ts\":{:.3f},\"mono_ms\":{:.3f},\"event\":{}", ts, mono_ms,
                                 json_quote(event));
  for (const auto& [k, v] : fields)
    line += "," + json_quote(k) + ":" + std::visit(value_text{}, v);
  return line + "}";
}

expected<std::shared_ptr<event_log>> event_log::open(const std::string& path) {
  auto log = std::make_shared<event_log>();
  if (path == "-") {
    log->out_ = stdout;
  } else if (!path.empty()) {
    log->out_ = std::fopen(path.c_str(), "a");
    if (!log->out_)
      return make_error(errc::invalid_argument,
                        fmt::format("cannot open the event log {}: {}", path, std::strerror(errno)));
    log->owned_ = true;
  }
  return log;
}

event_log::~event_log() {
  if (owned_ && out_)
    std::fclose(out_);
}

void event_log::emit(std::string_view event, const event_fields& fields) {
  if (!out_)
    return;
  auto wall = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch());
  auto line = format_event(event, fields, wall.count(), static_cast<double>(mono_ns()) / 1e6);
  std::lock_guard lk(mu_);
  std::fputs(line.c_str(), out_);
  std::fputc('\n', out_);
  std::fflush(out_);
}

} // namespace cmesh::actors
