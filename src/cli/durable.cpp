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

namespace {

bool has_manifest(const std::string& dir) {
  struct stat sb {};
  return ::stat((dir + "/" + std::string(storage::manifest_file)).c_str(), &sb) == 0;
}

/// The newest valid checkpoint of one root; nullopt when it holds none.
expected<std::optional<resume_point>> newest_of(const std::string& root, const config_list& job) {
  auto n = storage::newest_valid(root, &job, true);
  if (!n)
    return n.error();
  if (!n->found)
    return std::optional<resume_point>{};
  return std::optional<resume_point>{
    resume_point{std::make_shared<const storage::checkpoint>(std::move(*n->found)), n->note}};
}

} // namespace

expected<std::optional<resume_point>> find_resume(const durable_flags& f, const config_list& job) {
  if (f.resume.empty())
    return std::optional<resume_point>{};
  if (f.resume != "latest") {
    if (has_manifest(f.resume)) {
      auto c = storage::checkpoint::open(f.resume);
      if (!c)
        return c.error();
      if (auto e = c->verify())
        return e;
      if (auto e = c->check_config(job))
        return e;
      return std::optional<resume_point>{
        resume_point{std::make_shared<const storage::checkpoint>(std::move(*c)), {}}};
    }
    auto r = newest_of(f.resume, job);
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
    auto r = newest_of(root, job);
    if (!r)
      return r.error();
    if (*r && (!best || (*r)->ckpt->step() > best->ckpt->step()))
      best = std::move(**r);
  }
  return best;
}

std::function<caf::error(actors::train_state&, size_t)>
loader_of(std::shared_ptr<const storage::checkpoint> ckpt) {
  return [ckpt](actors::train_state& st, size_t first) -> caf::error {
    if (auto e = ckpt->read_range<float>("weights", first, st.params))
      return e;
    if (auto e = ckpt->read_range<float>("adam_m", first, st.adam_m))
      return e;
    if (auto e = ckpt->read_range<float>("adam_v", first, st.adam_v))
      return e;
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
  const auto file = all->back().dir + "/" + storage::shard_file_name(0);
  const int fd = ::open(file.c_str(), O_RDWR);
  struct stat sb {};
  if (fd < 0 || ::fstat(fd, &sb) != 0 || sb.st_size == 0) {
    if (fd >= 0)
      ::close(fd);
    return "could not open " + file;
  }
  const off_t at = sb.st_size / 2;
  unsigned char b = 0;
  bool ok = ::pread(fd, &b, 1, at) == 1;
  b ^= 0x5a;
  ok = ok && ::pwrite(fd, &b, 1, at) == 1 && ::fsync(fd) == 0;
  ::close(fd);
  auto what = ok ? fmt::format("flipped byte {} of {}", at, file) : "could not write " + file;
  fmt::print("cmesh: chaos: {}\n", what);
  return what;
}

} // namespace cmesh::cli
