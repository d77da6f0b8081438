#include "model/config.hpp"

#include <fmt/format.h>
#include <toml++/toml.h>
#include <xxhash.h>

#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <vector>

namespace cmesh::model {

namespace {

/// One known key: reads its value into the config, or says what is wrong.
using setter = std::function<std::string(const toml::node&, run_config&)>;

std::string read_size(const toml::node& n, size_t& out, size_t min_value) {
  auto v = n.value<int64_t>();
  if (!v || n.type() != toml::node_type::integer)
    return "must be an integer";
  if (*v < static_cast<int64_t>(min_value))
    return "must be at least " + std::to_string(min_value);
  out = static_cast<size_t>(*v);
  return {};
}

std::string read_double(const toml::node& n, double& out, double lo, double hi) {
  auto v = n.value<double>();
  if (!v)
    return "must be a number";
  if (*v < lo || *v > hi)
    return "must be within [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  out = *v;
  return {};
}

// A key added here changes what a run computes: add it to
// canonical_config too (config.test.cpp checks that every key is there).
std::map<std::string, std::map<std::string, setter>> schema() {
  std::map<std::string, std::map<std::string, setter>> s;
  auto size_key = [](auto field, size_t min_value) -> setter {
    return [=](const toml::node& n, run_config& c) { return read_size(n, field(c), min_value); };
  };
  auto double_key = [](auto field, double lo, double hi) -> setter {
    return [=](const toml::node& n, run_config& c) { return read_double(n, field(c), lo, hi); };
  };
  // A string that must be one of the given values.
  auto choice_key = [](auto field, std::string a, std::string b,
                       std::string c3 = {}) -> setter {
    return [=](const toml::node& n, run_config& c) -> std::string {
      auto v = n.value<std::string>();
      if (!v || (*v != a && *v != b && (c3.empty() || *v != c3)))
        return c3.empty() ? "must be \"" + a + "\" or \"" + b + "\""
                          : "must be \"" + a + "\", \"" + b + "\" or \"" + c3 + "\"";
      field(c) = *v;
      return {};
    };
  };
  auto bool_key = [](auto field) -> setter {
    return [=](const toml::node& n, run_config& c) -> std::string {
      auto v = n.value<bool>();
      if (!v || n.type() != toml::node_type::boolean)
        return "must be true or false";
      field(c) = *v;
      return {};
    };
  };
  auto& m = s["model"];
  m["d_model"] = size_key([](run_config& c) -> size_t& { return c.model.d_model; }, 1);
  m["context"] = size_key([](run_config& c) -> size_t& { return c.model.context; }, 1);
  m["layers"] = size_key([](run_config& c) -> size_t& { return c.model.layers; }, 0);
  m["ffn"] = size_key([](run_config& c) -> size_t& { return c.model.ffn; }, 1);
  m["experts"] = size_key([](run_config& c) -> size_t& { return c.model.experts; }, 1);
  m["top_k"] = size_key([](run_config& c) -> size_t& { return c.model.top_k; }, 1);
  m["expert_ffn"] = size_key([](run_config& c) -> size_t& { return c.model.expert_ffn; }, 1);
  m["capacity_factor"] =
    double_key([](run_config& c) -> double& { return c.model.capacity_factor; }, 0.01, 1e6);
  m["aux_loss_weight"] =
    double_key([](run_config& c) -> double& { return c.model.aux_loss_weight; }, 0, 1e6);
  m["activations"] =
    choice_key([](run_config& c) -> std::string& { return c.model.activations; }, "fp32", "bf16");
  m["products"] =
    choice_key([](run_config& c) -> std::string& { return c.model.products; }, "auto", "fp32",
               "bf16");
  m["init_seed"] = [](const toml::node& n, run_config& c) {
    size_t v = 0;
    auto e = read_size(n, v, 0);
    c.model.init_seed = v;
    return e;
  };
  auto& t = s["train"];
  t["steps"] = size_key([](run_config& c) -> size_t& { return c.train.steps; }, 1);
  t["global_batch"] = size_key([](run_config& c) -> size_t& { return c.train.global_batch; }, 1);
  t["micro_batch"] = size_key([](run_config& c) -> size_t& { return c.train.micro_batch; }, 1);
  t["seq_len"] = size_key([](run_config& c) -> size_t& { return c.train.seq_len; }, 1);
  t["warmup"] = size_key([](run_config& c) -> size_t& { return c.train.warmup; }, 0);
  t["log_every"] = size_key([](run_config& c) -> size_t& { return c.train.log_every; }, 1);
  t["verify_every"] = size_key([](run_config& c) -> size_t& { return c.train.verify_every; }, 0);
  t["lr"] = double_key([](run_config& c) -> double& { return c.train.lr; }, 0, 10);
  t["weight_decay"] = double_key([](run_config& c) -> double& { return c.train.weight_decay; }, 0, 10);
  t["beta1"] = double_key([](run_config& c) -> double& { return c.train.beta1; }, 0, 0.999999);
  t["beta2"] = double_key([](run_config& c) -> double& { return c.train.beta2; }, 0, 0.999999);
  t["eps"] = double_key([](run_config& c) -> double& { return c.train.eps; }, 1e-30, 1);
  t["grad_clip"] = double_key([](run_config& c) -> double& { return c.train.grad_clip; }, 0, 1e9);
  t["loss_scale"] = double_key([](run_config& c) -> double& { return c.train.loss_scale; }, 1, 3e38);
  t["seed"] = [](const toml::node& n, run_config& c) {
    size_t v = 0;
    auto e = read_size(n, v, 0);
    c.train.seed = v;
    return e;
  };
  t["exact"] = bool_key([](run_config& c) -> bool& { return c.train.exact; });
  t["overlap"] = bool_key([](run_config& c) -> bool& { return c.train.overlap; });
  t["precision"] = choice_key([](run_config& c) -> std::string& { return c.train.precision; },
                              "fp32", "bf16");
  t["sharding"] = choice_key([](run_config& c) -> std::string& { return c.train.sharding; },
                             "optimizer", "full");
  t["experts"] = choice_key([](run_config& c) -> std::string& { return c.train.experts; },
                            "replicated", "resident");
  t["expert_placement"] = choice_key(
    [](run_config& c) -> std::string& { return c.train.expert_placement; }, "balanced", "static");
  t["device"] =
    choice_key([](run_config& c) -> std::string& { return c.train.device; }, "cpu", "cuda",
               "emulated");
  t["gradient_collectives"] = choice_key(
    [](run_config& c) -> std::string& { return c.train.gradient_collectives; }, "device", "host");
  t["expert_replicas"] =
    size_key([](run_config& c) -> size_t& { return c.train.expert_replicas; }, 0);
  s["data"]["file"] = [](const toml::node& n, run_config& c) -> std::string {
    auto v = n.value<std::string>();
    if (!v)
      return "must be a string";
    c.data.file = *v;
    return {};
  };
  return s;
}

caf::error bad(const std::string& what) {
  return make_error(errc::invalid_argument, "config: " + what);
}

/// What the data is, whatever its path: "synthetic", or the xxh64 and size
/// of the file's bytes, read once in 1 MiB pieces.
expected<std::string> data_identity(const data_config& d) {
  if (d.file.empty())
    return std::string("synthetic");
  std::ifstream in(d.file, std::ios::binary);
  if (!in)
    return make_error(errc::invalid_argument, "data: cannot read " + d.file);
  std::unique_ptr<XXH64_state_t, decltype(&XXH64_freeState)> h(XXH64_createState(),
                                                               &XXH64_freeState);
  XXH64_reset(h.get(), 0);
  std::vector<char> buf(size_t{1} << 20);
  uint64_t size = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const auto n = static_cast<size_t>(in.gcount());
    XXH64_update(h.get(), buf.data(), n);
    size += n;
  }
  if (in.bad())
    return make_error(errc::invalid_argument, "data: error reading " + d.file);
  return fmt::format("xxh64 {:016x}, {} bytes", XXH64_digest(h.get()), size);
}

} // namespace

expected<run_config> parse_config(const std::string& text) {
  toml::table root;
  try {
    root = toml::parse(text);
  } catch (const toml::parse_error& e) {
    std::ostringstream os;
    os << e.description() << " at line " << e.source().begin.line;
    return bad(os.str());
  }
  run_config c;
  auto keys = schema();
  for (auto&& [section, node] : root) {
    auto s = keys.find(std::string(section.str()));
    if (s == keys.end())
      return bad("unknown section [" + std::string(section.str()) + "]");
    auto* tbl = node.as_table();
    if (tbl == nullptr)
      return bad("'" + std::string(section.str()) + "' must be a table");
    for (auto&& [key, value] : *tbl) {
      auto k = s->second.find(std::string(key.str()));
      if (k == s->second.end())
        return bad("unknown key '" + std::string(key.str()) + "' in [" + s->first + "]");
      if (auto why = k->second(value, c); !why.empty())
        return bad(s->first + "." + std::string(key.str()) + " " + why);
    }
  }
  // bf16 training keeps bf16 activations unless the file says otherwise.
  const auto* model_table = root["model"].as_table();
  if (c.train.precision == "bf16" && (!model_table || !model_table->contains("activations")))
    c.model.activations = "bf16";
  if (auto e = validate(c, 1, 1))
    return e;
  return c;
}

std::vector<std::string> config_keys() {
  std::vector<std::string> out;
  for (auto& [section, keys] : schema())
    for (auto& [key, set] : keys)
      out.push_back(section + "." + key);
  return out;
}

expected<run_config> load_config(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    return bad("cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_config(ss.str());
}

caf::error validate(const run_config& c, size_t replicas, size_t ranks_per_group) {
  const auto& m = c.model;
  const auto& t = c.train;
  if (m.top_k > m.experts)
    return bad("model.top_k (" + std::to_string(m.top_k) + ") exceeds model.experts ("
               + std::to_string(m.experts) + ")");
  if (t.global_batch % t.micro_batch != 0)
    return bad("train.global_batch (" + std::to_string(t.global_batch)
               + ") is not a multiple of train.micro_batch (" + std::to_string(t.micro_batch) + ")");
  if (replicas == 0 || ranks_per_group == 0)
    return bad("a layout needs at least one replica group of one rank");
  const size_t micro_batches = t.global_batch / t.micro_batch;
  if (micro_batches < replicas)
    return bad(std::to_string(micro_batches) + " micro-batches per step cannot feed "
               + std::to_string(replicas) + " replica groups");
  if (m.experts % ranks_per_group != 0)
    return bad("model.experts (" + std::to_string(m.experts)
               + ") does not divide over " + std::to_string(ranks_per_group) + " ranks per group");
  if (t.exact && t.precision != "fp32")
    return bad("exact mode needs train.precision = \"fp32\"");
  if (t.exact && m.activations != "fp32")
    return bad("exact mode needs model.activations = \"fp32\"");
  if (t.exact && m.products == "bf16")
    return bad("exact mode needs model.products = \"fp32\" (or \"auto\")");
  if (t.device != "cpu" && t.sharding == "full")
    return bad("train.sharding = \"full\" is not supported with device \"" + t.device
               + "\" yet");
  if (t.experts == "resident") {
    const auto not_yet = [&](const std::string& what) {
      return bad("train.experts = \"resident\" does not support " + what + " yet");
    };
    if (t.sharding != "optimizer")
      return not_yet("train.sharding = \"" + t.sharding + "\"");
    if (t.device != "cpu")
      return not_yet("train.device = \"" + t.device + "\"");
    if (t.precision != "fp32")
      return not_yet("train.precision = \"" + t.precision + "\"");
    if (t.expert_replicas != 0)
      return not_yet("train.expert_replicas (replicas of hot experts)");
  }
  if (t.exact && t.sharding == "full")
    return bad("exact mode needs train.sharding = \"optimizer\" (it turns each micro-batch's "
               "whole gradient into fixed point; full sharding hands gradients back tensor by "
               "tensor)");
  return {};
}

config_list canonical_layout(size_t replicas, size_t ranks_per_group) {
  return {{"cmesh.version", CMESH_VERSION},
          {"layout.replicas", std::to_string(replicas)},
          {"layout.ranks_per_group", std::to_string(ranks_per_group)}};
}

expected<config_list> canonical_config(const run_config& c, size_t replicas,
                                       size_t ranks_per_group) {
  auto data = data_identity(c.data);
  if (!data)
    return data.error();
  auto out = canonical_layout(replicas, ranks_per_group);
  // fmt's "{}" writes a double in the shortest form that reads back to the
  // same value: one text per value, on every node.
  auto add = [&](const char* key, const auto& value) {
    out.emplace_back(key, fmt::format("{}", value));
  };
  const auto& m = c.model;
  add("model.d_model", m.d_model);
  add("model.context", m.context);
  add("model.layers", m.layers);
  add("model.ffn", m.ffn);
  add("model.experts", m.experts);
  add("model.top_k", m.top_k);
  add("model.expert_ffn", m.expert_ffn);
  add("model.capacity_factor", m.capacity_factor);
  add("model.aux_loss_weight", m.aux_loss_weight);
  add("model.init_seed", m.init_seed);
  add("model.activations", m.activations);
  add("model.products", m.products);
  const auto& t = c.train;
  add("train.steps", t.steps);
  add("train.global_batch", t.global_batch);
  add("train.micro_batch", t.micro_batch);
  add("train.seq_len", t.seq_len);
  add("train.lr", t.lr);
  add("train.weight_decay", t.weight_decay);
  add("train.beta1", t.beta1);
  add("train.beta2", t.beta2);
  add("train.eps", t.eps);
  add("train.warmup", t.warmup);
  add("train.grad_clip", t.grad_clip);
  add("train.seed", t.seed);
  add("train.verify_every", t.verify_every); // the commit vote's content
  add("train.exact", t.exact);
  add("train.precision", t.precision);
  add("train.loss_scale", t.loss_scale);
  add("train.sharding", t.sharding);
  add("train.overlap", t.overlap);
  add("train.experts", t.experts);
  add("train.expert_placement", t.expert_placement);
  add("train.expert_replicas", t.expert_replicas);
  add("train.device", t.device);
  add("train.gradient_collectives", t.gradient_collectives);
  add("data.identity", *data);
  return out;
}

} // namespace cmesh::model
