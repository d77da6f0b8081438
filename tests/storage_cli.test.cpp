// `cmesh checkpoint ls|verify|inspect` on checkpoints this test writes.
#include "node_harness.hpp"
#include "storage/reader.hpp"
#include "storage/testing.hpp"

#include <cctype>
#include <fstream>

using namespace cmesh;
using namespace cmesh::testing;
using namespace cmesh::storage::testing;

namespace {

/// A strict JSON reader that only says whether `s` is one JSON value (the
/// project has no JSON library; this is enough to catch bad escaping,
/// commas and brackets).
class json_check {
public:
  explicit json_check(const std::string& s) : s_(s) {}
  bool valid() {
    if (!value())
      return false;
    space();
    return i_ == s_.size();
  }

private:
  void space() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_])))
      ++i_;
  }
  bool eat(char c) {
    space();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  bool word(const std::string& w) {
    space();
    if (s_.compare(i_, w.size(), w) != 0)
      return false;
    i_ += w.size();
    return true;
  }
  bool string() {
    if (!eat('"'))
      return false;
    while (i_ < s_.size() && s_[i_] != '"') {
      if (static_cast<unsigned char>(s_[i_]) < 0x20)
        return false;
      if (s_[i_] == '\\') {
        ++i_;
        if (i_ >= s_.size() || std::string("\"\\/bfnrtu").find(s_[i_]) == std::string::npos)
          return false;
      }
      ++i_;
    }
    return eat('"');
  }
  bool number() {
    space();
    size_t start = i_;
    if (i_ < s_.size() && s_[i_] == '-')
      ++i_;
    while (i_ < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[i_])) || s_[i_] == '.'
                              || s_[i_] == 'e' || s_[i_] == 'E' || s_[i_] == '+' || s_[i_] == '-'))
      ++i_;
    return i_ > start && std::isdigit(static_cast<unsigned char>(s_[i_ - 1]));
  }
  template <class F>
  bool sequence(char close, F item) {
    if (eat(close))
      return true;
    do {
      if (!item())
        return false;
    } while (eat(','));
    return eat(close);
  }
  bool value() {
    space();
    if (i_ >= s_.size())
      return false;
    switch (s_[i_]) {
      case '{':
        ++i_;
        return sequence('}', [&] { return string() && eat(':') && value(); });
      case '[':
        ++i_;
        return sequence(']', [&] { return value(); });
      case '"': return string();
      case 't': return word("true");
      case 'f': return word("false");
      case 'n': return word("null");
      default: return number();
    }
  }
  const std::string& s_;
  size_t i_ = 0;
};

} // namespace

TEST_CASE("cmesh checkpoint ls, verify and inspect") {
  temp_dir root;
  REQUIRE(write_sample(root.path(), make_sample(100), 2));
  REQUIRE(write_sample(root.path(), make_sample(120, 2), 2));
  const auto step120 = root / "step-000000120";

  auto ls = run_cmesh("checkpoint ls " + root.path());
  INFO(ls.output);
  CHECK(ls.exit_code == 0);
  CHECK(contains(ls.output, "step-000000100  "));
  CHECK(contains(ls.output, "step-000000120  "));
  CHECK(contains(ls.output, "KiB"));
  CHECK(ls.output.find("step-000000100") < ls.output.find("step-000000120"));

  auto all = run_cmesh("checkpoint verify " + root.path());
  CHECK(all.exit_code == 0);
  CHECK(contains(all.output, "ok (verified)"));
  auto one = run_cmesh("checkpoint verify " + step120);
  CHECK(one.exit_code == 0);
  CHECK(contains(one.output, "step 120: ok (2 files,"));

  auto inspect = run_cmesh("checkpoint inspect " + step120);
  CHECK(inspect.exit_code == 0);
  CHECK(json_check(inspect.output).valid());
  CHECK(contains(inspect.output, "\"step\": 120,"));
  CHECK(contains(inspect.output, "\"name\": \"layer0.ffn.w1\""));
  CHECK(contains(inspect.output, "\"model.d_model\": \"32\""));
  auto newest = run_cmesh("checkpoint inspect " + root.path()); // a root: its newest
  CHECK(newest.exit_code == 0);
  CHECK(contains(newest.output, "\"step\": 120,"));

  // A flipped byte: verify fails with the typed error naming the file; ls
  // (manifest and sizes only) still lists the step, and inspect still prints it.
  auto c = storage::checkpoint::open(step120);
  REQUIRE(c);
  const auto& p = c->info().pieces.back();
  flip_byte(step120 + "/" + c->info().files[p.file].name, p.offset + 3);
  auto bad = run_cmesh("checkpoint verify " + step120);
  INFO(bad.output);
  CHECK(bad.exit_code == 1);
  CHECK(contains(bad.output, "cmesh: error: corrupt: " + step120 + "/shard-1.bin: "));
  CHECK(contains(bad.output, "checksum mismatch"));
  auto bad_all = run_cmesh("checkpoint verify " + root.path());
  CHECK(bad_all.exit_code == 1);
  CHECK(contains(bad_all.output, "step-000000100  "));
  CHECK(contains(bad_all.output, "corrupt: "));
  CHECK(contains(bad_all.output, "cmesh: error: 1 of the 2 checkpoints in " + root.path()
                                        + " is not valid"));
  CHECK(run_cmesh("checkpoint ls " + root.path()).exit_code == 0);
  CHECK(run_cmesh("checkpoint inspect " + step120).exit_code == 0);

  // A missing manifest: inspect and verify fail; usage errors exit 2.
  std::filesystem::remove(step120 + "/manifest.msgpack");
  auto gone = run_cmesh("checkpoint inspect " + step120);
  CHECK(gone.exit_code == 1);
  CHECK(contains(gone.output, "no manifest.msgpack"));
  CHECK(run_cmesh("checkpoint verify " + step120).exit_code == 1);
  CHECK(run_cmesh("checkpoint verify " + root / "nonexistent").exit_code == 2);
  CHECK(run_cmesh("checkpoint").exit_code == 2);
  auto empty = run_cmesh("checkpoint verify " + (root / "empty"), {}, 30s);
  CHECK(empty.exit_code == 2); // not a directory yet
  std::filesystem::create_directory(root / "empty");
  auto none = run_cmesh("checkpoint verify " + (root / "empty"));
  CHECK(none.exit_code == 1);
  CHECK(contains(none.output, "no checkpoint in"));
}
