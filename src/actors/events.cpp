#include "actors/events.hpp"

#include "core/env.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
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

expected<std::shared_ptr<event_log>> event_log::open(const std::string& path,
                                                     size_t max_queued) {
  if (path == "-")
    return std::make_shared<event_log>(stdout, false, stdout, max_queued);
  if (path.empty())
    return std::make_shared<event_log>(nullptr, false, stdout, max_queued);
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (!f)
    return make_error(errc::invalid_argument,
                      fmt::format("cannot open the event log {}: {}", path, std::strerror(errno)));
  return std::make_shared<event_log>(f, true, stdout, max_queued);
}

std::shared_ptr<event_log> event_log::over(std::FILE* events, std::FILE* text,
                                           size_t max_queued) {
  return std::make_shared<event_log>(events, false, text, max_queued);
}

event_log::event_log(std::FILE* events, bool owned, std::FILE* text, size_t max_queued)
    : events_(events), owned_(owned), text_(text), max_queued_(std::max<size_t>(max_queued, 1)) {
  writer_ = std::thread([this] { write_loop(); });
}

event_log::~event_log() {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  writer_.join();
  if (owned_ && events_)
    std::fclose(events_);
}

void event_log::enqueue(std::FILE* to, std::string text) {
  {
    std::lock_guard lk(mu_);
    if (queue_.size() >= max_queued_) {
      ++dropped_;
      return;
    }
    queue_.push_back({to, std::move(text)});
    ++queued_;
  }
  wake_.notify_one();
}

void event_log::emit(std::string_view event, const event_fields& fields) {
  if (!events_)
    return;
  auto wall = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch());
  enqueue(events_, format_event(event, fields, wall.count(), static_cast<double>(mono_ns()) / 1e6));
}

void event_log::print(std::string line) {
  if (text_)
    enqueue(text_, std::move(line));
}

void event_log::note(std::string line) {
  enqueue(nullptr, std::move(line));
}

bool event_log::flush(std::chrono::milliseconds timeout) {
  std::unique_lock lk(mu_);
  auto target = queued_;
  return written_cv_.wait_for(lk, timeout, [&] { return written_ >= target; });
}

uint64_t event_log::dropped() const {
  std::lock_guard lk(mu_);
  return dropped_;
}

void event_log::write_loop() {
  std::unique_lock lk(mu_);
  for (;;) {
    wake_.wait(lk, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty() && stopping_)
      return;
    std::deque<line> batch;
    batch.swap(queue_);
    uint64_t lost = dropped_ - dropped_told_;
    dropped_told_ = dropped_;
    lk.unlock();
    std::FILE* touched[2] = {nullptr, nullptr};
    auto put = [&](std::FILE* to, const std::string& text) {
      if (!to)
        return spdlog::info("{}", text);
      std::fputs(text.c_str(), to);
      std::fputc('\n', to);
      if (touched[0] != to && touched[1] != to)
        (touched[0] ? touched[1] : touched[0]) = to;
    };
    for (auto& l : batch)
      put(l.to, l.text);
    if (lost) {
      auto wall =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch());
      if (events_)
        put(events_, format_event("events_dropped", {{"count", lost}}, wall.count(),
                                  static_cast<double>(mono_ns()) / 1e6));
      if (text_ && text_ != events_)
        put(text_, fmt::format("cmesh: {} log lines dropped (the writer fell behind)", lost));
    }
    for (auto* f : touched)
      if (f)
        std::fflush(f);
    lk.lock();
    written_ += batch.size();
    written_cv_.notify_all();
  }
}

} // namespace cmesh::actors
