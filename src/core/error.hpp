// Recoverable failures are values: a cmesh::errc inside a caf::error, carried
// by caf::expected<T>. The numbers cross the wire (frames, down reasons), so
// never renumber an existing code.
#pragma once

#include <caf/atom.hpp>
#include <caf/error.hpp>
#include <caf/expected.hpp>
#include <caf/make_message.hpp>

#include <cstdint>
#include <string>
#include <string_view>

namespace cmesh {

enum class errc : uint8_t {
  ok = 0,
  peer_lost = 1,          // the peer process died: its endpoint failed
  peer_unresponsive = 2,  // the peer stopped answering heartbeats (hang, SIGSTOP)
  timeout = 3,            // an operation ran past its deadline
  aborted = 4,            // an operation was aborted from another thread or actor
  malformed_frame = 5,    // bad magic, wrong length, undecodable body
  bad_version = 6,        // a frame of a wire version we do not speak
  unknown_kind = 7,       // a frame kind missing from the registry
  unknown_destination = 8,// no local actor of that name
  queue_full = 9,         // a bounded queue refused an item
  unreachable = 10,       // a coordinator or peer that cannot be reached
  closed = 11,            // the transport or connection is shut down
  invalid_argument = 12,  // bad input from a caller or user
  transport_failure = 13, // a UCX call failed
  stale_epoch = 14,       // a message from an epoch that is over
  poisoned = 15,          // a communicator after an error, until rebuilt
  overflow = 16,          // an exact-mode sum that would not fit
  fenced = 17,            // this incarnation was left out of the epoch: it must restart
  unrecoverable = 18,     // no epoch can form: a restart from a checkpoint is needed
  corrupt = 19,           // stored data fails its checks: a checksum, a size, a manifest
  crashed = 20,           // a local actor died of an unexpected error (an exception: a bug)
};

/// CAF error category of every cmesh error.
constexpr caf::atom_value error_category = caf::atom("cmesh");

std::string_view to_string(errc x);

caf::error make_error(errc x);
caf::error make_error(errc x, std::string context);

/// The cmesh code of an error, or nullopt-like errc::ok when it is not ours.
errc code_of(const caf::error& e);

/// "peer_lost: rank 3" style text, for logs and one-line CLI errors.
std::string describe(const caf::error& e);

template <class T>
using expected = caf::expected<T>;

} // namespace cmesh
