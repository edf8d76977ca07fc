#include "spmdx/config/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <array>
#include <tuple>
#include <cstdio>

#include "spmdx/text.h"
#include "torchtitan_keys.h"
#include <cctype>
#include <cmath>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <fstream>
#include <set>
#include <sstream>

namespace spmdx::config {

std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7F) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04X", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

namespace {

using L = std::vector<std::string>;


// How far a typo may be from the word it was meant to be: 1 edit for words of up to 3
// characters, 2 up to 8, 3 beyond (so that 'dataset' is not taken for 'device').
std::size_t typo_distance(const std::string& word) { return word.size() <= 3 ? 1 : word.size() <= 8 ? 2 : 3; }

}  // namespace

std::string did_you_mean(const std::string& word, const std::vector<std::string>& known) {
  const std::string near = nearest_word(word, known, typo_distance(word));
  return near.empty() ? "" : "; did you mean '" + near + "'?";
}

namespace {

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

// The sections of spmdx's keys ("job", "model", ...), sorted.
std::vector<std::string> sections() {
  std::set<std::string> out;
  for (const auto& s : schema()) out.insert(s.key.substr(0, s.key.find('.')));
  return {out.begin(), out.end()};
}

// "unknown section 'optimzer'; did you mean 'optimizer'?": a section that is neither spmdx's
// nor torchtitan's, in a file ([optimzer]) or on the command line (--optimzer.lr).
std::string unknown_section(const std::string& section) { return "unknown section '" + section + "'" + did_you_mean(section, sections()); }

std::string at_line(const std::string& source, const toml::source_region& region) {
  return source + ":" + std::to_string(region.begin.line) + ":" + std::to_string(region.begin.column);
}

// (line, column) of a place or message that starts as at_line writes one for `source`;
// nullopt for any other (the command line, the file without a line, another file).
std::optional<std::pair<long, long>> file_position(const std::string& at, const std::string& source) {
  if (source.empty() || at.compare(0, source.size() + 1, source + ":") != 0) return std::nullopt;
  long line = 0, col = 0;
  if (std::sscanf(at.c_str() + source.size() + 1, "%ld:%ld", &line, &col) != 2) return std::nullopt;
  return std::make_pair(line, col);
}

// A value against its spec: range and choices. The problem ("" when none), starting with the key.
std::string value_problem(const KeySpec& spec, const Value& v) {
  auto bounds = [&] {
    std::ostringstream s;
    s << "must be between " << spec.min << " and " << spec.max;
    return s.str();
  };
  if (auto* i = std::get_if<std::int64_t>(&v); i && (static_cast<double>(*i) < spec.min || static_cast<double>(*i) > spec.max)) {
    return spec.key + " is " + std::to_string(*i) + ", " + (spec.max < 1e299 ? bounds() : "must be >= " + std::to_string(static_cast<std::int64_t>(spec.min)));
  }
  if (auto* f = std::get_if<double>(&v); f && (!std::isfinite(*f) || *f < spec.min || *f > spec.max)) {
    std::ostringstream s;
    s << spec.key << " is " << *f << ", " << (std::isfinite(*f) ? (spec.max < 1e299 ? bounds() : "must be >= " + std::to_string(spec.min)) : "must be a finite number");
    return s.str();
  }
  if (auto* s = std::get_if<std::string>(&v); s && !spec.choices.empty() &&
                                               std::find(spec.choices.begin(), spec.choices.end(), *s) == spec.choices.end()) {
    const std::string list = join(spec.choices);
    // No hint where the nearest choice extends the value or the other way round: "Adam" is not
    // a typo of "AdamW" but another optimizer.
    const std::string near = nearest_word(*s, spec.choices, typo_distance(*s));
    const bool hint = !near.empty() && near.rfind(*s, 0) != 0 && s->rfind(near, 0) != 0;
    // torchtitan's values of a key spmdx shares, for features spmdx has not: named, as its keys are.
    if (spec.key == "parallelism.context_parallel_rotate_method" && *s == "alltoall") {
      return spec.key + " is \"alltoall\": torchtitan's ring attention, passing shards of k and v around by all_to_all; spmdx does not have it: use "
                        "\"allgather\" (torchtitan's default) or \"auto\" (spmdx's: the fewest bytes, possibly splitting heads by all_to_all)";
    }
    return spec.key + " is \"" + *s + "\", expected one of " + list + (hint ? "; did you mean '" + near + "'?" : "");
  }
  return "";
}

// torchtitan's names for spmdx's values of the same meaning.
const std::map<std::string, std::map<std::string, std::string>>& value_aliases() {
  static const std::map<std::string, std::map<std::string, std::string>> aliases{{"model.name", {{"llama3", "llama"}}}};
  return aliases;
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
    std::string operator()(const std::string& x) const { return toml_string(x); }
    std::string operator()(const std::vector<std::string>& x) const {
      std::string out = "[";
      for (std::size_t i = 0; i < x.size(); ++i) out += (i ? ", " : "") + toml_string(x[i]);
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
      k("model.name", Type::string, std::string("llama"), "model: llama, qwen3 and deepseek_v3 as torchtitan's (deepseek_v3 with plain attention in place of MLA), mlp, or \"pt2\": a torch.export program from model.path",
        -1e300, L{"llama", "mlp", "qwen3", "deepseek_v3", "pt2"}),
      k("model.flavor", Type::string, std::string("debugmodel"), "model size (torchtitan's flavor names; qwen3 and deepseek_v3 also tiny_moe)", -1e300,
        L{"tiny", "debugmodel", "large", "tiny_gqa", "8B", "70B", "405B", "0.6B", "1.7B", "4B", "14B", "32B", "debugmodel_moe", "30B-A3B", "235B-A22B", "tiny_moe", "16B",
          "671B"}),
      k("model.attn_mask_type", Type::string, std::string("causal"),
        "llama's attention mask (torchtitan's key): \"causal\", or \"block_causal\" (a token attends only within its document, documents ending at the tokenizer's EOS)",
        -1e300, L{"causal", "block_causal"}),
      n("model.vocab_size", Type::integer, std::int64_t{-1},
        "rows of the embedding and output (-1: the tokenizer's ids; more than them for a plan of a real vocabulary, e.g. Llama 3's 128256)", -1, 1e9),
      n("model.n_layers", Type::integer, std::int64_t{-1},
        "llama: transformer blocks (-1: the flavor's; 1 to 1024 to plan a model of the flavor's width at another depth)", -1, 1024),
      k("model.tokenizer", Type::string, std::string("byte"), "\"byte\", or a Hugging Face tokenizer.json (or its folder)"),
      k("model.path", Type::string, std::string(""), "model.name = \"pt2\": the .pt2 file torch.export.save wrote (torch >= 2.9)"),
      k("model.inputs", Type::string_list, L{},
        "model.name = \"pt2\": the program's inputs that take tokens and labels, in that order (empty: by position)"),
      k("model.loss", Type::string, std::string("auto"),
        "model.name = \"pt2\": auto (a scalar output is the loss; logits get mean cross entropy), cross_entropy, or output", -1e300,
        L{"auto", "cross_entropy", "output"}),
      n("training.steps", Type::integer, std::int64_t{10}, "optimizer steps", 1, 1e9),
      n("training.global_batch_size", Type::integer, std::int64_t{-1}, "rows per step over all ranks (-1: local x data-parallel degree)", -1, 1e7),
      n("training.local_batch_size", Type::integer, std::int64_t{8}, "rows per step per data-parallel rank (when global is -1)", 1, 1e6),
      n("training.seq_len", Type::integer, std::int64_t{256}, "tokens per row", 1, 1e7),
      n("training.max_norm", Type::floating, 1.0, "clip the global gradient norm to this (0: off)", 0, 1e30),
      k("training.device", Type::string, std::string("cpu"),
        "where tensors live (cuda: GPU LOCAL_RANK for each rank; auto: cuda for a local rank that has a GPU, else cpu)", -1e300, L{"cpu", "cuda", "auto"}),
      k("training.devices", Type::string_list, L{},
        "one device per rank (\"cpu\", \"cuda\" or \"auto\"), in place of training.device: a mesh of CPU and CUDA ranks"),
      k("training.cpu_matmul", Type::string, std::string("auto"),
        "cpu: the library float32 linears run on (auto: onednn where this LibTorch has it; aten: at::linear's BLAS, MKL in x86 wheels)", -1e300,
        L{"auto", "onednn", "aten"}),
      k("training.allow_tf32", Type::boolean, false, "cuda: TF32 in matmuls and cuDNN (faster; losses then differ from the CPU's by about 1e-3)"),
      k("training.cuda_graphs", Type::boolean, false, "cuda: capture the whole train step once as a CUDA graph and replay it each step (one rank)"),
      k("training.mixed_precision_param", Type::string, std::string("float32"),
        "the dtype the forward and backward compute in (bfloat16: FSDP2's MixedPrecisionPolicy; float16: the same with dynamic loss scaling, "
        "as torch.amp.GradScaler; parameters and AdamW stay float32)", -1e300,
        L{"float32", "bfloat16", "float16"}),
      n("training.grad_scaler_init_scale", Type::floating, 65536.0,
        "float16: the first loss scale (torch.amp.GradScaler's init_scale); halved at each step whose gradients overflow", 1, 1e38),
      n("training.grad_scaler_growth_interval", Type::integer, std::int64_t{2000},
        "float16: steps without overflow after which the loss scale doubles (GradScaler's growth_interval)", 1, 1e9),
      k("training.mixed_precision_reduce", Type::string, std::string("float32"), "the dtype gradients are reduced in", -1e300, L{"float32"}),
      k("activation_checkpoint.mode", Type::string, std::string("none"),
        "recompute forward values in the backward instead of keeping them: none, full (every layer) or selective", -1e300,
        L{"none", "full", "selective"}),
      k("activation_checkpoint.keep_collective_outputs", Type::boolean, false,
        "with activation_checkpoint.mode full or selective: a collective the recomputation would issue again (TP's all_reduce or "
        "reduce_scatter, an all_gather of an activation) reads the forward's output instead, kept until the backward (as torchtitan's "
        "save_list keeps reduce_scatter's); false: issued again"),
      k("activation_checkpoint.selective_ac_option", Type::string, std::string("op"),
        "selective: op (keep matmul and attention outputs, recompute the rest) or N (every N-th layer in full)"),
      k("optimizer.name", Type::string, std::string("AdamW"), "optimizer", -1e300, L{"AdamW"}),
      n("optimizer.lr", Type::floating, 8e-4, "peak learning rate", 0, 1e3),
      n("optimizer.beta1", Type::floating, 0.9, "AdamW beta1", 0, 1),
      n("optimizer.beta2", Type::floating, 0.95, "AdamW beta2", 0, 1),
      n("optimizer.eps", Type::floating, 1e-8, "AdamW eps", 0, 1),
      n("optimizer.weight_decay", Type::floating, 0.1, "AdamW decoupled weight decay", 0, 1e3),
      n("lr_scheduler.warmup_steps", Type::integer, std::int64_t{2}, "linear warm-up steps: (c+1)/warmup_steps at 0-based step c", 0, 1e9),
      n("lr_scheduler.total_steps", Type::integer, std::int64_t{-1},
        "the steps the schedule spans (-1: training.steps); more than training.steps runs the start of a longer schedule, as "
        "torchtitan's total_steps (its PR #2340)", -1, 1e9),
      n("lr_scheduler.decay_ratio", Type::floating, -1.0,
        "the share of the schedule's steps that decay, after a stable phase (-1: unset, every step after warm-up decays)", -1, 1),
      k("lr_scheduler.decay_type", Type::string, std::string("linear"), "decay curve", -1e300, L{"linear", "sqrt", "cosine"}),
      n("lr_scheduler.min_lr_factor", Type::floating, 0.0, "the decay ends at lr x this", 0, 1),
      k("data.paths", Type::string_list, L{}, "text or JSON Lines files (\"text\" field)"),
      n("data.seed", Type::integer, std::int64_t{0}, "seed of batch sampling", 0, 9.2e18),
      k("data.document_separator", Type::string, std::string(""),
        "split each plain text file into documents at this string (\"\": a file is one document), e.g. \"%\\n\" for fortune files; "
        "each document gets the tokenizer's BOS and EOS (JSON Lines records are documents already)"),
      n("parallelism.data_parallel_replicate_degree", Type::integer, std::int64_t{1}, "DDP degree (mesh dim dp_replicate)", 1, 1e6),
      n("parallelism.data_parallel_shard_degree", Type::integer, std::int64_t{-1}, "FSDP degree (mesh dim dp_shard; -1: the ranks left)", -1, 1e6),
      n("parallelism.expert_parallel_degree", Type::integer, std::int64_t{1},
        "expert parallelism of MoE models, built-in or transformers exports (torchtitan's key): the routed experts Shard(0) over (part of) dp_shard, tokens dispatched to them by all_to_all_v; "
        "1: off; else it must divide data_parallel_shard_degree (the rest, efsdp = dp_shard / ep, shards the experts FSDP-style: mesh efsdp x dp_shard); "
        "with tp, pp and dp_replicate (each replica its own EP), not with cp", 1, 1e6),
      n("parallelism.tensor_parallel_degree", Type::integer, std::int64_t{1}, "Megatron TP degree (mesh dim tp)", 1, 1e6),
      n("parallelism.context_parallel_degree", Type::integer, std::int64_t{1},
        "context parallelism (mesh dim cp, between dp_shard and tp): every activation sharded on the sequence over cp, attention "
        "all-gathering keys and values (Llama 3's context parallelism)", 1, 1e6),
      k("parallelism.context_parallel_load_balance", Type::boolean, true,
        "with context_parallel_degree > 1, cut the sequence into 2 cp pieces, rank r of cp holding pieces r and 2 cp - 1 - r, so "
        "that causal attention gives every rank the same work (torch's context_parallel load balancer); false: rank r holds piece r of cp"),
      k("parallelism.context_parallel_rotate_method", Type::string, std::string("allgather"),
        "with context_parallel_degree > 1, how attention sees the keys of other ranks: \"allgather\" (torchtitan's default, Llama 3's): "
        "each rank keeps its queries and all-gathers keys and values; \"auto\" (spmdx's): whatever moves the fewest bytes, which may split "
        "the batch or the heads by all_to_all (DeepSpeed-Ulysses)", -1e300, L{"allgather", "auto"}),
      n("parallelism.pipeline_parallel_degree", Type::integer, std::int64_t{1},
        "pipeline stages (mesh dim pp, outermost): the train step is cut between layers, activations and their gradients go "
        "between stages by send/recv", 1, 1e6),
      k("parallelism.pipeline_parallel_schedule", Type::string, std::string("1F1B"),
        "the order each stage runs its microbatches' forwards and backwards in (torchtitan's names)", -1e300, L{"GPipe", "1F1B", "Interleaved1F1B"}),
      n("parallelism.pipeline_parallel_microbatch_size", Type::integer, std::int64_t{1},
        "rows of a pipeline microbatch per data-parallel rank: the step runs global_batch_size / (data-parallel degree x this) "
        "microbatches through the stages", 1, 1e9),
      k("parallelism.pipeline_parallel_split_points", Type::string_list, L{},
        "the layers that begin stages 1, 2, ... (e.g. [\"layers.4\"]; empty: layers split evenly, earlier stages taking one more)"),
      n("parallelism.pipeline_parallel_layers_per_stage", Type::integer, std::int64_t{-1},
        "layers of each stage (-1: unset); n_layers / this must be pipeline_parallel_degree", -1, 1e6),
      k("parallelism.enable_sequence_parallel", Type::boolean, false,
        "with tensor_parallel_degree > 1, shard the residual stream and the norms on the sequence over tp (Megatron-SP): "
        "all_gather before the column-parallel matmuls and reduce_scatter after the row-parallel ones instead of all_reduce, "
        "1/tp of the norms' activations"),
      k("parallelism.disable_loss_parallel", Type::boolean, true,
        "with tensor_parallel_degree > 1, false computes cross entropy on the vocabulary-sharded logits (loss parallel: three numbers a "
        "row all-reduced); true (spmdx's default, torchtitan's is false) gathers the logits first"),
      k("parallelism.fallback_strategies", Type::string_list, L{},
        "layouts tried in order when [parallelism.strategies]' cannot place the job (a plugin that fails to load or to place, a memory "
        "budget it cannot meet, a validator hook that refuses it): each \"dim=plugin[ dim=plugin]\" over [parallelism.strategies], e.g. "
        "\"dp_shard=fsdp\" or \"dp_shard=fsdp tp=tensor_parallel\""),
      k("parallelism.strict", Type::boolean, false, "stop instead of falling back to parallelism.fallback_strategies"),
      k("parallelism.strategy", Type::string, std::string("manual"),
        "\"manual\": the degrees and [parallelism.strategies] as given; \"auto\": spmdx chooses data_parallel_replicate_degree, "
        "data_parallel_shard_degree and tensor_parallel_degree (cp and pp as given) and each op's placements by the calibrated cost model, "
        "an integer linear program per mesh dim (Alpa's intra-op pass, parallelism.planner), within parallelism.memory_budget; spmdx compile "
        "--strategy auto prints why", -1e300, L{"manual", "auto"}),
      k("parallelism.planner", Type::string, std::string("auto"),
        "with strategy = \"auto\": the planner plugin that solves each mesh dim's choice (the built-in \"auto\": COIN-OR CBC), or \"greedy\" "
        "(propagation's own choice, no solver)"),
      n("parallelism.planner_time_limit_seconds", Type::floating, 10.0, "with strategy = \"auto\": the planner's time for the whole search: the layouts best by propagation get their op placements chosen "
        "by it in order (up to 4) while time is left, each mesh dim's solver stopping when it runs out", 0.1, 3600),
      k("parallelism.memory_budget", Type::string, std::string(""),
        "the most bytes a rank's step may hold (e.g. \"2GiB\"; empty: no limit): over it, spmdx turns on FSDP resharding, activation "
        "checkpointing, a higher shard degree, in that order, before any rank starts"),
      k("parallelism.balance", Type::string, std::string("even"),
        "how the global batch splits over the data-parallel ranks: \"even\" (global_batch_size / the degree each, as DDP and FSDP2); "
        "\"speed\": in whole rows, in proportion to each rank's measured throughput (its rows over its compute time), re-planned "
        "between steps, so that unequal ranks run at the speed of their sum (docs/parallelism.md, \"Unequal ranks\")", -1e300, L{"even", "speed"}),
      n("parallelism.balance_interval", Type::integer, std::int64_t{5},
        "with balance = \"speed\": steps between two re-plans of the split (each measures the steps since the last, the first of a split "
        "not counted)", 2, 1e9),
      k("parallelism.balance_speeds", Type::string_list, L{},
        "with balance = \"speed\": each data-parallel rank's relative speed, one a rank in data-parallel order (e.g. [\"1\", \"1\", \"0.5\"]; "
        "with strategy = \"auto\", one per rank), or a target profile's name (h100-sxm, h200, b200: its peak FLOP/s): the split "
        "at start (before any step is measured; default: the ranks' CPU shares under --cpu-affinity, else even) and what spmdx compile --estimate "
        "plans with"),
      n("parallelism.balance_threshold", Type::floating, 0.1,
        "with balance = \"speed\": a new split is taken only when it is predicted to shorten the step by more than this share", 0, 0.9),
      k("parallelism.fsdp_reshard_after_forward", Type::string, std::string("default"), "free gathered parameters after forward", -1e300,
       L{"default", "never", "always"}),
      k("planning.target", Type::string, std::string("this-machine"),
        "the hardware strategy = \"auto\" and spmdx compile --estimate price plans for: this machine (its measured calibration.json), or a GPU's "
        "datasheet (h100-sxm, h200, b200: peak FLOP/s per dtype, memory, NVLink and a 400 Gb/s NIC a GPU, 8 a host); a GPU target's memory is "
        "parallelism.memory_budget unless that is set", -1e300, L{"this-machine", "h100-sxm", "h200", "b200"}),
      k("comm.backend", Type::string, std::string("auto"), "comm backend: \"auto\" (per collective, the best score of every comm plugin found), or pin one: \"name\" or \"name:key=value;...\" (ucx:tls=tcp,self)"),
      n("comm.timeout_seconds", Type::floating, 300.0, "a collective that takes longer fails, naming the peer", 1, 1e6),
      n("comm.swap_at_step", Type::integer, std::int64_t{0}, "hot-swap between backend and swap_to every this many steps (0: never)", 0, 1e9),
      k("comm.swap_to", Type::string, std::string(""), "the backend to swap to"),
      k("comm.fallback", Type::string_list, L{},
        "backends tried in order when comm.backend cannot serve the job (it fails to load, its checks or its start on a rank), and, during "
        "the run, when one fails comm.max_failures times (the step runs again on the next); with comm.backend unset, the first is tried first"),
      k("comm.strict", Type::boolean, false, "stop instead of falling back to comm.fallback"),
      n("comm.max_failures", Type::integer, std::int64_t{1},
        "with comm.fallback: a backend whose collectives fail this many times within comm.failure_window steps is replaced by the next; "
        "before that, the failed step runs again on the same backend, rejoined", 1, 1e6),
      n("comm.failure_window", Type::integer, std::int64_t{100}, "steps over which comm.max_failures counts a backend's failures", 1, 1e9),
      n("comm.bucket_cap_mb", Type::floating, 25.0, "gradient all_reduces fused into buckets of this many MiB (0: off; DDP's bucket_cap_mb)", 0, 1e6),
      n("comm.first_bucket_cap_mb", Type::floating, 1.0, "the first bucket's cap, MiB: small, so communication starts early in the backward", 0, 1e6),
      k("comm.overlap", Type::boolean, true, "issue collectives early and wait late (false: wait right after each)"),
      k("comm.prefetch", Type::boolean, true, "FSDP: all_gather the next layer's parameters while the current layer computes"),
      k("fault_tolerance.enable", Type::boolean, false,
        "keep training when a rank dies (torchft's way, torchtitan's section): each data_parallel_replicate slice is a replica group; a group that "
        "loses a rank is dropped for the step, restarted (spmdx run --max-restarts) and given the live groups' state, while the others train on"),
      n("fault_tolerance.replica_id", Type::integer, std::int64_t{-1},
        "this rank's replica group: spmdx run's launcher gives each rank its own (rank / ranks per group); leave it -1 (torchtitan sets one "
        "per torchrun job; spmdx runs the groups as one job)", -1, 1e9),
      n("fault_tolerance.group_size", Type::integer, std::int64_t{0},
        "the number of replica groups (torchtitan's meaning): 0 takes parallelism.data_parallel_replicate_degree, which it must equal", 0, 1e9),
      n("fault_tolerance.min_replica_size", Type::integer, std::int64_t{1},
        "the fewest live replica groups a step may train with; below it the job stops at once, naming the groups lost (torchft's quorum "
        "waits for groups to join instead)", 1, 1e9),
      n("fault_tolerance.process_group_timeout_ms", Type::integer, std::int64_t{10000},
        "a collective, the per-step commit vote or a recovery transfer not done by then fails, and the rank that did not answer is stopped "
        "(replaces comm.timeout_seconds under fault tolerance)", 100, 1e9),
      k("hooks.enable", Type::string_list, L{}, "debug hook plugins to run"),
      k("checkpoint.enable", Type::boolean, false, "write checkpoints"),
      k("checkpoint.folder", Type::string, std::string("checkpoint"), "under job.dump_folder"),
      n("checkpoint.interval", Type::integer, std::int64_t{10}, "steps between checkpoints", 1, 1e9),
      n("checkpoint.load_step", Type::integer, std::int64_t{-1}, "resume from this step (-1: the latest, if any)", -1, 1e9),
      n("checkpoint.keep_latest_k", Type::integer, std::int64_t{0},
        "after each save, rank 0 deletes the oldest complete checkpoints beyond this many (0: keep all); never one before a newer one is complete, "
        "nor a folder spmdx did not write (torchtitan's key)", 0, 1e9),
      k("checkpoint.initial_load_path", Type::string, std::string(""),
        "a job with no checkpoint to resume starts from these weights: a .safetensors file or a folder of them (spmdx export's), under "
        "spmdx's (torchtitan's) names or, for llama, Hugging Face's; resharded onto this mesh (\"\": the seeded initialisation)"),
      n("metrics.log_freq", Type::integer, std::int64_t{1}, "print a line every this many steps", 1, 1e9),
      k("metrics.enable_tensorboard", Type::boolean, false,
        "rank 0 also writes TensorBoard event files (loss, val_loss, lr, grad_norm, throughput, step time, exposed communication, memory)"),
      k("metrics.save_tb_folder", Type::string, std::string("tb"), "TensorBoard's folder under job.dump_folder; each run writes a YYYYmmdd-HHMM folder in it, as torchtitan"),
      k("validation.enable", Type::boolean, false, "every validation.freq steps, the loss of held-out text (forward only, no update)"),
      k("validation.paths", Type::string_list, L{}, "the held-out text or JSON Lines files (as data.paths)"),
      n("validation.freq", Type::integer, std::int64_t{500}, "validate every this many steps", 1, 1e9),
      n("validation.steps", Type::integer, std::int64_t{-1}, "batches per validation (-1: as many as the held-out tokens fill once, at least 1)", -1, 1e9),
      n("validation.local_batch_size", Type::integer, std::int64_t{8}, "held-out rows per data-parallel rank per batch", 1, 1e6),
      n("validation.seq_len", Type::integer, std::int64_t{-1}, "tokens per held-out row (-1: training.seq_len, the only length the model's RoPE tables have)", -1, 1e9),
      k("profiling.enable_profiling", Type::boolean, false, "write PyTorch profiler (Kineto) traces of every profile_freq-th step, per rank"),
      n("profiling.profile_freq", Type::integer, std::int64_t{10}, "profile every this many steps", 1, 1e9),
      k("profiling.save_traces_folder", Type::string, std::string("profile_traces"),
        "under job.dump_folder: iteration_N/rankR_trace.json (Chrome trace JSON, opens in Perfetto), as torchtitan"),
      k("plugins.paths", Type::string_list, L{}, "plugin files or folders searched first"),
      k("debug.dump_batches", Type::boolean, false,
        "rank 0 writes each step's global batch, tokens and labels (int64 [global_batch, seq_len]), as <dump>/debug/batches/step-N.{tokens,labels}.npy"),
      k("debug.dump_initial_weights", Type::boolean, false,
        "rank 0 writes the parameters and buffers before the first step, whole, as <dump>/debug/initial.safetensors"),
  };
  return keys;
}

Config::Config() {
  for (const auto& s : schema()) values_[s.key] = s.default_value;
}

namespace {

// The TOML text of a node, as the config's own printer writes values.
std::string node_text(const toml::node& n) {
  if (auto x = n.value_exact<std::int64_t>()) return std::to_string(*x);
  if (auto x = n.value_exact<double>()) return value_toml(Value(*x));
  if (auto x = n.value_exact<bool>()) return *x ? "true" : "false";
  if (auto x = n.value_exact<std::string>()) return toml_string(*x);
  if (const toml::array* a = n.as_array()) {
    std::string out = "[";
    for (std::size_t i = 0; i < a->size(); ++i) out += (i ? ", " : "") + node_text(*a->get(i));
    return out + "]";
  }
  return "{...}";
}

// Where a key of spmdx's schema with the same name lives in another section ("" when none).
std::string other_section(const std::string& section, const std::string& name) {
  for (const auto& k : all_keys()) {
    const auto dot = k.find('.');
    if (k.substr(dot + 1) == name && k.substr(0, dot) != section) return k;
  }
  return "";
}

// " (did you mean ...)" for an unknown key: the same name in another section, or a plausible
// typo of a key of the same section. Nothing otherwise: a wrong hint is worse than none.
std::string key_hint(const std::string& key) {
  const auto dot = key.find('.');
  const std::string section = key.substr(0, dot), name = dot == std::string::npos ? key : key.substr(dot + 1);
  // Only a specific name (warmup_steps) means the same thing in another section; a generic one
  // (name, enable, folder) does not.
  if (const std::string elsewhere = other_section(section, name); !elsewhere.empty() && (name.find('_') != std::string::npos || name.size() >= 8)) {
    return "; spmdx has it as '" + elsewhere + "'";
  }
  std::vector<std::string> same;
  for (const auto& k : all_keys()) {
    if (k.compare(0, section.size() + 1, section + ".") == 0) same.push_back(k.substr(section.size() + 1));
  }
  const std::string near = nearest_word(name, same, typo_distance(name));
  return near.empty() ? "" : "; did you mean '" + section + "." + near + "'?";
}

}  // namespace

// Every problem of a config, collected rather than thrown one at a time.
struct Config::Checker {
  Config& cfg;
  std::set<std::string> from_file;  // keys set in the file (an alias counts as its target)
  std::map<std::string, std::string> given_here;  // spmdx key -> the name the command line gave it under

  // Messages are kept in the order of the file (line, column), command-line ones after.
  template <class T>
  void insert_sorted(std::vector<T>& list, std::vector<std::pair<long, long>>& keys, const std::string& at, T item) {
    const auto k = file_position(at, cfg.source_).value_or(std::make_pair(1L << 40, 0L));
    const auto it = std::upper_bound(keys.begin(), keys.end(), k);
    list.insert(list.begin() + (it - keys.begin()), std::move(item));
    keys.insert(it, k);
  }
  void problem(const std::string& at, const std::string& key, const std::string& message) {
    insert_sorted(cfg.problems_, cfg.problem_order_, at, at + ": " + message);
    if (find_spec(key) != nullptr) cfg.problem_keys_.insert(key);  // spmdx's keys, which later checks read
  }
  void ignored(const std::string& at, const std::string& what, const std::string& reason) {
    insert_sorted(cfg.ignored_, cfg.ignored_order_, at, std::array<std::string, 3>{at, what, reason});
  }

  // `key` = `v` (already typed) from `at`; `given` is how it was written (for messages).
  void set(const KeySpec& spec, Value v, const std::string& at, const std::string& given_key) {
    if (auto* str = std::get_if<std::string>(&v)) {
      if (auto a = value_aliases().find(spec.key); a != value_aliases().end()) {
        if (auto it = a->second.find(*str); it != a->second.end()) v = it->second;  // torchtitan's name for it
      }
    }
    if (std::string why = value_problem(spec, v); !why.empty()) {
      if (given_key != spec.key) why = given_key + " (spmdx's " + why + ")";
      problem(at, spec.key, why);
      return;
    }
    cfg.values_[spec.key] = v;
  }

  // A key that is not spmdx's: torchtitan's alias, ignored, or unsupported; else unknown.
  // `text` is the value as TOML writes it; `apply` sets an alias's target from the node or text.
  void foreign(const std::string& key, const std::string& text, const std::string& at, const std::function<void(const KeySpec&)>& apply) {
    const TitanKey* t = find_titan_key(key);
    if (t == nullptr) {
      const std::string section = key.substr(0, key.find('.'));
      const auto known = sections();
      const bool section_known = std::find(known.begin(), known.end(), section) != known.end() || is_titan_section(section);
      problem(at, key, section_known ? "unknown key '" + key + "'" + key_hint(key) : unknown_section(section));
      return;
    }
    switch (t->kind) {
      case TitanKey::Kind::alias: {
        const KeySpec* spec = find_spec(t->target);
        if (from_file.count(t->target)) {
          problem(at, t->target, key + " is torchtitan's name for " + t->target + ", which is set too: keep one");
          return;
        }
        from_file.insert(t->target);
        const std::size_t before = cfg.problems_.size();
        apply(*spec);
        if (cfg.problems_.size() == before) cfg.given_as_[t->target] = key;
        return;
      }
      case TitanKey::Kind::ignored:
        ignored(at, key + " = " + text, t->why);
        return;
      case TitanKey::Kind::unsupported: {
        auto unquoted = [](std::string x) { return x.size() >= 2 && x.front() == '"' ? x.substr(1, x.size() - 2) : x; };
        for (const auto& off : t->off) {
          if (text == off || unquoted(text) == unquoted(off)) {
            ignored(at, key + " = " + text, t->target + " is off (spmdx does not have it yet)");
            return;
          }
        }
        std::string off_list;
        for (const auto& o : t->off) off_list += (off_list.empty() ? "" : " or ") + o;
        problem(at, key, key + " = " + text + " is torchtitan's; spmdx does not support " + t->target + " yet" +
                             (t->why.empty() ? (off_list.empty() ? "" : ": set it to " + off_list + " or remove it") : ": " + t->why));
        return;
      }
    }
  }

  // A TOML node for spmdx key `spec`, typed.
  void from_node(const KeySpec& spec, const toml::node& node, const std::string& at, const std::string& given_key) {
    Value v;
    bool ok = true;
    switch (spec.type) {
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
    if (!ok) {
      problem(at, spec.key, (given_key != spec.key ? given_key + " (spmdx's " + spec.key + ")" : spec.key) + " must be " + type_name(spec.type));
      return;
    }
    const std::size_t before = cfg.problems_.size();
    set(spec, v, at, given_key);
    if (cfg.problems_.size() == before) cfg.positions_[spec.key] = at;
  }

  // Every leaf of a table that is not spmdx's (torchtitan's [quantize.linear.float8], ...).
  void foreign_table(const std::string& prefix, const toml::table& table, const std::string& source) {
    for (const auto& [k, node] : table) {
      const std::string key = prefix + "." + std::string(k.str());
      if (const toml::table* sub = node.as_table()) {
        foreign_table(key, *sub, source);
        continue;
      }
      foreign(key, node_text(node), at_line(source, node.source()), [&](const KeySpec& spec) { from_node(spec, node, at_line(source, node.source()), key); });
    }
  }

  void file(const toml::table& root, const std::string& source) {
    const std::vector<std::string> known = sections();
    for (const auto& [section_key, section_node] : root) {
      const std::string section(section_key.str());
      const std::string at = at_line(source, section_node.source());
      const toml::table* table = section_node.as_table();
      if (const toml::array* a = section_node.as_array(); a != nullptr && a->is_array_of_tables()) {
        problem(at, section, "[[" + section + "]] is an array of tables; a section is one table: write [" + section + "]");
        continue;
      }
      if (table == nullptr) {
        std::string home;
        for (const auto& key : all_keys()) {
          if (key.size() > section.size() && key.compare(key.size() - section.size() - 1, std::string::npos, "." + section) == 0) {
            home = key.substr(0, key.size() - section.size() - 1);
          }
        }
        problem(at, section, "key '" + section + "' is outside any [section]" + (home.empty() ? std::string() : "; put it under [" + home + "]"));
        continue;
      }
      if (std::find(known.begin(), known.end(), section) == known.end()) {
        if (is_titan_section(section)) {
          foreign_table(section, *table, source);
        } else {
          problem(at, section, unknown_section(section));
        }
        continue;
      }
      for (const auto& [name_key, node] : *table) {
        const std::string key = section + "." + std::string(name_key.str());
        const std::string node_at = at_line(source, node.source());
        // [hooks.<name>]: that hook's options; [parallelism.tp_plan]: tensor_parallel's plan;
        // [parallelism.strategies]: the strategy plugin of each mesh dim
        if ((section == "hooks" || key == "parallelism.tp_plan" || key == "parallelism.strategies") && node.is_table()) {
          auto& options = cfg.plugin_options_[key];
          cfg.positions_[key] = node_at;  // where the table is, for a table without options
          for (const auto& [opt_key, opt] : *node.as_table()) {
            const std::string opt_at = at_line(source, opt.source());
            cfg.positions_[key + "." + std::string(opt_key.str())] = opt_at;
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
              problem(opt_at, key, key + "." + std::string(opt_key.str()) + " must be a string, number or boolean");
            }
          }
          continue;
        }
        if (const KeySpec* spec = find_spec(key)) {
          if (from_file.count(key)) {
            problem(node_at, key, key + " is set twice (once under torchtitan's name): keep one");
            continue;
          }
          from_file.insert(key);
          from_node(*spec, node, node_at, key);
          continue;
        }
        if (const toml::table* sub = node.as_table(); sub != nullptr && find_titan_key(key + ".x") == nullptr) {
          problem(node_at, key, "unknown key '" + key + "'" + key_hint(key));
          continue;
        }
        foreign(key, node_text(node), node_at, [&](const KeySpec& spec) { from_node(spec, node, node_at, key); });
      }
    }
  }

  // One "--section.key value" override.
  void override_value(const std::string& key, const std::string& text) {
    const std::string at = "command line: --" + key;
    for (const std::string table : {"parallelism.tp_plan", "parallelism.strategies"}) {  // --parallelism.tp_plan.<glob> <style>
      if (key.rfind(table + ".", 0) != 0 || key.size() <= table.size() + 1) continue;
      cfg.plugin_options_[table][key.substr(table.size() + 1)] = text;
      cfg.overrides_[key] = key + " " + text;
      cfg.overrides_[table] = key + " " + text;  // where a message about the table points
      return;
    }
    if (key.rfind("hooks.", 0) == 0 && std::count(key.begin(), key.end(), '.') == 2) {  // --hooks.<name>.<option>
      const auto dot = key.rfind('.');
      if (dot == 6 || dot + 1 == key.size()) {
        problem(at, key, "expected --hooks.<hook>.<option> value");
        return;
      }
      cfg.plugin_options_[key.substr(0, dot)][key.substr(dot + 1)] = text;
      cfg.overrides_[key] = key + " " + text;
      return;
    }
    auto typed = [&](const KeySpec& spec) {
      Value v;
      try {
        std::size_t used = 0;
        switch (spec.type) {
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
        problem(at + " " + text, spec.key, (key != spec.key ? key + " (spmdx's " + spec.key + ")" : spec.key) + " must be " + type_name(spec.type));
        return;
      }
      if (auto earlier = given_here.find(spec.key); earlier != given_here.end() && earlier->second != key) {
        problem(at, spec.key, "--" + key + " and --" + earlier->second + " both set " + spec.key + " (one is torchtitan's name for the other): keep one");
        return;
      }
      given_here[spec.key] = key;
      const std::size_t before = cfg.problems_.size();
      set(spec, v, at, key);
      if (cfg.problems_.size() == before) cfg.overrides_[spec.key] = key + " " + text;
    };
    // A key given on the command line replaces the file's: what the file's had ignored is moot.
    for (std::size_t i = 0; i < cfg.ignored_.size();) {
      if (cfg.ignored_[i][1].rfind(key + " = ", 0) == 0 && cfg.ignored_[i][0].rfind("command line", 0) != 0) {
        cfg.ignored_.erase(cfg.ignored_.begin() + static_cast<long>(i));
        cfg.ignored_order_.erase(cfg.ignored_order_.begin() + static_cast<long>(i));
      } else {
        ++i;
      }
    }
    if (const KeySpec* spec = find_spec(key)) {
      typed(*spec);
      return;
    }
    foreign(key, text, at, typed);
  }
};

Config Config::load(const std::string& path, const std::vector<std::string>& overrides, bool throw_on_problems) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(st)) throw ConfigError(path + ": no such config file");
  if (!std::filesystem::is_regular_file(st)) throw ConfigError(path + ": not a regular file (a folder, FIFO or device); name a TOML file");
  std::ifstream in(path);
  if (!in) throw ConfigError(path + ": cannot read the config file: " + std::strerror(errno));
  std::stringstream text;
  text << in.rdbuf();
  Config cfg = parse(text.str(), path, false);
  Checker c{cfg, {}, {}};
  for (std::size_t i = 0; i < overrides.size(); ++i) {
    const std::string& a = overrides[i];
    if (a.rfind("--", 0) != 0 || a.find('.') == std::string::npos) {
      c.problem("command line", a, "unexpected argument '" + a + "' (overrides look like --section.key value)");
      continue;
    }
    std::string key = a.substr(2), value;
    if (auto eq = key.find('='); eq != std::string::npos) {
      value = key.substr(eq + 1);
      key.resize(eq);
    } else if (i + 1 < overrides.size()) {
      value = overrides[++i];
    } else {
      c.problem("command line", key, a + " needs a value");
      continue;
    }
    c.override_value(key, value);
  }
  if (throw_on_problems) cfg.check();
  return cfg;
}

Config Config::parse(const std::string& text, const std::string& source, bool throw_on_problems) {
  Config cfg;
  cfg.source_ = source;
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw ConfigError(at_line(source, e.source()) + ": " + std::string(e.description()));
  }
  Checker{cfg, {}, {}}.file(root, source);
  if (throw_on_problems) cfg.check();
  return cfg;
}

void Config::override_value(const std::string& key, const std::string& value) {
  const std::size_t before = problems_.size();
  Checker{*this, {}, {}}.override_value(key, value);
  if (problems_.size() > before) {  // a command-line problem sorts last
    const std::string p = problems_.back();
    problems_.pop_back();
    problem_order_.pop_back();
    throw ConfigError(p);
  }
}

std::string Config::report(const std::vector<std::string>& more) const {
  std::vector<std::string> all = problems_;
  all.insert(all.end(), more.begin(), more.end());
  if (all.empty()) return "";
  // In file order: those with a line first, then the file's others, then the command line's.
  auto order = [&](const std::string& p) {
    const std::string src = source_.empty() ? "config" : source_;
    if (p.rfind("command line", 0) == 0) return std::make_tuple(2L, 0L, 0L);
    if (const auto at = file_position(p, src)) return std::make_tuple(0L, at->first, at->second);
    return std::make_tuple(1L, 0L, 0L);
  };
  std::stable_sort(all.begin(), all.end(), [&](const std::string& a, const std::string& b) { return order(a) < order(b); });
  if (all.size() == 1 && ignored_.empty()) return all.front();
  std::string out = (source_.empty() ? std::string("config") : source_) + ": " +
                    (all.size() == 1 ? std::string("1 problem:") : std::to_string(all.size()) + " problems (every one found):");
  for (const auto& p : all) out += "\n  " + p;
  if (!ignored_.empty()) out += "\n" + ignored_text();
  return out;
}

std::vector<std::string> Config::ignored() const {
  std::vector<std::string> out;
  for (const auto& [at, what, reason] : ignored_) out.push_back(at + ": " + what + ": " + reason);
  return out;
}

std::string Config::ignored_text() const {
  if (ignored_.empty()) return "";
  std::string out = "spmdx ignores " + std::to_string(ignored_.size()) + " key" + (ignored_.size() == 1 ? "" : "s") +
                    " of torchtitan's that change nothing it computes:";
  // One line per reason, its keys in file order with where each is ("line 64" in the file).
  std::vector<std::string> reasons;
  std::map<std::string, std::string> keys;
  for (const auto& [at, what, reason] : ignored_) {
    const auto position = file_position(at, source_);
    const std::string where = position ? "line " + std::to_string(position->first) : at;
    if (!keys.count(reason)) reasons.push_back(reason);
    keys[reason] += (keys[reason].empty() ? "" : ", ") + what + " (" + where + ")";
  }
  for (const auto& r : reasons) out += "\n  " + keys[r] + ": " + r;
  return out;
}

void Config::check(const std::vector<std::string>& more) const {
  if (!problems_.empty() || !more.empty()) throw ConfigError(report(more));
}

std::string Config::given_as(const std::string& key) const {
  auto it = given_as_.find(key);
  return it == given_as_.end() ? key : it->second + " (torchtitan's name for " + key + ")";
}

bool Config::has_problem(const std::string& prefix) const {
  for (const auto& k : problem_keys_) {
    if (k.compare(0, prefix.size(), prefix) == 0) return true;
  }
  return false;
}

std::string Config::where(const std::vector<std::string>& keys) const {
  std::string given, file;
  bool all = !keys.empty();
  for (const auto& key : keys) {
    auto it = overrides_.find(key);
    if (it == overrides_.end()) {
      all = false;
      if (auto p = positions_.find(key); p != positions_.end() && keys.size() == 1) file = p->second;  // one key: file:line:column
      continue;
    }
    given += (given.empty() ? "command line --" : ", --") + it->second;
  }
  if (file.empty()) file = source_.empty() ? "config" : source_;
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
    // model.name = "pt2"'s own keys, left at their defaults under another model, are printed
    // commented out: set, they are refused there, and the printed file must load back as the
    // same job.
    const bool pt2_only = s.key == "model.path" || s.key == "model.inputs" || s.key == "model.loss";
    const bool inapplicable = pt2_only && !is_set(s.key) && std::get<std::string>(values_.at("model.name")) != "pt2";
    out << (inapplicable ? "# " : "") << s.key.substr(sec.size() + 1) << " = " << value_toml(values_.at(s.key)) << "  # " << s.help << "\n";
  }
  for (const auto& [table, options] : plugin_options_) {
    out << "\n[" << table << "]\n";
    for (const auto& [k, v] : options) {
      const bool bare = !k.empty() && std::all_of(k.begin(), k.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-'; });
      out << (bare ? k : toml_string(k)) << " = " << toml_string(v) << "\n";
    }
  }
  return out.str();
}

std::map<std::string, std::string> Config::settings() const {
  std::map<std::string, std::string> out;
  for (const auto& [key, v] : values_) out[key] = value_toml(v);
  for (const auto& [table, options] : plugin_options_) {
    for (const auto& [k, v] : options) out[table + "." + k] = toml_string(v);
  }
  return out;
}

const std::map<std::string, std::string>& Config::plugin_options(const std::string& table) const {
  static const std::map<std::string, std::string> none;
  auto it = plugin_options_.find(table);
  return it == plugin_options_.end() ? none : it->second;
}

}  // namespace spmdx::config
