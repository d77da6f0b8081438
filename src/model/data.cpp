#include "model/data.hpp"
#include "core/hash.hpp"

#include <fstream>
#include <iterator>
#include <random>

namespace cmesh::model {

namespace {

/// [begin, end) of part `i` when `n` items are dealt to `parts` in runs.
std::pair<size_t, size_t> run_of(size_t n, size_t parts, size_t i) {
  return {n * i / parts, n * (i + 1) / parts};
}

} // namespace

std::shared_ptr<const corpus> corpus::synthetic(size_t bytes) {
  // Sentences from a small grammar: enough structure for a byte model to
  // learn in minutes, enough variety not to be memorised at once.
  static const char* subjects[] = {"the cat", "a dog", "the old man", "my sister", "the robot",
                                   "a small bird", "the teacher", "our neighbour"};
  static const char* verbs[] = {"sees", "likes", "follows", "builds", "paints", "finds",
                                "carries", "remembers"};
  static const char* objects[] = {"a red ball", "the green door", "two apples", "the long road",
                                  "a quiet song", "the blue house", "three stones", "a paper boat"};
  static const char* tails[] = {" today", " again", " at night", " in the rain", "", " slowly",
                                " with care", ""};
  auto c = std::shared_ptr<corpus>(new corpus());
  c->origin_ = "synthetic";
  std::mt19937_64 rng(20261202);
  std::string text;
  text.reserve(bytes + 128);
  while (text.size() < bytes) {
    text += subjects[rng() % 8];
    text += ' ';
    text += verbs[rng() % 8];
    text += ' ';
    text += objects[rng() % 8];
    text += tails[rng() % 8];
    text += rng() % 4 == 0 ? ".\n" : ". ";
  }
  c->bytes_.assign(text.begin(), text.end());
  return c;
}

expected<std::shared_ptr<const corpus>> corpus::load(const data_config& d, size_t seq_len) {
  if (d.file.empty())
    return synthetic();
  std::ifstream in(d.file, std::ios::binary);
  if (!in)
    return make_error(errc::invalid_argument, "data: cannot read " + d.file);
  auto c = std::shared_ptr<corpus>(new corpus());
  c->bytes_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  c->origin_ = d.file;
  if (c->bytes_.size() < seq_len + 2)
    return make_error(errc::invalid_argument,
                      "data: " + d.file + " has " + std::to_string(c->bytes_.size())
                        + " bytes, fewer than one sample of " + std::to_string(seq_len + 1));
  return std::shared_ptr<const corpus>(std::move(c));
}

batch make_micro_batch(const corpus& c, const train_config& t, uint64_t step, size_t micro) {
  batch b;
  b.sequences = t.micro_batch;
  b.seq_len = t.seq_len;
  b.tokens.resize(b.sequences * (b.seq_len + 1));
  const size_t span = c.size() - (t.seq_len + 1) + 1;
  for (size_t i = 0; i < b.sequences; ++i) {
    uint64_t sample = micro * t.micro_batch + i;
    uint64_t start = splitmix64(splitmix64(t.seed ^ (step * 0x100000001b3ull)) ^ sample) % span;
    std::copy_n(c.data() + start, t.seq_len + 1, b.tokens.data() + i * (t.seq_len + 1));
  }
  return b;
}

std::vector<size_t> micro_batches_of(size_t micro_batches, size_t groups, size_t group_position,
                                     size_t ranks, size_t rank_in_group) {
  auto [g0, g1] = run_of(micro_batches, groups, group_position);
  auto [r0, r1] = run_of(g1 - g0, ranks, rank_in_group);
  std::vector<size_t> out;
  for (size_t m = g0 + r0; m < g0 + r1; ++m)
    out.push_back(m);
  return out;
}

} // namespace cmesh::model
