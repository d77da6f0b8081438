#include "cli/checkpoint.hpp"

#include "storage/io.hpp"
#include "storage/reader.hpp"

#include <CLI/CLI.hpp>
#include <fmt/chrono.h>
#include <fmt/format.h>

#include <algorithm>
#include <ctime>
#include <filesystem>

namespace cmesh::cli {

namespace {

int fail(const caf::error& err) {
  fmt::print(stderr, "cmesh: error: {}\n", describe(err));
  return code_of(err) == errc::unreachable ? 3 : 1;
}

std::string human_bytes(uint64_t n) {
  if (n < 1024)
    return fmt::format("{} B", n);
  double v = static_cast<double>(n);
  const char* unit = "KiB";
  for (const char* u : {"KiB", "MiB", "GiB", "TiB"}) {
    v /= 1024;
    unit = u;
    if (v < 1024)
      break;
  }
  return fmt::format("{:.1f} {}", v, unit);
}

std::string local_time(int64_t unix_ms) {
  const auto t = static_cast<std::time_t>(unix_ms / 1000);
  return fmt::format("{:%Y-%m-%d %H:%M:%S}", fmt::localtime(t));
}

/// A step directory (by its name, or by the manifest in it), not a root.
bool is_step_dir(const std::string& dir) {
  auto name = std::filesystem::path(dir).lexically_normal().filename().string();
  if (name.empty()) // "a/b/": the name before the slash
    name = std::filesystem::path(dir).lexically_normal().parent_path().filename().string();
  return storage::parse_step_dir(name).has_value()
         || std::filesystem::exists(storage::join(dir, storage::manifest_file));
}

/// One line per step directory (valid, or why not) and per partial one.
/// Returns the exit code of `verify` on the root: 1 when one is not valid
/// (3: could not be read) or there is none.
int print_list(const std::string& root, bool verify_data) {
  auto list = storage::list_checkpoints(root, verify_data);
  if (!list)
    return fail(list.error());
  if (list->empty() && verify_data)
    return fail(make_error(errc::invalid_argument, fmt::format("no checkpoint in {}", root)));
  auto partials = storage::list_partials(root);
  if (!partials)
    return fail(partials.error());
  int rc = 0;
  size_t invalid = 0;
  for (const auto& s : *list) {
    fmt::print("{}  {:>10}  {}  {}\n", std::filesystem::path(s.dir).filename().string(),
               human_bytes(s.bytes), local_time(s.mtime_unix_ms),
               s.error ? describe(s.error) : verify_data ? "ok (verified)" : "ok");
    if (s.error) {
      rc = std::max(rc, code_of(s.error) == errc::unreachable ? 3 : 1);
      ++invalid;
    }
  }
  for (const auto& p : *partials) {
    // A published part (storage's part protocol) waits for its committer.
    const bool part = std::filesystem::exists(p.dir + "/" + std::string(storage::part_file));
    fmt::print("{}  partial: {} by pid {} on {} ({})\n",
               std::filesystem::path(p.dir).filename().string(),
               part ? "a shard's part, published for the committer to adopt" : "an unfinished write",
               p.owner.pid, p.owner.host,
               p.writer_alive ? "running, or on another host" : "gone: cleanup removes it");
  }
  if (invalid > 0 && verify_data)
    fmt::print(stderr, "cmesh: error: {} of the {} checkpoints in {} {} not valid\n", invalid,
               list->size(), root, invalid == 1 ? "is" : "are");
  return rc;
}

int verify(const std::string& dir) {
  if (!is_step_dir(dir))
    return print_list(dir, true);
  auto c = storage::checkpoint::open(dir);
  if (!c)
    return fail(c.error());
  if (auto err = c->verify())
    return fail(err);
  fmt::print("step {}: ok ({} files, {} pieces, {} verified)\n", c->step(),
             c->info().files.size(), c->info().pieces.size(), human_bytes(c->bytes()));
  return 0;
}

/// The manifest of a step directory, or of a root's newest checkpoint that
/// opens. A manifest that decodes but does not open (a shard missing, a
/// field inconsistent) is printed too, for diagnosis, with the error and 1.
int inspect(const std::string& dir) {
  std::string step_dir = dir;
  if (!is_step_dir(dir)) {
    // Not newest_valid: it logs what it skips, and stdout is for the JSON.
    auto list = storage::list_checkpoints(dir);
    if (!list)
      return fail(list.error());
    auto it = std::find_if(list->rbegin(), list->rend(), [](auto& s) { return !s.error; });
    if (it == list->rend())
      return fail(make_error(errc::invalid_argument,
                             fmt::format("no checkpoint in {} opens", dir)));
    step_dir = it->dir;
  }
  auto c = storage::checkpoint::open(step_dir);
  if (c) {
    fmt::print("{}", storage::manifest_json(c->info()));
    return 0;
  }
  const auto path = storage::join(step_dir, storage::manifest_file);
  if (auto bytes = storage::read_whole(path, uint64_t{1} << 30))
    if (auto m = storage::decode_manifest(*bytes, path))
      fmt::print("{}", storage::manifest_json(*m));
  return fail(c.error());
}

} // namespace

CLI::App* add_checkpoint_command(CLI::App& app, checkpoint_args& args) {
  auto* cmd = app.add_subcommand("checkpoint", "list, verify or print the checkpoints in DIR");
  cmd->require_subcommand(1);
  auto add = [&](const char* name, const char* help) {
    auto* sub = cmd->add_subcommand(name, help);
    sub->add_option("DIR", args.dir, "a checkpoint root, or one step directory in it")
      ->required()->check(CLI::ExistingDirectory);
    sub->callback([&args, name] { args.action = name; });
  };
  add("ls", "one line per checkpoint: its step directory, size, time, and ok or why not "
            "(manifest and file sizes checked; verify reads every byte)");
  add("verify", "read every byte of one checkpoint (a step directory) or of each in a root and "
                "check its checksum: exit 0 when all are valid, else 1 with the error");
  add("inspect", "print the manifest of a checkpoint (a root: its newest) as JSON");
  return cmd;
}

int run_checkpoint(const checkpoint_args& args) {
  if (args.action == "ls") {
    // Listing is its job: invalid checkpoints are lines, not a failure.
    const int rc = print_list(args.dir, false);
    return rc == 3 ? 3 : 0;
  }
  if (args.action == "verify")
    return verify(args.dir);
  if (args.action == "inspect")
    return inspect(args.dir);
  return 2;
}

} // namespace cmesh::cli
