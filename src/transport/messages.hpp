// The wire contract: every message kind that crosses a process boundary, in
// one place. A kind number is forever: add new kinds, never renumber.
//
// Each type has `static constexpr kind_t kind`, a name, its msgpack fields
// (MSGPACK_DEFINE), and optionally `cmesh::bulk payload` with
// `static constexpr bool has_bulk = true`: the payload travels beside the
// frame, not inside the msgpack body.
#pragma once

#include "transport/bulk.hpp"

#include <msgpack.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace cmesh::wire {

using kind_t = uint16_t;
using bytes = std::vector<unsigned char>;

// -- bootstrap (worker <-> coordinator over TCP) -------------------------------

/// A worker's registration: who it is and where its UCP worker listens.
struct register_worker {
  static constexpr kind_t kind = 1;
  static constexpr const char* name = "register_worker";
  uint32_t rank = 0;
  uint32_t world_size = 0;
  uint64_t incarnation = 0;
  int64_t pid = 0;
  std::string host;
  bytes ucx_address;
  // The job configuration this worker runs (model::canonical_config) and
  // its digest (config_digest); the coordinator refuses one that differs
  // from the job's. Empty: a job without a training configuration (the
  // ring smoke job, test nodes, tools), not checked.
  uint64_t config_digest = 0;
  std::vector<std::pair<std::string, std::string>> config = {};
  MSGPACK_DEFINE(rank, world_size, incarnation, pid, host, ucx_address, config_digest, config)
  bool operator==(const register_worker&) const = default;
};

struct peer_entry {
  uint32_t rank = 0;
  uint64_t incarnation = 0;
  int64_t pid = 0;
  std::string host;
  bytes ucx_address;
  MSGPACK_DEFINE(rank, incarnation, pid, host, ucx_address)
  bool operator==(const peer_entry&) const = default;
};

/// The coordinator's answer once every rank registered.
struct peer_table {
  static constexpr kind_t kind = 2;
  static constexpr const char* name = "peer_table";
  uint64_t epoch = 0;
  uint32_t world_size = 0;
  std::vector<peer_entry> peers; // sorted by rank
  MSGPACK_DEFINE(epoch, world_size, peers)
  bool operator==(const peer_table&) const = default;
};

/// A worker's key/value report to the coordinator (progress, results).
struct report {
  static constexpr kind_t kind = 3;
  static constexpr const char* name = "report";
  uint32_t rank = 0;
  std::string key;
  std::string value;
  int64_t mono_ns = 0;
  MSGPACK_DEFINE(rank, key, value, mono_ns)
  bool operator==(const report&) const = default;
};

/// The coordinator tells a worker to stop (end of job, or fatal error).
struct shutdown {
  static constexpr kind_t kind = 4;
  static constexpr const char* name = "shutdown";
  int32_t exit_code = 0;
  std::string reason;
  MSGPACK_DEFINE(exit_code, reason)
  bool operator==(const shutdown&) const = default;
};

/// Coordinator's refusal of a registration (bad rank, duplicate, wrong size).
struct rejected {
  static constexpr kind_t kind = 5;
  static constexpr const char* name = "rejected";
  std::string reason;
  MSGPACK_DEFINE(reason)
  bool operator==(const rejected&) const = default;
};

/// Key/value store of the coordinator (rendezvous of each epoch's
/// communicators: addresses, NCCL unique ids). Keys live under a namespace
/// per epoch, e.g. "epoch/7/host/3".
struct kv_put {
  static constexpr kind_t kind = 6;
  static constexpr const char* name = "kv_put";
  std::string key;
  bytes value;
  MSGPACK_DEFINE(key, value)
  bool operator==(const kv_put&) const = default;
};

/// Asks for a key, waiting up to wait_ms on the coordinator for it to be put.
struct kv_get {
  static constexpr kind_t kind = 7;
  static constexpr const char* name = "kv_get";
  uint64_t request_id = 0;
  std::string key;
  int64_t wait_ms = 0;
  MSGPACK_DEFINE(request_id, key, wait_ms)
  bool operator==(const kv_get&) const = default;
};

/// The answer to kv_get; found is false when wait_ms passed first.
struct kv_value {
  static constexpr kind_t kind = 8;
  static constexpr const char* name = "kv_value";
  uint64_t request_id = 0;
  std::string key;
  bool found = false;
  bytes value;
  MSGPACK_DEFINE(request_id, key, found, value)
  bool operator==(const kv_value&) const = default;
};

/// Drops every key that starts with prefix (an epoch's namespace).
struct kv_drop {
  static constexpr kind_t kind = 9;
  static constexpr const char* name = "kv_drop";
  std::string prefix;
  MSGPACK_DEFINE(prefix)
  bool operator==(const kv_drop&) const = default;
};

// -- supervision (worker <-> coordinator, on the bootstrap connection) ---------

/// A worker's beacon to the coordinator, every heartbeat interval and on each
/// change: which incarnation it is, where it stands and what it can do.
struct worker_status {
  static constexpr kind_t kind = 10;
  static constexpr const char* name = "worker_status";
  enum state_t : uint8_t {
    fresh = 0,       // started, holds the initial weights (step 0), no epoch yet
    training = 1,    // a member of `epoch`, at committed step `step`
    catching_up = 2, // restarted: needs (or is receiving) a snapshot
    ready = 3,       // caught up and following its source's stream: may join
    recovering = 4,  // its step failed; waiting for the next epoch
    starting = 5,    // registered, still building its model: nothing to assign yet
  };
  uint64_t incarnation = 0;
  uint64_t epoch = 0;
  uint64_t step = 0;
  uint8_t state = fresh;
  /// The catch-up session it holds (catching_up, ready) or that failed (fresh).
  uint64_t session = 0;
  int64_t mono_ns = 0;
  /// The newest epoch whose step failed here, or that this worker could not
  /// build (0: none), and why. The coordinator re-forms that epoch when it
  /// is still current and no death explains the failure.
  uint64_t broken_epoch = 0;
  std::string broken_reason;
  MSGPACK_DEFINE(incarnation, epoch, step, state, session, mono_ns, broken_epoch, broken_reason)
  bool operator==(const worker_status&) const = default;
};

/// The coordinator's push: the epoch every member must use from now on (or,
/// with `fail`, that no epoch can form). Members are ranks, each with the
/// incarnation admitted; anyone else holding an older epoch is fenced.
struct epoch_notice {
  static constexpr kind_t kind = 11;
  static constexpr const char* name = "epoch_notice";
  uint64_t epoch = 0;
  std::vector<uint32_t> ranks;
  std::vector<uint64_t> incarnations;
  bool fail = false;
  std::string reason;
  /// Members of this epoch found dead since it began (the epoch is broken
  /// and no new one could form yet): their peers stop waiting for them.
  std::vector<uint32_t> lost;
  /// The running epoch broke though its members live (a step that failed
  /// without a death): its members abort it at once instead of switching
  /// at their next step boundary.
  bool abort_running = false;
  MSGPACK_DEFINE(epoch, ranks, incarnations, fail, reason, lost, abort_running)
  bool operator==(const epoch_notice&) const = default;
};

/// Catch-up session `session`: `source` sends its state to `joiner`
/// (incarnation `joiner_incarnation`), then streams its committed steps.
/// Sent to both.
struct catchup_assign {
  static constexpr kind_t kind = 12;
  static constexpr const char* name = "catchup_assign";
  uint64_t session = 0;
  uint32_t joiner = 0;
  uint64_t joiner_incarnation = 0;
  uint32_t source = 0;
  MSGPACK_DEFINE(session, joiner, joiner_incarnation, source)
  bool operator==(const catchup_assign&) const = default;
};

/// A worker's report that the replica groups' states differ (the hashes
/// compared in the commit vote of `step`, see recovery/verify.hpp). The
/// coordinator fences `minority` (their ranks are lost at once) or, with
/// `no_majority`, ends the job: nothing is left to trust.
struct replica_divergence {
  static constexpr kind_t kind = 13;
  static constexpr const char* name = "replica_divergence";
  uint64_t incarnation = 0; // the reporter's
  uint64_t epoch = 0;
  uint64_t step = 0;
  std::vector<uint32_t> minority; // replica groups
  bool no_majority = false;
  std::vector<uint32_t> positions; // shards that differ
  std::string tensors;             // the tensors that differ, in words
  std::string reason;
  MSGPACK_DEFINE(incarnation, epoch, step, minority, no_majority, positions, tensors, reason)
  bool operator==(const replica_divergence&) const = default;
};

// -- transport (process <-> process over UCX) ----------------------------------

/// Liveness beacon on the control endpoint.
struct heartbeat {
  static constexpr kind_t kind = 16;
  static constexpr const char* name = "heartbeat";
  uint64_t seq = 0;
  int64_t sent_ns = 0;
  MSGPACK_DEFINE(seq, sent_ns)
  bool operator==(const heartbeat&) const = default;
};

// -- actor messages ------------------------------------------------------------

/// The ring token of `cmesh launch`'s smoke job.
struct token {
  static constexpr kind_t kind = 32;
  static constexpr const char* name = "token";
  uint32_t origin = 0;
  uint32_t lap = 0;
  uint32_t laps = 0;
  uint64_t hops = 0;
  MSGPACK_DEFINE(origin, lap, laps, hops)
  bool operator==(const token&) const = default;
};

/// A numbered message of a stream (ordering tests, latency ping-pong).
struct sequenced {
  static constexpr kind_t kind = 33;
  static constexpr const char* name = "sequenced";
  uint32_t stream = 0;
  uint64_t seq = 0;
  int64_t sent_ns = 0;
  MSGPACK_DEFINE(stream, seq, sent_ns)
  bool operator==(const sequenced&) const = default;
};

/// A bulk buffer with its xxh64 checksum.
struct blob {
  static constexpr kind_t kind = 34;
  static constexpr const char* name = "blob";
  static constexpr bool has_bulk = true;
  uint64_t seq = 0;
  uint64_t checksum = 0;
  cmesh::bulk payload;
  MSGPACK_DEFINE(seq, checksum)
  bool operator==(const blob& o) const {
    return seq == o.seq && checksum == o.checksum && payload.size() == o.payload.size();
  }
};

/// An acknowledgement (bandwidth tests, barriers of the smoke job).
struct ack {
  static constexpr kind_t kind = 35;
  static constexpr const char* name = "ack";
  uint64_t seq = 0;
  uint64_t value = 0;
  MSGPACK_DEFINE(seq, value)
  bool operator==(const ack&) const = default;
};

/// The checkpoint stream (actors/checkpointer.hpp): a copy of one shard's
/// state at a step boundary, from a rank of the writing group to the
/// checkpointer process. The payload holds the weights, then AdamW's two
/// moments (`elements` floats each), then `scalars` floats.
struct ckpt_seed {
  static constexpr kind_t kind = 36;
  static constexpr const char* name = "ckpt_seed";
  static constexpr bool has_bulk = true;
  uint32_t position = 0; // the shard's position in its group
  uint64_t link = 0;     // the link it came over (a stale link's messages are dropped)
  uint64_t step = 0;     // the state is at this step
  uint64_t elements = 0;
  uint32_t scalars = 0;
  bool agreed = false;   // a checkpoint of this step was agreed (commit vote)
  cmesh::bulk payload;
  MSGPACK_DEFINE(position, link, step, elements, scalars, agreed)
  bool operator==(const ckpt_seed& o) const {
    return position == o.position && link == o.link && step == o.step
           && elements == o.elements && scalars == o.scalars && agreed == o.agreed
           && payload.size() == o.payload.size();
  }
};

/// The checkpoint stream: one shard's committed update of step `step`
/// (payload: its floats). `expect`: the trainer's state hash after it, with
/// the lowest bit set (0: not checked).
struct ckpt_update {
  static constexpr kind_t kind = 37;
  static constexpr const char* name = "ckpt_update";
  static constexpr bool has_bulk = true;
  uint32_t position = 0;
  uint64_t link = 0;
  uint64_t step = 0;
  uint64_t expect = 0;
  bool agreed = false; // a checkpoint of the state after it was agreed
  cmesh::bulk payload;
  MSGPACK_DEFINE(position, link, step, expect, agreed)
  bool operator==(const ckpt_update& o) const {
    return position == o.position && link == o.link && step == o.step && expect == o.expect
           && agreed == o.agreed && payload.size() == o.payload.size();
  }
};

/// Catch-up (actors/supervisor.hpp): a joiner asks its assigned source for
/// the session, giving the sizes of its params, moments and scalars (the
/// source refuses a state of another shape). Sent to the source's
/// "supervisor" until the first answer comes (a source that has not
/// connected the joiner's incarnation yet drops it).
struct catchup_request {
  static constexpr kind_t kind = 38;
  static constexpr const char* name = "catchup_request";
  uint64_t session = 0;
  uint64_t incarnation = 0; // the joiner's
  std::vector<uint64_t> sizes;
  MSGPACK_DEFINE(session, incarnation, sizes)
  bool operator==(const catchup_request&) const = default;
};

/// Catch-up: a piece of the source's state at step `step`: the floats
/// [offset, offset + payload / 4) of its snapshot's range (params, then
/// AdamW's two moments, then the scalars, each starting on a multiple of
/// 16 floats).
struct catchup_piece {
  static constexpr kind_t kind = 39;
  static constexpr const char* name = "catchup_piece";
  static constexpr bool has_bulk = true;
  uint64_t session = 0;
  uint64_t step = 0;
  uint64_t offset = 0;
  cmesh::bulk payload;
  MSGPACK_DEFINE(session, step, offset)
  bool operator==(const catchup_piece& o) const {
    return session == o.session && step == o.step && offset == o.offset
           && payload.size() == o.payload.size();
  }
};

/// Catch-up: the committed update of step `step` (payload: its floats), or
/// the stream's end (`end`; `refused` non-empty: the session failed, why).
struct catchup_update {
  static constexpr kind_t kind = 40;
  static constexpr const char* name = "catchup_update";
  static constexpr bool has_bulk = true;
  uint64_t session = 0;
  uint64_t step = 0;
  bool end = false;
  std::string refused;
  cmesh::bulk payload;
  MSGPACK_DEFINE(session, step, end, refused)
  bool operator==(const catchup_update& o) const {
    return session == o.session && step == o.step && end == o.end && refused == o.refused
           && payload.size() == o.payload.size();
  }
};

/// Catch-up: the joiner holds `pieces` pieces and applied `updates` updates.
struct catchup_ack {
  static constexpr kind_t kind = 41;
  static constexpr const char* name = "catchup_ack";
  uint64_t session = 0;
  uint64_t pieces = 0;
  uint64_t updates = 0;
  MSGPACK_DEFINE(session, pieces, updates)
  bool operator==(const catchup_ack&) const = default;
};

// -- the registry --------------------------------------------------------------

template <class... Ts>
struct type_list {};

using bootstrap_messages = type_list<register_worker, peer_table, report, shutdown, rejected,
                                     kv_put, kv_get, kv_value, kv_drop, worker_status,
                                     epoch_notice, catchup_assign, replica_divergence>;
using transport_messages = type_list<heartbeat>;
/// Kinds that may be sent between actors (what a remote proxy forwards).
using actor_messages = type_list<token, sequenced, blob, ack, ckpt_seed, ckpt_update,
                                 catchup_request, catchup_piece, catchup_update, catchup_ack>;
using all_messages = type_list<register_worker, peer_table, report, shutdown, rejected, kv_put,
                               kv_get, kv_value, kv_drop, worker_status, epoch_notice,
                               catchup_assign, replica_divergence, heartbeat, token, sequenced,
                               blob, ack, ckpt_seed, ckpt_update, catchup_request,
                               catchup_piece, catchup_update, catchup_ack>;

template <class T>
constexpr bool has_bulk_v = requires { T::has_bulk; };

template <class... Ts, class F>
void for_each_type(type_list<Ts...>, F&& f) {
  (f.template operator()<Ts>(), ...);
}

/// Calls f.template operator()<T>() for the type of `kind` within `List`;
/// false when the kind is not in it.
template <class List, class F>
bool visit_kind(kind_t kind, F&& f) {
  bool found = false;
  for_each_type(List{}, [&]<class T>() {
    if (!found && T::kind == kind) {
      found = true;
      f.template operator()<T>();
    }
  });
  return found;
}

/// Name of a kind for logs, or nullptr when unknown.
const char* kind_name(kind_t kind);

/// True when the kind is in the registry.
bool known_kind(kind_t kind);

} // namespace cmesh::wire
