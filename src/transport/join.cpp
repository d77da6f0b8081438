#include "transport/join.hpp"

#include <algorithm>
#include <chrono>

#include <spdlog/spdlog.h>

#include <unistd.h>

namespace cmesh {

namespace {

expected<host_port> coordinator_from_env() {
  auto text = env_string("CMESH_COORDINATOR");
  if (!text)
    return make_error(errc::invalid_argument,
                      "CMESH_COORDINATOR is not set (expected host:port of `cmesh coordinator`)");
  return parse_host_port(*text);
}

std::string host_name() {
  char buf[256] = {0};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

} // namespace

expected<joined_mesh> join_mesh(join_options opts) {
  std::string err;
  if (!env_override("CMESH_CONNECT_TIMEOUT_MS", opts.connect_timeout_ms, err)
      || !env_override("CMESH_REGISTER_TIMEOUT_MS", opts.register_timeout_ms, err))
    return make_error(errc::invalid_argument, err);
  if (!opts.place) {
    opts.place = read_launch_env(err);
    if (!err.empty())
      return make_error(errc::invalid_argument, err);
  }
  if (!opts.coordinator) {
    auto c = coordinator_from_env();
    if (!c)
      return c.error();
    opts.coordinator = *c;
  }
  auto topts = transport_options::from_env(opts.transport);
  if (!topts)
    return topts.error();
  const auto rank = static_cast<uint32_t>(opts.place->rank);
  wire::register_worker me;
  me.rank = rank;
  me.world_size = static_cast<uint32_t>(opts.place->world_size);
  // Incarnations must grow from one process of a rank to its replacement,
  // on this node or a spare: the wall clock in nanoseconds does (a restart
  // takes far longer than any clock skew a cluster tolerates).
  me.incarnation =
    opts.incarnation != 0
      ? opts.incarnation
      : static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count());
  auto net = transport::create(rank, *topts, me.incarnation);
  if (!net)
    return net.error();
  if (auto e = (*net)->reserve(me.world_size))
    return e;
  auto client = coordinator_client::connect(*opts.coordinator,
                                            std::chrono::milliseconds(opts.connect_timeout_ms));
  if (!client)
    return client.error();
  me.pid = getpid();
  me.host = host_name();
  me.ucx_address = (*net)->address();
  if (!opts.config.empty()) {
    me.config_digest = config_digest(opts.config);
    me.config = std::move(opts.config);
  }
  auto table = client->register_and_wait(me, std::chrono::milliseconds(opts.register_timeout_ms));
  if (!table)
    return table.error();
  if (opts.connect_transport)
    if (auto e = (*net)->connect(table->peers))
      return e;
  spdlog::debug("rank {}: joined a mesh of {}", rank, table->world_size);
  return joined_mesh{*opts.place,         me.incarnation,     me,
                     *opts.coordinator,   std::move(*net),    std::move(*client),
                     std::move(*table)};
}

std::vector<wire::peer_entry> entries_to_dial(const wire::peer_table& table,
                                              const std::vector<rank_incarnation>& wanted,
                                              uint32_t self) {
  std::vector<wire::peer_entry> out;
  for (const auto& e : table.peers) {
    if (e.rank == self)
      continue;
    for (const auto& w : wanted)
      if (w.rank == e.rank && (w.incarnation == 0 || w.incarnation == e.incarnation)) {
        out.push_back(e);
        break;
      }
  }
  std::sort(out.begin(), out.end(),
            [](const wire::peer_entry& a, const wire::peer_entry& b) { return a.rank < b.rank; });
  return out;
}

} // namespace cmesh
