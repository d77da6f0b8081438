// Storage benchmark: writing and loading a checkpoint (src/storage) beside
// the plain tools on the same bytes, in the same directory, in the same run.
//
//  1. Write bandwidth: checkpoint_writer (begin, write_shard per shard file,
//     commit: every file fsynced, the manifest, the renames, the directory
//     fsyncs) against `dd bs=8M conv=fsync` of the same bytes (one dd per
//     shard file, each its file's bytes), run as a child process. The two
//     alternate (checkpoint, dd, checkpoint, dd, ...); the medians and their
//     ratio (goal: the checkpoint at least 80% of dd's MB/s).
//  2. Load: what a resume will do (checkpoint::open, then read_range of
//     every array whole, every piece's xxh64 checked) against read(2) of the
//     shard files into memory and `cat FILES > /dev/null`, cold (the files'
//     pages dropped with posix_fadvise(POSIX_FADV_DONTNEED) after an fsync;
//     mincore says whether they really went) and warm. Goal: the load at
//     most 2x the read. Resume itself does not exist yet.
//  3. Where the time goes: the writer's phases, and xxh64 alone on the
//     bytes in memory.
//
// The state: three f32 arrays (weights, adam_m, adam_v) of P elements
// filled by a PRNG; P = the default model's parameters (its own tensor
// index), 2.5M and 25M (an index of a few dozen matrices and bias vectors).
// Written as S = 1 and S = 2 shard files (S = 2: two write_shard calls, each
// its half of every array).
//
//   cmesh_bench_storage [--dir DIR] [--reps N] [--quick] [--verbose]
#include "core/env.hpp"
#include "core/hash.hpp"
#include "model/config.hpp"
#include "model/moe_lm.hpp"
#include "storage/io.hpp"
#include "storage/reader.hpp"
#include "storage/writer.hpp"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace {

namespace st = cmesh::storage;

std::atomic<bool> stop_requested{false};
bool verbose = false; // --verbose: every sample on stderr as it is taken
void on_signal(int) { stop_requested = true; }

double now_s() { return cmesh::mono_s(); }

double median(std::vector<double> x) {
  if (x.empty())
    return NAN;
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n % 2 ? x[n / 2] : (x[n / 2 - 1] + x[n / 2]) / 2;
}

const char* verdict(bool met) { return met ? "met" : "MISSED"; }

std::string work_dir; // everything this run writes is under it; removed on the way out

[[noreturn]] void die(const std::string& what) {
  fmt::print(stderr, "cmesh_bench_storage: {}\n", what);
  if (!work_dir.empty())
    (void)st::remove_tree(work_dir);
  std::exit(1);
}

void check(const caf::error& err, const std::string& what) {
  if (err)
    die(what + ": " + cmesh::describe(err));
}

/// The first line a shell command prints, or "?".
std::string first_line_of(const std::string& cmd) {
  std::string out = "?";
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[512];
    if (std::fgets(buf, sizeof(buf), p) != nullptr) {
      out = buf;
      while (!out.empty() && (out.back() == '\n' || out.back() == ' '))
        out.pop_back();
    }
    ::pclose(p);
  }
  return out;
}

/// Runs argv (PATH searched) with stdout to /dev/null and waits; its wall
/// time in seconds. A failure ends the benchmark.
double run_timed(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const auto& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  const double t0 = now_s();
  pid_t pid = -1;
  const int rc = ::posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0)
    die(fmt::format("cannot run {}: {}", argv[0], std::strerror(rc)));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  const double secs = now_s() - t0;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    die(fmt::format("{} failed (wait status {})", fmt::join(argv, " "), status));
  return secs;
}

/// The state of one size: three arrays and the tensor index over them.
struct state {
  std::string name;
  uint64_t params = 0;
  std::vector<float> arrays[3];
  std::vector<st::tensor_entry> index;
  uint64_t bytes() const { return 3 * 4 * params; }
};
const char* const array_names[3] = {"weights", "adam_m", "adam_v"};

/// A model-like index of P elements: per block a [rows, width] matrix
/// (rows drawn at random) and a [width] bias, the last matrix taking the
/// rest, so every element is in a tensor and the biases leave holes.
std::vector<st::tensor_entry> synthetic_index(uint64_t params, int blocks, uint64_t width) {
  std::vector<double> weight(blocks);
  double total = 0;
  for (int b = 0; b < blocks; ++b)
    total += weight[b] = 0.5 + static_cast<double>(cmesh::splitmix64(b) % 1000) / 1000.0;
  std::vector<st::tensor_entry> out;
  uint64_t at = 0;
  const double per_row = static_cast<double>(params - blocks * width) / static_cast<double>(width);
  for (int b = 0; b < blocks; ++b) {
    const bool last = b == blocks - 1;
    const uint64_t rows = static_cast<uint64_t>(per_row * weight[b] / total);
    const uint64_t size = last ? params - at - width : rows * width; // the last: the rest
    auto shape = last ? std::vector<uint64_t>{size} : std::vector<uint64_t>{rows, width};
    out.push_back({fmt::format("block{}.w", b), shape, at, size});
    at += size;
    out.push_back({fmt::format("block{}.b", b), {width}, at, width});
    at += width;
  }
  return out;
}

state make_state(std::string name, uint64_t params, std::vector<st::tensor_entry> index) {
  state s;
  s.name = std::move(name);
  s.params = params;
  s.index = std::move(index);
  uint64_t x = params;
  for (auto& a : s.arrays) {
    a.resize(params);
    for (auto& v : a) { // xorshift64: cheap, and incompressible enough
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      v = static_cast<float>(static_cast<int64_t>(x >> 11) - (int64_t{1} << 52)) * 0x1p-52f;
    }
  }
  return s;
}

/// The default model's parameters with its own tensor index.
state default_model_state() {
  auto cfg = cmesh::model::parse_config("");
  if (!cfg)
    die("default config: " + cmesh::describe(cfg.error()));
  std::vector<st::tensor_entry> index;
  for (const auto& t : cmesh::model::moe_lm_tensors(cfg->model))
    index.push_back({t.name, std::vector<uint64_t>(t.shape.begin(), t.shape.end()), t.offset,
                     t.size});
  return make_state("default model", cmesh::model::moe_lm_parameter_count(cfg->model),
                    std::move(index));
}

/// Elements [lo, hi) of shard k of S.
std::pair<uint64_t, uint64_t> shard_range(uint64_t params, uint32_t k, uint32_t S) {
  return {params * k / S, params * (k + 1) / S};
}

struct write_times {
  double total = 0, begin = 0, shards = 0, commit = 0;
};

write_times write_once(const state& s, const std::string& root, uint32_t S, uint64_t step) {
  st::checkpoint_meta meta;
  meta.step = step;
  meta.replicas = 1;
  meta.ranks_per_group = S;
  meta.config = {{"bench.parameters", std::to_string(s.params)},
                 {"bench.shards", std::to_string(S)}};
  std::vector<st::array_entry> arrays;
  for (auto* n : array_names)
    arrays.push_back({n, "f32", s.params, true});
  write_times t;
  const double t0 = now_s();
  auto w = st::checkpoint_writer::begin(root, std::move(meta), std::move(arrays), s.index);
  if (!w)
    die("begin: " + cmesh::describe(w.error()));
  const double t1 = now_s();
  for (uint32_t k = 0; k < S; ++k) {
    auto [lo, hi] = shard_range(s.params, k, S);
    std::vector<st::array_slice> slices;
    for (int a = 0; a < 3; ++a)
      slices.push_back(st::slice_of(array_names[a], lo,
                                    std::span<const float>(s.arrays[a].data() + lo, hi - lo)));
    check(w->write_shard(k, slices), "write_shard");
  }
  const double t2 = now_s();
  auto dir = w->commit();
  if (!dir)
    die("commit: " + cmesh::describe(dir.error()));
  const double t3 = now_s();
  t.total = t3 - t0, t.begin = t1 - t0, t.shards = t2 - t1, t.commit = t3 - t2;
  return t;
}

/// src.bin holds the state's bytes in the order the shard files do: per
/// shard, its part of each array. Written, fsynced and kept in the cache
/// (dd reads it from memory, as the writer does).
void write_source(const state& s, const std::string& path, uint32_t S) {
  ::unlink(path.c_str());
  auto f = st::open_file(path, O_WRONLY | O_CREAT | O_EXCL);
  if (!f)
    die("source: " + cmesh::describe(f.error()));
  uint64_t at = 0;
  for (uint32_t k = 0; k < S; ++k) {
    auto [lo, hi] = shard_range(s.params, k, S);
    for (const auto& a : s.arrays) {
      auto bytes = std::as_bytes(std::span<const float>(a.data() + lo, hi - lo));
      check(st::write_at(*f, bytes, at, path), "source");
      at += bytes.size();
    }
  }
  check(st::sync_file(*f, path), "source fsync");
}

/// dd of each shard's bytes of src.bin to its own file in `dir`, one after
/// the other; end to end, the processes' start included.
double dd_once(const state& s, const std::string& src, const std::string& dir, uint32_t S) {
  double secs = 0;
  uint64_t skip = 0;
  for (uint32_t k = 0; k < S; ++k) {
    auto [lo, hi] = shard_range(s.params, k, S);
    const uint64_t n = 12 * (hi - lo);
    secs += run_timed({"dd", "if=" + src, fmt::format("of={}/dd-{}.bin", dir, k), "bs=8M",
                       "conv=fsync", "status=none", "iflag=skip_bytes,count_bytes",
                       fmt::format("skip={}", skip), fmt::format("count={}", n)});
    skip += n;
  }
  return secs;
}

/// syncfs(2) of the directory's file system: every write so far (ours and
/// others') on its disk before a timed run starts.
void settle(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::syncfs(fd);
    ::close(fd);
  }
}

/// The shard files of a checkpoint directory.
std::vector<std::string> checkpoint_files(const st::checkpoint& c) {
  std::vector<std::string> out;
  for (const auto& f : c.info().files)
    out.push_back(st::join(c.dir(), f.name));
  return out;
}

/// fsync, then drop the file's pages from the page cache.
void drop_cache(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    die(fmt::format("open {}: {}", path, std::strerror(errno)));
  ::fsync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

/// Pages of the files in the page cache, over their pages (holes count as
/// not resident).
double resident_fraction(const std::vector<std::string>& paths) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  uint64_t in = 0, all = 0;
  for (const auto& p : paths) {
    int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    struct stat sb {};
    if (fd < 0 || ::fstat(fd, &sb) != 0 || sb.st_size == 0) {
      if (fd >= 0)
        ::close(fd);
      continue;
    }
    const size_t len = static_cast<size_t>(sb.st_size), pages = (len + page - 1) / page;
    void* m = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (m == MAP_FAILED)
      continue;
    std::vector<unsigned char> vec(pages);
    if (::mincore(m, len, vec.data()) == 0)
      for (auto v : vec)
        in += v & 1;
    all += pages;
    ::munmap(m, len);
  }
  return all == 0 ? 0.0 : static_cast<double>(in) / static_cast<double>(all);
}

struct load_times {
  double total = 0, open = 0;
};

/// What a resume will do: open (manifest, validate, sizes), then every
/// array read whole through read_range, each piece verified.
load_times load_once(const std::string& dir, std::vector<float> (&out)[3]) {
  load_times t;
  const double t0 = now_s();
  auto c = st::checkpoint::open(dir);
  if (!c)
    die("open: " + cmesh::describe(c.error()));
  const double t1 = now_s();
  for (int a = 0; a < 3; ++a)
    check(c->read_range(array_names[a], 0, std::span<float>(out[a])), "read_range");
  t.total = now_s() - t0, t.open = t1 - t0;
  return t;
}

/// read(2) of each file whole into `buf`, 8 MiB at a time.
double plain_read_once(const std::vector<std::string>& paths, std::vector<std::byte>& buf) {
  const double t0 = now_s();
  size_t at = 0;
  for (const auto& p : paths) {
    int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      die(fmt::format("open {}: {}", p, std::strerror(errno)));
    for (;;) {
      const size_t want = std::min<size_t>(8u << 20, buf.size() - at);
      const ssize_t n = want == 0 ? 0 : ::read(fd, buf.data() + at, want);
      if (n < 0 && errno == EINTR)
        continue;
      if (n < 0)
        die(fmt::format("read {}: {}", p, std::strerror(errno)));
      if (n == 0)
        break;
      at += static_cast<size_t>(n);
    }
    ::close(fd);
  }
  return now_s() - t0;
}

/// xxh64 of every array in memory: the hashing a write or a load does,
/// alone (best of 3).
double hash_alone_s(const state& s) {
  double best = 1e30;
  uint64_t sink = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = now_s();
    for (const auto& a : s.arrays)
      sink ^= XXH64(a.data(), a.size() * sizeof(float), 0);
    best = std::min(best, now_s() - t0);
  }
  if (sink == 42) // keep the hashes
    fmt::print("");
  return best;
}

/// Figures of one (state, S).
struct case_result {
  std::string state_name;
  uint64_t params = 0, bytes = 0, file_bytes = 0, pieces = 0;
  uint32_t S = 1;
  std::vector<double> ckpt_s, dd_s, begin_s, shards_s, commit_s, dirsync_s;
  // Load, by cache state (0: cold, 1: warm).
  std::vector<double> load_s[2], open_s[2], read_s[2], cat_s[2];
  double resident_max[2] = {0, 0}, resident_min[2] = {1, 1};
  double hash_s = 0;
};

/// One metadata commit alone: an empty file created in `dir`, then the
/// directory fsynced (what each of commit's three fsyncs waits for).
double dir_fsync_alone(const std::string& dir) {
  settle(dir);
  const auto probe = st::join(dir, "probe");
  auto f = st::open_file(probe, O_WRONLY | O_CREAT | O_EXCL);
  if (!f)
    die("probe: " + cmesh::describe(f.error()));
  const double t0 = now_s();
  check(st::sync_dir(dir), "probe fsync");
  const double secs = now_s() - t0;
  ::unlink(probe.c_str());
  return secs;
}

/// Checkpoint and dd writes of one state at S shards, alternating, after
/// one untimed round of each (the first write after a large file was
/// written or removed is often slow here); the last checkpoint is kept for
/// the load. Every timed run starts after a syncfs, with what the previous
/// one wrote removed.
void write_phase(const state& s, uint32_t S, const std::string& work, int reps, case_result& r) {
  const auto root = st::join(work, "ckpt"), src = st::join(work, "src.bin");
  write_source(s, src, S);
  for (int rep = -1; rep < reps && !stop_requested; ++rep) {
    settle(work);
    const auto t = write_once(s, root, S, 1);
    if (rep + 1 < reps)
      check(st::remove_tree(st::join(root, st::step_dir_name(1))), "remove");
    settle(work);
    const double dd = dd_once(s, src, work, S);
    for (uint32_t k = 0; k < S; ++k)
      ::unlink(fmt::format("{}/dd-{}.bin", work, k).c_str());
    const double dirsync = dir_fsync_alone(work);
    if (verbose)
      fmt::print(stderr, "{} S={} {}: checkpoint {:.1f} ms (shards {:.1f}, commit {:.1f}), "
                 "dd {:.1f} ms, directory fsync {:.1f} ms\n", s.name, S,
                 rep < 0 ? "warm-up" : fmt::format("rep {}", rep), 1e3 * t.total,
                 1e3 * t.shards, 1e3 * t.commit, 1e3 * dd, 1e3 * dirsync);
    if (rep < 0)
      continue;
    r.ckpt_s.push_back(t.total);
    r.begin_s.push_back(t.begin);
    r.shards_s.push_back(t.shards);
    r.commit_s.push_back(t.commit);
    r.dd_s.push_back(dd);
    r.dirsync_s.push_back(dirsync);
  }
  ::unlink(src.c_str());
}

/// Load, read(2) and cat of the kept checkpoint, cold then warm, per rep.
void load_phase(const state& s, const std::string& work, int reps, case_result& r) {
  const auto dir = st::join(st::join(work, "ckpt"), st::step_dir_name(1));
  auto c = st::checkpoint::open(dir);
  if (!c)
    die("open: " + cmesh::describe(c.error()));
  r.file_bytes = c->bytes();
  r.pieces = c->info().pieces.size();
  const auto files = checkpoint_files(*c);
  auto all = files;
  all.push_back(st::join(dir, std::string(st::manifest_file)));
  std::vector<float> out[3];
  for (auto& a : out)
    a.assign(s.params, 0.0f); // touched: no page faults inside the timed reads
  std::vector<std::byte> buf(r.file_bytes, std::byte{0});
  bool checked = false;
  for (int rep = 0; rep < reps && !stop_requested; ++rep)
    for (int warm = 0; warm < 2; ++warm)
      for (int op = 0; op < 3; ++op) {
        if (!warm)
          for (const auto& f : all)
            drop_cache(f);
        const double res = resident_fraction(files);
        r.resident_max[warm] = std::max(r.resident_max[warm], res);
        r.resident_min[warm] = std::min(r.resident_min[warm], res);
        if (op == 0) {
          const auto t = load_once(dir, out);
          r.load_s[warm].push_back(t.total);
          r.open_s[warm].push_back(t.open);
        } else if (op == 1) {
          r.read_s[warm].push_back(plain_read_once(files, buf));
        } else {
          std::vector<std::string> argv = {"cat"};
          argv.insert(argv.end(), files.begin(), files.end());
          r.cat_s[warm].push_back(run_timed(argv));
        }
        if (verbose)
          fmt::print(stderr, "{} rep {} {} {}: {:.2f} ms ({:.0f}% resident)\n", s.name, rep,
                     warm ? "warm" : "cold", op == 0 ? "load" : op == 1 ? "read()" : "cat",
                     1e3 * (op == 0 ? r.load_s[warm].back()
                            : op == 1 ? r.read_s[warm].back() : r.cat_s[warm].back()),
                     100.0 * res);
        if (op == 0 && !checked) {
          for (int a = 0; a < 3; ++a)
            if (std::memcmp(out[a].data(), s.arrays[a].data(), s.params * sizeof(float)) != 0)
              die(fmt::format("{}: {} read back differs from what was written", dir,
                              array_names[a]));
          checked = true;
        }
      }
  check(st::remove_tree(dir), "remove");
}

double mb(double bytes) { return bytes / 1e6; }
double ms(double s) { return s * 1e3; }

void print_write_table(const std::vector<case_result>& rs) {
  fmt::print("## write: checkpoint against dd conv=fsync of the same bytes (medians)\n\n"
             "| state | parameters | S | MB | checkpoint ms | checkpoint MB/s | dd ms | dd MB/s "
             "| checkpoint / dd | goal (>= 80%) | pairs: ratio min-max, met |\n"
             "|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : rs) {
    const double c = median(r.ckpt_s), d = median(r.dd_s);
    const double b = static_cast<double>(r.bytes);
    double lo = 1e30, hi = 0; // each checkpoint against the dd run right after it
    int met = 0;
    for (size_t i = 0; i < r.ckpt_s.size(); ++i) {
      const double q = r.dd_s[i] / r.ckpt_s[i];
      lo = std::min(lo, q), hi = std::max(hi, q), met += q >= 0.80;
    }
    fmt::print("| {} | {} | {} | {:.1f} | {:.1f} | {:.0f} | {:.1f} | {:.0f} | {:.0f}% | {} | "
               "{:.0f}-{:.0f}%, {}/{} |\n",
               r.state_name, r.params, r.S, mb(b), ms(c), mb(b) / c, ms(d), mb(b) / d,
               100.0 * d / c, verdict(d / c >= 0.80), 100.0 * lo, 100.0 * hi, met,
               r.ckpt_s.size());
  }
  fmt::print("\n## where the write's time goes (medians) and xxh64 alone\n\n"
             "| state | S | pieces | file bytes MB (holes included) | begin ms | write_shard "
             "(write + fsync) ms | commit ms (3 fsyncs, 2 renames) | one directory fsync alone "
             "ms | xxh64 alone ms (in memory) | xxh64 GB/s |\n"
             "|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : rs)
    fmt::print("| {} | {} | {} | {:.2f} | {:.2f} | {:.1f} | {:.2f} | {:.2f} | {:.2f} | {:.1f} |\n",
               r.state_name, r.S, r.pieces, mb(static_cast<double>(r.file_bytes)),
               ms(median(r.begin_s)), ms(median(r.shards_s)), ms(median(r.commit_s)),
               ms(median(r.dirsync_s)), ms(r.hash_s),
               static_cast<double>(r.bytes) / r.hash_s / 1e9);
  fmt::print("\n");
}

std::string cache_label(const case_result& r, int warm) {
  const char* kind = r.resident_max[warm] < 0.01 ? "cold"
                     : r.resident_min[warm] > 0.95 ? "warm" : "mixed";
  if (r.resident_min[warm] == r.resident_max[warm])
    return fmt::format("{} ({:.0f}% resident)", kind, 100.0 * r.resident_min[warm]);
  return fmt::format("{} ({:.0f}-{:.0f}% resident)", kind, 100.0 * r.resident_min[warm],
                     100.0 * r.resident_max[warm]);
}

void print_load_table(const std::vector<case_result>& rs) {
  fmt::print("## load: open + read_range of every array (checked) against read(2) and cat "
             "of the shard files (medians)\n\n"
             "| state | S | cache before each read | load ms | of which open ms | read() ms | "
             "read() MB/s | cat ms | xxh64 alone ms | load / read() | goal (<= 2x) |\n"
             "|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : rs)
    for (int warm = 0; warm < 2; ++warm) {
      const double l = median(r.load_s[warm]), rd = median(r.read_s[warm]);
      fmt::print("| {} | {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.0f} | {:.2f} | {:.2f} | {:.2f}x "
                 "| {} |\n",
                 r.state_name, r.S, cache_label(r, warm), ms(l), ms(median(r.open_s[warm])),
                 ms(rd), mb(static_cast<double>(r.file_bytes)) / rd, ms(median(r.cat_s[warm])),
                 ms(r.hash_s), l / rd, verdict(l / rd <= 2.0));
    }
  fmt::print("\n");
}

/// Every (state, S) case: the default model's state, 2.5M and (unless
/// quick) 25M parameters, each at S = 1 and 2.
std::vector<case_result> run_all(bool quick, const std::string& work, int reps) {
  std::vector<state (*)()> makers = {
    default_model_state,
    [] { return make_state("2.5M", 2'500'000, synthetic_index(2'500'000, 16, 512)); },
  };
  if (!quick)
    makers.push_back(
      [] { return make_state("25M", 25'000'000, synthetic_index(25'000'000, 16, 1024)); });
  std::vector<case_result> results;
  for (auto make : makers) {
    const state s = make();
    const double hash = hash_alone_s(s);
    for (uint32_t S : {1u, 2u}) {
      if (stop_requested)
        break;
      case_result r;
      r.state_name = s.name;
      r.params = s.params;
      r.bytes = s.bytes();
      r.S = S;
      r.hash_s = hash;
      write_phase(s, S, work, reps, r);
      if (!stop_requested)
        load_phase(s, work, reps, r);
      results.push_back(std::move(r));
    }
    fmt::print(stderr, "cmesh_bench_storage: {} ({} parameters, {} tensors) done\n", s.name,
               s.params, s.index.size());
  }
  return results;
}

void print_notes(int reps) {
  fmt::print(
    "MB = 10^6 bytes of the three f32 arrays (weights, adam_m, adam_v); the files also hold\n"
    "the alignment holes (every piece starts at a multiple of 4096), never written. The\n"
    "checkpoint is timed from begin to commit's return: the shard files written and\n"
    "fsynced, the manifest written, fsynced and renamed, the directory fsynced, renamed\n"
    "into place, the root fsynced. dd runs `dd bs=8M conv=fsync` once per shard file (its\n"
    "bytes, from a cached file of the same bytes), as a child process, timed end to end.\n"
    "Before each timed run: syncfs of the directory's file system, and the previous run's\n"
    "files removed; one untimed round of each first. 'pairs': each checkpoint's MB/s over\n"
    "the dd run right after it, lowest and highest, and how many met 80%. xxh64 alone:\n"
    "the three arrays hashed in memory by this process (best of 3). One directory fsync\n"
    "alone: an empty file created, its directory fsynced (a journal commit), per round.\n"
    "The load is checkpoint::open (manifest, validation, file sizes) and\n"
    "read_range of each array whole, every piece's xxh64 checked, data compared once\n"
    "with what was written; read() is the shard files read whole into memory, 8 MiB per\n"
    "call; cat runs `cat FILES > /dev/null`. Cold: the files fsynced and their pages\n"
    "dropped (posix_fadvise DONTNEED) before each read; 'resident' is mincore's share of\n"
    "the shard files' pages just before it (a hypervisor's or a disk's own cache is not\n"
    "seen). Figures are medians of {} runs on a {}-core machine shared with other work;\n"
    "compare the ratios, measured side by side, rather than absolute rates.\n\n",
    reps, std::thread::hardware_concurrency());
}

} // namespace

int main(int argc, char** argv) {
  std::string dir = "/tmp";
  int reps = 5;
  bool quick = false, reps_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--dir" && i + 1 < argc)
      dir = argv[++i];
    else if (a == "--reps" && i + 1 < argc)
      reps = std::max(1, std::atoi(argv[++i])), reps_given = true;
    else if (a == "--quick")
      quick = true;
    else if (a == "--verbose")
      verbose = true;
    else {
      fmt::print(stderr,
                 "usage: cmesh_bench_storage [--dir DIR] [--reps N] [--quick] [--verbose]\n");
      return 2;
    }
  }
  if (quick && !reps_given)
    reps = 2;
  const auto work = st::join(dir, fmt::format("cmesh_bench_storage.{}", ::getpid()));
  check(st::make_dir(work), "work directory");
  work_dir = work;
  check(st::make_dir(st::join(work, "ckpt")), "checkpoint root");
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);

  std::string load = "?";
  if (std::ifstream f("/proc/loadavg"); f)
    f >> load; // other work on the cores and the disk skews every figure below
  // The mount's type, device and options (discard, a journal mode: they
  // change what an fsync costs); statfs's name where findmnt is missing.
  auto mount = first_line_of(fmt::format("findmnt -no FSTYPE,SOURCE,OPTIONS -T '{}' 2>/dev/null "
                                         "| awk '{{print $1 \" on \" $2 \" (\" $3 \")\"}}'",
                                         work));
  if (mount == "?" || mount.empty())
    mount = first_line_of(fmt::format("stat -f -c %T '{}' 2>/dev/null", work));
  fmt::print("# storage benchmark: checkpoint write and load in {} ({}), {} cores (load "
             "average {} at the start), {} repetition(s) each, interleaved\n\n",
             dir, mount, std::thread::hardware_concurrency(), load, reps);

  auto results = run_all(quick, work, reps);
  check(st::remove_tree(work), "cleanup");
  if (stop_requested) {
    fmt::print(stderr, "cmesh_bench_storage: interrupted; {} removed\n", work);
    return 130;
  }
  print_write_table(results);
  print_load_table(results);
  print_notes(reps);
  return 0;
}
