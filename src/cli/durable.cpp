#include "cli/durable.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace cmesh::cli {

std::vector<std::string> durable_flags::roots() const {
  std::vector<std::string> out;
  if (!dir.empty())
    out.push_back(dir);
  if (!shared.empty())
    out.push_back(shared);
  return out;
}

actors::checkpoint_target target_of(const durable_flags& f, const config_list& config,
                                    model::model& net, uint32_t rank, size_t replicas,
                                    size_t per_group, uint64_t resumed_from) {
  actors::checkpoint_target t;
  t.roots = f.roots();
  t.every = f.every;
  t.every_time = f.every_time();
  t.keep_last = f.keep_last;
  t.keep_every = f.keep_every;
  t.rank = rank;
  t.replicas = static_cast<uint32_t>(replicas);
  t.ranks_per_group = static_cast<uint32_t>(per_group);
  t.elements = net.parameters().size();
  for (const auto& ti : net.tensors())
    t.tensors.push_back({ti.name, {ti.shape.begin(), ti.shape.end()}, ti.offset, ti.size});
  t.config = config;
  t.resumed_from = resumed_from;
  return t;
}

namespace {

bool has_manifest(const std::string& dir) {
  struct stat sb {};
  return ::stat((dir + "/" + std::string(storage::manifest_file)).c_str(), &sb) == 0;
}

/// A shard of `count` elements from `first`, and the ranges that fill it.
struct shard_buffers {
  std::shared_ptr<shard_state> s = std::make_shared<shard_state>();
  std::vector<storage::range_out> wanted;
  shard_buffers(uint64_t first, uint64_t count) {
    s->first = first;
    for (auto* v : {&s->weights, &s->adam_m, &s->adam_v})
      v->resize(count);
    wanted = {{"weights", first, std::as_writable_bytes(std::span<float>(s->weights))},
              {"adam_m", first, std::as_writable_bytes(std::span<float>(s->adam_m))},
              {"adam_v", first, std::as_writable_bytes(std::span<float>(s->adam_v))}};
  }
};

/// The newest valid checkpoint of one root, its shard read; nullopt when
/// the root holds none.
expected<std::optional<resume_point>> newest_of(const std::string& root, const config_list& job,
                                                uint64_t first, uint64_t count) {
  shard_buffers b(first, count);
  auto n = storage::newest_valid(root, &job, true, b.wanted);
  if (!n)
    return n.error();
  if (!n->found)
    return std::optional<resume_point>{};
  return std::optional<resume_point>{resume_point{
    std::make_shared<const storage::checkpoint>(std::move(*n->found)), b.s, n->note}};
}

/// The checkpoint in step directory `dir`, its shard read.
expected<std::optional<resume_point>> step_dir(const std::string& dir, const config_list& job,
                                               uint64_t first, uint64_t count) {
  auto c = storage::checkpoint::open(dir);
  if (!c)
    return c.error();
  if (auto e = c->check_config(job))
    return e;
  shard_buffers b(first, count);
  if (auto e = c->verify(b.wanted))
    return e;
  return std::optional<resume_point>{
    resume_point{std::make_shared<const storage::checkpoint>(std::move(*c)), b.s, {}}};
}

} // namespace

expected<std::optional<resume_point>> find_resume(const durable_flags& f, const config_list& job,
                                                  uint64_t first, uint64_t count) {
  if (f.resume.empty())
    return std::optional<resume_point>{};
  if (f.resume != "latest") {
    if (has_manifest(f.resume))
      return step_dir(f.resume, job, first, count);
    auto r = newest_of(f.resume, job, first, count);
    if (r && !*r)
      return make_error(errc::invalid_argument,
                        fmt::format("--resume {}: no checkpoint there", f.resume));
    return r;
  }
  if (!f.writes())
    return make_error(errc::invalid_argument,
                      "--resume latest needs --checkpoint-dir or --checkpoint-shared");
  // The newest of the tiers: a shared tier may hold a step the local one
  // lost with its node, or the other way round.
  std::optional<resume_point> best;
  for (const auto& root : f.roots()) {
    auto r = newest_of(root, job, first, count);
    if (!r)
      return r.error();
    if (*r && (!best || (*r)->ckpt->step() > best->ckpt->step()))
      best = std::move(**r);
  }
  return best;
}

std::function<caf::error(actors::train_state&, size_t)> loader_of(const resume_point& r) {
  return [ckpt = r.ckpt, shard = r.shard](actors::train_state& st, size_t first) -> caf::error {
    if (first != shard->first || st.params.size() != shard->weights.size())
      return make_error(errc::invalid_argument,
                        fmt::format("resume: the trainer's shard is elements [{}, {}), the one "
                                    "read from {} [{}, {})",
                                    first, first + st.params.size(), ckpt->dir(), shard->first,
                                    shard->first + shard->weights.size()));
    std::copy(shard->weights.begin(), shard->weights.end(), st.params.begin());
    std::copy(shard->adam_m.begin(), shard->adam_m.end(), st.adam_m.begin());
    std::copy(shard->adam_v.begin(), shard->adam_v.end(), st.adam_v.begin());
    const auto& meta = ckpt->info().meta;
    if (st.scalars.size() >= 2) {
      st.scalars[0] = meta.loss_scale;
      st.scalars[1] = static_cast<float>(meta.loss_scale_good_steps);
    }
    st.step = meta.step;
    return {};
  };
}

std::string corrupt_newest_checkpoint(const durable_flags& f) {
  const auto roots = f.roots();
  if (roots.empty())
    return "nothing to corrupt: no --checkpoint-dir";
  auto all = storage::list_checkpoints(roots.front(), false);
  if (!all || all->empty())
    return "nothing to corrupt: no checkpoint in " + roots.front();
  auto c = storage::checkpoint::open(all->back().dir);
  if (!c)
    return "nothing to corrupt: " + describe(c.error());
  // A byte of data, not of the alignment holes between pieces: the middle
  // of the middle piece of shard-0.bin.
  std::vector<const storage::piece_entry*> in_first;
  for (const auto& p : c->info().pieces)
    if (c->info().files[p.file].name == storage::shard_file_name(0))
      in_first.push_back(&p);
  if (in_first.empty())
    return "nothing to corrupt: no piece in shard-0.bin of " + c->dir();
  const auto& p = *in_first[in_first.size() / 2];
  const auto bytes = p.count * storage::dtype_bytes(c->info().arrays[p.array].dtype);
  const auto at = static_cast<off_t>(p.offset + bytes / 2);
  const auto file = c->dir() + "/" + storage::shard_file_name(0);
  const int fd = ::open(file.c_str(), O_RDWR);
  if (fd < 0)
    return "could not open " + file;
  unsigned char b = 0;
  bool ok = ::pread(fd, &b, 1, at) == 1;
  b ^= 0x5a;
  ok = ok && ::pwrite(fd, &b, 1, at) == 1 && ::fsync(fd) == 0;
  ::close(fd);
  auto what = ok ? fmt::format("flipped byte {} of {} ({})", at, file,
                               storage::describe_piece(c->info(), p))
                 : "could not write " + file;
  fmt::print("cmesh: chaos: {}\n", what);
  return what;
}

} // namespace cmesh::cli
