#include "spmdx/config/config.h"

#include <toml++/toml.h>

#include <algorithm>

#include "spmdx/core/text.h"
#include <cmath>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

namespace spmdx::config {
namespace {

using L = std::vector<std::string>;


// " (did you mean 'x'?)" for the nearest of `known`, when near enough.
std::string did_you_mean(const std::string& word, const std::vector<std::string>& known) {
  std::string best;
  std::size_t best_d = std::numeric_limits<std::size_t>::max();
  for (const auto& k : known) {
    const std::size_t d = edit_distance(word, k);
    if (d < best_d) best_d = d, best = k;
  }
  if (best.empty() || best_d > std::max<std::size_t>(2, word.size() / 3)) return "";
  return "; did you mean '" + best + "'?";
}

const char* type_name(Type t) {
  switch (t) {
    case Type::integer: return "an integer";
    case Type::floating: return "a number";
    case Type::boolean: return "true or false";
    case Type::string: return "a string";
    case Type::string_list: return "a list of strings";
  }
  return "?";
}

const KeySpec* find_spec(const std::string& key) {
  for (const auto& s : schema()) {
    if (s.key == key) return &s;
  }
  return nullptr;
}

std::vector<std::string> all_keys() {
  std::vector<std::string> out;
  for (const auto& s : schema()) out.push_back(s.key);
  return out;
}

std::string at_line(const std::string& source, const toml::source_region& region) {
  return source + ":" + std::to_string(region.begin.line) + ":" + std::to_string(region.begin.column);
}

// Checks a value against its spec: range and choices.
void check_value(const KeySpec& spec, const Value& v, const std::string& at) {
  auto fail = [&](const std::string& why) { throw ConfigError(at + ": " + spec.key + " " + why); };
  auto bounds = [&] {
    std::ostringstream s;
    s << "must be between " << spec.min << " and " << spec.max;
    return s.str();
  };
  if (auto* i = std::get_if<std::int64_t>(&v); i && (static_cast<double>(*i) < spec.min || static_cast<double>(*i) > spec.max)) {
    fail("is " + std::to_string(*i) + ", " + (spec.max < 1e299 ? bounds() : "must be >= " + std::to_string(static_cast<std::int64_t>(spec.min))));
  }
  if (auto* f = std::get_if<double>(&v); f && (!std::isfinite(*f) || *f < spec.min || *f > spec.max)) {
    std::ostringstream s;
    s << "is " << *f << ", " << (std::isfinite(*f) ? (spec.max < 1e299 ? bounds() : "must be >= " + std::to_string(spec.min)) : "must be a finite number");
    fail(s.str());
  }
  if (auto* s = std::get_if<std::string>(&v); s && !spec.choices.empty() &&
                                               std::find(spec.choices.begin(), spec.choices.end(), *s) == spec.choices.end()) {
    std::string list;
    for (const auto& c : spec.choices) list += (list.empty() ? "" : ", ") + c;
    fail("is \"" + *s + "\", expected one of " + list + did_you_mean(*s, spec.choices));
  }
}

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) out += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
  return out + "\"";
}

std::string value_toml(const Value& v) {
  struct V {
    std::string operator()(std::int64_t x) const { return std::to_string(x); }
    std::string operator()(double x) const {
      char buf[64];
      const auto r = std::to_chars(buf, buf + sizeof buf, x);  // the shortest text that reads back exactly
      std::string t(buf, r.ptr);
      if (t.find_first_of(".eEn") == std::string::npos) t += ".0";
      return t;
    }
    std::string operator()(bool x) const { return x ? "true" : "false"; }
    std::string operator()(const std::string& x) const { return quote(x); }
    std::string operator()(const std::vector<std::string>& x) const {
      std::string out = "[";
      for (std::size_t i = 0; i < x.size(); ++i) out += (i ? ", " : "") + quote(x[i]);
      return out + "]";
    }
  };
  return std::visit(V{}, v);
}

}  // namespace

namespace {
KeySpec k(std::string key, Type type, Value default_value, std::string help, double min = -1e300, std::vector<std::string> choices = {},
          double max = 1e300) {
  return KeySpec{std::move(key), type, std::move(default_value), std::move(help), min, max, std::move(choices)};
}
// A number with bounds.
KeySpec n(std::string key, Type type, Value default_value, std::string help, double min, double max) {
  return k(std::move(key), type, std::move(default_value), std::move(help), min, {}, max);
}
}  // namespace

const std::vector<KeySpec>& schema() {
  static const std::vector<KeySpec> keys = {
      k("job.dump_folder", Type::string, std::string("./outputs"), "where metrics, checkpoints, graphs and traces go"),
      n("job.seed", Type::integer, std::int64_t{42}, "seed of parameter initialisation", 0, 9.2e18),
      k("model.name", Type::string, std::string("llama"), "model", -1e300, L{"llama", "mlp"}),
      k("model.flavor", Type::string, std::string("debugmodel"), "model size", -1e300, L{"tiny", "debugmodel"}),
      k("model.tokenizer", Type::string, std::string("byte"), "\"byte\", or a Hugging Face tokenizer.json (or its folder)"),
      n("training.steps", Type::integer, std::int64_t{10}, "optimizer steps", 1, 1e9),
      n("training.global_batch_size", Type::integer, std::int64_t{-1}, "rows per step over all ranks (-1: local x data-parallel degree)", -1, 1e7),
      n("training.local_batch_size", Type::integer, std::int64_t{8}, "rows per step per data-parallel rank (when global is -1)", 1, 1e6),
      n("training.seq_len", Type::integer, std::int64_t{256}, "tokens per row", 1, 1e7),
      n("training.max_norm", Type::floating, 1.0, "clip the global gradient norm to this (0: off)", 0, 1e30),
      k("training.device", Type::string, std::string("cpu"), "where tensors live", -1e300, L{"cpu", "cuda"}),
      k("optimizer.name", Type::string, std::string("AdamW"), "optimizer", -1e300, L{"AdamW"}),
      n("optimizer.lr", Type::floating, 8e-4, "peak learning rate", 0, 1e3),
      n("optimizer.beta1", Type::floating, 0.9, "AdamW beta1", 0, 1),
      n("optimizer.beta2", Type::floating, 0.95, "AdamW beta2", 0, 1),
      n("optimizer.eps", Type::floating, 1e-8, "AdamW eps", 0, 1),
      n("optimizer.weight_decay", Type::floating, 0.1, "AdamW decoupled weight decay", 0, 1e3),
      n("lr_scheduler.warmup_steps", Type::integer, std::int64_t{2}, "linear warm-up steps", 0, 1e9),
      k("lr_scheduler.decay_type", Type::string, std::string("linear"), "decay after warm-up", -1e300, L{"linear"}),
      n("lr_scheduler.min_lr_factor", Type::floating, 0.0, "the decay ends at lr x this", 0, 1),
      k("data.paths", Type::string_list, L{}, "text or JSON Lines files (\"text\" field)"),
      n("data.seed", Type::integer, std::int64_t{0}, "seed of batch sampling", 0, 9.2e18),
      n("parallelism.data_parallel_replicate_degree", Type::integer, std::int64_t{1}, "DDP degree (mesh dim dp_replicate)", 1, 1e6),
      n("parallelism.data_parallel_shard_degree", Type::integer, std::int64_t{-1}, "FSDP degree (mesh dim dp_shard; -1: the ranks left)", -1, 1e6),
      n("parallelism.tensor_parallel_degree", Type::integer, std::int64_t{1}, "Megatron TP degree (mesh dim tp)", 1, 1e6),
      k("parallelism.fsdp_reshard_after_forward", Type::string, std::string("default"), "free gathered parameters after forward", -1e300,
       L{"default", "never", "always"}),
      k("comm.backend", Type::string, std::string("ucx"), "comm plugin for collectives, \"name\" or \"name:key=value;...\" (ucx:tls=tcp,self)"),
      n("comm.timeout_seconds", Type::floating, 300.0, "a collective that takes longer fails, naming the peer", 1, 1e6),
      n("comm.swap_at_step", Type::integer, std::int64_t{0}, "hot-swap between backend and swap_to every this many steps (0: never)", 0, 1e9),
      k("comm.swap_to", Type::string, std::string(""), "the backend to swap to"),
      n("comm.bucket_cap_mb", Type::floating, 25.0, "gradient all_reduces fused into buckets of this many MiB (0: off; DDP's bucket_cap_mb)", 0, 1e6),
      n("comm.first_bucket_cap_mb", Type::floating, 1.0, "the first bucket's cap, MiB: small, so communication starts early in the backward", 0, 1e6),
      k("comm.overlap", Type::boolean, true, "issue collectives early and wait late (false: wait right after each)"),
      k("comm.prefetch", Type::boolean, true, "FSDP: all_gather the next layer's parameters while the current layer computes"),
      k("hooks.enable", Type::string_list, L{}, "debug hook plugins to run"),
      k("checkpoint.enable", Type::boolean, false, "write checkpoints"),
      k("checkpoint.folder", Type::string, std::string("checkpoint"), "under job.dump_folder"),
      n("checkpoint.interval", Type::integer, std::int64_t{10}, "steps between checkpoints", 1, 1e9),
      n("checkpoint.load_step", Type::integer, std::int64_t{-1}, "resume from this step (-1: the latest, if any)", -1, 1e9),
      n("metrics.log_freq", Type::integer, std::int64_t{1}, "print a line every this many steps", 1, 1e9),
      k("plugins.paths", Type::string_list, L{}, "plugin files or folders searched first"),
  };
  return keys;
}

Config::Config() {
  for (const auto& s : schema()) values_[s.key] = s.default_value;
}

Config Config::load(const std::string& path) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(st)) throw ConfigError(path + ": no such config file");
  if (!std::filesystem::is_regular_file(st)) throw ConfigError(path + ": not a regular file (a folder, FIFO or device); name a TOML file");
  std::ifstream in(path);
  if (!in) throw ConfigError(path + ": cannot read the config file: " + std::strerror(errno));
  std::stringstream text;
  text << in.rdbuf();
  return parse(text.str(), path);
}

Config Config::parse(const std::string& text, const std::string& source) {
  Config cfg;
  cfg.source_ = source;
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw ConfigError(at_line(source, e.source()) + ": " + std::string(e.description()));
  }
  std::set<std::string> sections;
  for (const auto& s : schema()) sections.insert(s.key.substr(0, s.key.find('.')));
  for (const auto& [section_key, section_node] : root) {
    const std::string section(section_key.str());
    const toml::table* table = section_node.as_table();
    if (table == nullptr) {
      std::string home;
      for (const auto& key : all_keys()) {
        if (key.size() > section.size() && key.compare(key.size() - section.size() - 1, std::string::npos, "." + section) == 0) {
          home = key.substr(0, key.size() - section.size() - 1);
        }
      }
      throw ConfigError(at_line(source, section_node.source()) + ": key '" + section + "' is outside any [section]" +
                        (home.empty() ? std::string() : "; put it under [" + home + "]"));
    }
    if (!sections.count(section)) {
      throw ConfigError(at_line(source, section_node.source()) + ": unknown section '" + section + "'" +
                        did_you_mean(section, std::vector<std::string>(sections.begin(), sections.end())));
    }
    for (const auto& [name_key, node] : *table) {
      const std::string key = section + "." + std::string(name_key.str());
      const std::string at = at_line(source, node.source());
      if (section == "hooks" && node.is_table()) {  // [hooks.<name>]: that hook's options
        auto& options = cfg.plugin_options_[key];
        for (const auto& [opt_key, opt] : *node.as_table()) {
          const std::string opt_at = at_line(source, opt.source());
          if (auto x = opt.value_exact<std::string>()) {
            options[std::string(opt_key.str())] = *x;
          } else if (auto i = opt.value_exact<std::int64_t>()) {
            options[std::string(opt_key.str())] = std::to_string(*i);
          } else if (auto d = opt.value_exact<double>()) {
            std::ostringstream text;
            text << *d;
            options[std::string(opt_key.str())] = text.str();
          } else if (auto b = opt.value_exact<bool>()) {
            options[std::string(opt_key.str())] = *b ? "true" : "false";
          } else {
            throw ConfigError(opt_at + ": " + key + "." + std::string(opt_key.str()) + " must be a string, number or boolean");
          }
        }
        continue;
      }
      const KeySpec* spec = find_spec(key);
      if (spec == nullptr) throw ConfigError(at + ": unknown key '" + key + "'" + did_you_mean(key, all_keys()));
      Value v;
      bool ok = true;
      switch (spec->type) {
        case Type::integer:
          if (auto x = node.value_exact<std::int64_t>()) v = *x; else ok = false;
          break;
        case Type::floating:
          if (auto x = node.value_exact<double>()) v = *x;
          else if (auto y = node.value_exact<std::int64_t>()) v = static_cast<double>(*y);
          else ok = false;
          break;
        case Type::boolean:
          if (auto x = node.value_exact<bool>()) v = *x; else ok = false;
          break;
        case Type::string:
          if (auto x = node.value_exact<std::string>()) v = *x; else ok = false;
          break;
        case Type::string_list:
          if (const toml::array* arr = node.as_array()) {
            std::vector<std::string> items;
            for (const auto& item : *arr) {
              if (auto x = item.value_exact<std::string>()) items.push_back(*x); else ok = false;
            }
            v = items;
          } else {
            ok = false;
          }
          break;
      }
      if (!ok) throw ConfigError(at + ": " + key + " must be " + type_name(spec->type));
      check_value(*spec, v, at);
      cfg.values_[key] = v;
    }
  }
  return cfg;
}

void Config::override_value(const std::string& key, const std::string& text) {
  const std::string at = "command line: --" + key;
  if (key.rfind("hooks.", 0) == 0 && std::count(key.begin(), key.end(), '.') == 2) {  // --hooks.<name>.<option>
    const auto dot = key.rfind('.');
    if (dot == 6 || dot + 1 == key.size()) throw ConfigError(at + ": expected --hooks.<hook>.<option> value");
    plugin_options_[key.substr(0, dot)][key.substr(dot + 1)] = text;
    return;
  }
  const KeySpec* spec = find_spec(key);
  if (spec == nullptr) throw ConfigError(at + ": unknown key '" + key + "'" + did_you_mean(key, all_keys()));
  Value v;
  try {
    std::size_t used = 0;
    switch (spec->type) {
      case Type::integer: v = static_cast<std::int64_t>(std::stoll(text, &used)); break;
      case Type::floating: v = std::stod(text, &used); break;
      case Type::boolean:
        if (text != "true" && text != "false") throw std::invalid_argument("bool");
        v = text == "true";
        used = text.size();
        break;
      case Type::string: v = text; used = text.size(); break;
      case Type::string_list: {
        std::vector<std::string> items;
        std::stringstream s(text);
        std::string item;
        while (std::getline(s, item, ',')) {
          if (!item.empty()) items.push_back(item);
        }
        v = items;
        used = text.size();
        break;
      }
    }
    if (used != text.size()) throw std::invalid_argument("trailing text");
  } catch (const std::logic_error&) {
    throw ConfigError(at + " " + text + ": " + key + " must be " + type_name(spec->type));
  }
  check_value(*spec, v, at);
  values_[key] = v;
  overrides_[key] = text;
}

std::string Config::where(const std::vector<std::string>& keys) const {
  std::string given;
  bool all = !keys.empty();
  for (const auto& key : keys) {
    auto it = overrides_.find(key);
    if (it == overrides_.end()) {
      all = false;
      continue;
    }
    given += (given.empty() ? "command line --" : ", --") + key + " " + it->second;
  }
  const std::string file = source_.empty() ? "config" : source_;
  if (given.empty()) return file;
  return all ? given : file + " with " + given;
}

const Value& Config::get(const std::string& key) const {
  auto it = values_.find(key);
  if (it == values_.end()) throw std::out_of_range("no config key '" + key + "'");
  return it->second;
}

std::int64_t Config::get_int(const std::string& key) const { return std::get<std::int64_t>(get(key)); }
double Config::get_float(const std::string& key) const { return std::get<double>(get(key)); }
bool Config::get_bool(const std::string& key) const { return std::get<bool>(get(key)); }
const std::string& Config::get_string(const std::string& key) const { return std::get<std::string>(get(key)); }
const std::vector<std::string>& Config::get_list(const std::string& key) const { return std::get<std::vector<std::string>>(get(key)); }

std::string Config::to_toml() const {
  std::ostringstream out;
  std::string section;
  for (const auto& s : schema()) {
    const std::string sec = s.key.substr(0, s.key.find('.'));
    if (sec != section) {
      out << (section.empty() ? "" : "\n") << "[" << sec << "]\n";
      section = sec;
    }
    out << s.key.substr(sec.size() + 1) << " = " << value_toml(values_.at(s.key)) << "  # " << s.help << "\n";
  }
  for (const auto& [table, options] : plugin_options_) {
    out << "\n[" << table << "]\n";
    for (const auto& [k, v] : options) out << k << " = " << quote(v) << "\n";
  }
  return out.str();
}

std::map<std::string, std::string> Config::settings() const {
  std::map<std::string, std::string> out;
  for (const auto& [key, v] : values_) out[key] = value_toml(v);
  for (const auto& [table, options] : plugin_options_) {
    for (const auto& [k, v] : options) out[table + "." + k] = quote(v);
  }
  return out;
}

const std::map<std::string, std::string>& Config::plugin_options(const std::string& table) const {
  static const std::map<std::string, std::string> none;
  auto it = plugin_options_.find(table);
  return it == plugin_options_.end() ? none : it->second;
}

}  // namespace spmdx::config
