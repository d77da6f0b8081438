#include "core/error.hpp"

#include <caf/message.hpp>

namespace cmesh {

std::string_view to_string(errc x) {
  switch (x) {
    case errc::ok: return "ok";
    case errc::peer_lost: return "peer_lost";
    case errc::peer_unresponsive: return "peer_unresponsive";
    case errc::timeout: return "timeout";
    case errc::aborted: return "aborted";
    case errc::malformed_frame: return "malformed_frame";
    case errc::bad_version: return "bad_version";
    case errc::unknown_kind: return "unknown_kind";
    case errc::unknown_destination: return "unknown_destination";
    case errc::queue_full: return "queue_full";
    case errc::unreachable: return "unreachable";
    case errc::closed: return "closed";
    case errc::invalid_argument: return "invalid_argument";
    case errc::transport_failure: return "transport_failure";
    case errc::stale_epoch: return "stale_epoch";
    case errc::poisoned: return "poisoned";
    case errc::overflow: return "overflow";
    case errc::fenced: return "fenced";
    case errc::unrecoverable: return "unrecoverable";
    case errc::corrupt: return "corrupt";
    case errc::crashed: return "crashed";
  }
  return "unknown_error";
}

caf::error make_error(errc x) {
  return caf::error(static_cast<uint8_t>(x), error_category);
}

caf::error make_error(errc x, std::string context) {
  return caf::error(static_cast<uint8_t>(x), error_category,
                    caf::make_message(std::move(context)));
}

errc code_of(const caf::error& e) {
  if (!e || e.category() != error_category)
    return errc::ok;
  return static_cast<errc>(e.code());
}

std::string describe(const caf::error& e) {
  if (!e)
    return "ok";
  std::string out;
  if (e.category() == error_category)
    out = std::string(to_string(static_cast<errc>(e.code())));
  else
    out = "error " + std::to_string(e.code()) + " in category "
          + caf::to_string(e.category());
  const auto& ctx = e.context();
  if (ctx.size() == 1 && ctx.match_element<std::string>(0))
    out += ": " + ctx.get_as<std::string>(0);
  return out;
}

} // namespace cmesh
