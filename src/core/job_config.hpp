// A job's configuration as text: the ordered (key, value) pairs of every
// setting that defines what a run computes (model::canonical_config builds
// them). Every worker registers with its own; the coordinator compares it
// with the job's and refuses a worker that differs. The type and its
// comparison live here, below the model that builds it and the transport
// that carries and checks it.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace cmesh {

using config_entry = std::pair<std::string, std::string>; // key, value
using config_list = std::vector<config_entry>;

/// "key = value\n" for each entry, in order: the text the digest covers.
std::string config_text(const config_list& c);

/// xxh64 (seed 0) of config_text.
uint64_t config_digest(const config_list& c);

/// How a worker's configuration differs from the job's, one text per key,
/// in the job's order and then the worker's extra keys:
///   "train.lr = 0.01 (the job's: 0.003)"
///   "data.identity missing (the job's: synthetic)"
///   "model.foo = 3 (the job has no such key)"
/// Empty when both hold the same keys with the same values (a key given
/// twice counts once, its first value). Pure.
std::vector<std::string> config_differences(const config_list& job, const config_list& worker);

} // namespace cmesh
