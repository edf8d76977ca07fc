#include "spmdx/job/compile.h"

#include <algorithm>
#include <cstdio>
#include <set>

#include "spmdx/core/log.h"
#include "spmdx/text.h"
#include "spmdx/sharding/spec.h"
#include "spmdx/sharding/parallelize.h"
#include "spmdx/hooks/hook_set.h"
#include "spmdx/job/auto_sharding.h"
#include "spmdx/job/memory_budget.h"
#include "spmdx/train/context_parallel.h"
#include "spmdx/train/loss_parallel.h"

namespace spmdx::job {
using namespace spmdx::train;

// The context of hooks made to check a plan, not to run: rank 0's place in the job's mesh.
HookContext hook_context(std::int64_t world_size, const PlacedJob* job) {
  HookContext base;
  base.compile_only = true;
  base.world_size = static_cast<int>(world_size);
  if (job) {
    base.mesh = job->mesh.dims();
    base.coordinate = job->mesh.coordinate(0);
  }
  return base;
}

PlanValidator validator_hooks(const JobSpec& spec, PluginRegistry& registry) {
  return [hook_spec = spec.hooks, options = spec.plan, &registry, world_size = spec.world_size](const PlacedJob& job, const sharding::DistributedPlan& plan) -> std::string {
    if (hook_spec.enabled.empty()) return "";
    hooks::HookSet hooks = hooks::make_hooks(hook_spec, registry, hook_context(world_size, &job));
    std::vector<std::int64_t> ranks;
    for (std::int64_t r = 0; r < std::min<std::int64_t>(job.mesh.size(), 64); ++r) ranks.push_back(r);  // one stage's mesh with pipeline stages
    // Only the verdict counts here: the hooks' lines ("partition_validator: passed") are said
    // once, by rank 0 (or spmdx compile) running the compile stages of the job chosen.
    const log::ThreadLevel quiet(log::Level::error);
    try {
      hooks.compile(plan, ranks, options);
    } catch (const ValidationError& e) {
      return e.what();
    }
    return "";
  };
}

std::string layout_text(const std::map<std::string, std::string>& strategies) {
  if (strategies.empty()) return "the default strategies";
  std::string text;
  for (const auto& [dim, plugin] : strategies) text += (text.empty() ? "" : ", ") + dim + "=" + plugin;
  return text;
}

void choose_strategies(JobSpec& spec, PluginRegistry& registry, const PlanValidator& validate) {
  if (spec.auto_strategy) {
    choose_auto(spec, registry);
    return;
  }
  if (spec.fallback_strategies.empty()) {
    spec.memory_fit = fit_memory_budget(spec, registry);
    return;
  }
  std::vector<std::map<std::string, std::string>> layouts{spec.strategies};
  layouts.insert(layouts.end(), spec.fallback_strategies.begin(), spec.fallback_strategies.end());
  std::vector<std::pair<std::string, std::string>> passed;
  for (const auto& layout : layouts) {
    JobSpec s = spec;
    s.strategies = layout;
    std::string why;
    try {  // what a rank does before its first step: the budget's fit, the placements, rank 0's graph, the validators
      s.memory_fit = fit_memory_budget(s, registry);
      const CompiledJob compiled = compile_job(s, registry);
      sharding::rank_graph(compiled.plan, 0);
      why = validate ? validate(compiled.job, compiled.plan) : "";
    } catch (const std::exception& e) {
      why = e.what();
    }
    if (why.empty()) {
      spec = std::move(s);
      spec.strategies_passed_over = std::move(passed);
      return;
    }
    passed.emplace_back(layout_text(layout), why);
  }
  std::string text = "no layout of [parallelism.strategies] and parallelism.fallback_strategies can place the job: ";
  for (std::size_t i = 0; i < passed.size(); ++i) text += (i ? "; " : "") + passed[i].first + ": " + passed[i].second;
  throw std::invalid_argument(text);
}

ir::Graph rank_step_graph(const sharding::DistributedPlan& plan, std::int64_t rank, const JobSpec& spec, std::int64_t* kept) {
  ir::Graph g = sharding::rank_graph(plan, rank);
  std::int64_t merged = 0;
  if (spec.activation_checkpoint.mode != "none" && spec.activation_checkpoint.keep_collective_outputs) merged = keep_collective_outputs(g);
  if (kept != nullptr) *kept = merged;
  return g;
}

ir::Graph rank_program(const PlacedJob& job, const sharding::DistributedPlan& plan, std::int64_t rank, const JobSpec& spec, std::int64_t* kept,
                       StageGraph* staged) {
  const std::int64_t per_stage = job.mesh.size();
  ir::Graph g = rank_step_graph(plan, rank % per_stage, spec, kept);
  if (job.pipeline.stages <= 1) return g;
  StageGraph stage = stage_graph(g, job.pipeline, job.model.params, rank, per_stage);
  ir::Graph out = std::move(stage.graph);
  if (staged != nullptr) *staged = std::move(stage);
  return out;
}

sharding::DeviceMesh run_mesh(const PlacedJob& job) { return job.pipeline.stages > 1 ? pipeline_mesh(job.mesh, job.pipeline.stages) : job.mesh; }

namespace {

// The model's forward for a batch of `rows` rows, with the casts of the spec's mixed precision.
models::Model forward_model(const JobSpec& spec, std::int64_t rows) {
  models::Model m = models::build_model(spec.model, rows, spec.seq_len);
  if (spec.mixed_precision.param != "float32") {
    m.graph = cast_for_mixed_precision(m.graph, spec.mixed_precision.param == "float16" ? ir::DType::f16 : ir::DType::bf16);
  }
  return m;
}

}  // namespace

namespace {

// Each pipeline stage's first layer: from pipeline_parallel_split_points, or
// pipeline_parallel_layers_per_stage, or an even split (earlier stages take one more layer).
// Throws std::invalid_argument naming the key when the stages do not fit the model's layers.
std::vector<std::int64_t> first_layers(const JobSpec& spec, const std::vector<std::string>& params) {
  const std::int64_t stages = spec.pipeline.stages;
  const bool interleaved = spec.pipeline.schedule == "Interleaved1F1B";
  std::int64_t layers = 0;
  for (const auto& p : params) layers = std::max(layers, layer_of(p) + 1);
  // The chunks the layers make (stages; with Interleaved1F1B, several per stage: 2 unless the
  // split points or layers_per_stage say otherwise).
  std::int64_t chunks = interleaved ? 2 * stages : stages;
  if (!spec.pipeline_split_points.empty()) chunks = static_cast<std::int64_t>(spec.pipeline_split_points.size()) + 1;
  if (spec.pipeline_layers_per_stage > 0) chunks = (layers + spec.pipeline_layers_per_stage - 1) / spec.pipeline_layers_per_stage;  // torchtitan's count
  auto fits = [&](std::int64_t n) { return interleaved ? n % stages == 0 && n >= 2 * stages : n == stages; };  // a chunk count these stages run
  if (layers < chunks) {
    const std::int64_t most = interleaved ? layers / 2 : layers;
    throw std::invalid_argument("parallelism.pipeline_parallel_degree " + std::to_string(stages) + " is more " +
                                (interleaved ? "chunks (" + std::to_string(chunks) + ", Interleaved1F1B)" : std::string("stages")) + " than the model's " +
                                std::to_string(layers) + " layers: " +
                                (most >= 2 ? "use at most " + std::to_string(most) + " stages" : std::string("the model is too shallow to pipeline; use pipeline_parallel_degree 1")));
  }
  if (!fits(chunks)) {
    const std::string key = spec.pipeline_split_points.empty() ? "parallelism.pipeline_parallel_layers_per_stage " + std::to_string(spec.pipeline_layers_per_stage)
                                                               : "parallelism.pipeline_parallel_split_points";
    const std::string want = interleaved ? "a multiple of pipeline_parallel_degree " + std::to_string(stages) + ", at least twice it (Interleaved1F1B)"
                                         : "pipeline_parallel_degree " + std::to_string(stages);
    std::string hint;  // the most even layers_per_stage that fits, if any: ceil(layers / chunks) for P chunks (2P, 3P, ... interleaved)
    for (std::int64_t c = interleaved ? 2 * stages : stages; c <= layers && spec.pipeline_split_points.empty() && hint.empty(); c += stages) {
      const std::int64_t lps = (layers + c - 1) / c;
      if (fits((layers + lps - 1) / lps)) hint = ": use " + std::to_string(lps) + ", or unset it for an even split";
      if (!interleaved) break;
    }
    if (spec.pipeline_split_points.empty() && hint.empty()) hint = ": no count of layers a chunk fits; unset it for an even split";
    throw std::invalid_argument(key + " makes " + std::to_string(layers) + " layers into " + std::to_string(chunks) + (interleaved ? " chunks" : " stages") + ", not " + want +
                                (interleaved ? "" : (chunks > stages ? " (more are virtual stages: pipeline_parallel_schedule = \"Interleaved1F1B\")" : std::string())) + hint);
  }
  std::vector<std::int64_t> first{0};
  if (!spec.pipeline_split_points.empty()) {
    for (const auto& name : spec.pipeline_split_points) {
      const std::int64_t layer = layer_of(name);
      if (layer <= 0 || layer >= layers || models::layer_of(name) != name) {
        throw std::invalid_argument("parallelism.pipeline_parallel_split_points: \"" + name + "\" names no layer a stage can begin at: use \"layers.N\" with N from 1 to " +
                                    std::to_string(layers - 1) + " (on the command line, a list is comma-separated: layers.2,layers.4)");
      }
      if (layer <= first.back()) {
        throw std::invalid_argument("parallelism.pipeline_parallel_split_points must name each layer once, in increasing order (\"" + name +
                                    "\" comes after layers." + std::to_string(first.back()) + ")");
      }
      first.push_back(layer);
    }
    return first;
  }
  if (spec.pipeline_layers_per_stage > 0) {
    for (std::int64_t c = 1; c < chunks; ++c) first.push_back(c * spec.pipeline_layers_per_stage);
    return first;
  }
  for (std::int64_t c = 1; c < chunks; ++c) first.push_back(first.back() + layers / chunks + (c - 1 < layers % chunks ? 1 : 0));
  return first;
}

}  // namespace

PlacedJob place_job(const JobSpec& spec, PluginRegistry& registry) {
  PlacedJob job{forward_model(spec, spec.global_batch_size / spec.step.microbatches), sharding::make_mesh(spec.dims, spec.world_size / spec.pipeline.stages),
                {}, {}, {}, spec.reshard_after_forward};
  job.pipeline = spec.pipeline;
  if (spec.pipeline.stages > 1) {
    job.pipeline.first_layer = first_layers(spec, job.model.params);
    job.pipeline.virtual_stages = static_cast<std::int64_t>(job.pipeline.first_layer.size()) / spec.pipeline.stages;
  }
  if (spec.loss_parallel && spec.dims.tp > 1) {
    job.model.graph = vocab_parallel_cross_entropy(job.model.graph);
    job.loss_parallel = true;
  }
  if (spec.dims.cp > 1) {
    job.context_parallel_dim = job.mesh.dim_index("cp");
    job.context_parallel_allgather = spec.context_parallel_allgather;
    job.context_parallel_order = context_parallel_in_order(spec);
    if (job.context_parallel_order.empty()) job.context_parallel_chunks = 2 * spec.dims.cp;
    job.model.graph = context_parallel(job.model.graph, spec.seq_len, job.context_parallel_chunks);
  }
  const std::size_t forward_nodes = job.model.graph.num_nodes();
  append_train_step(job.model.graph, job.model.params, spec.step);
  if (job.context_parallel_dim >= 0) job.model.graph = context_parallel_weight_grads(job.model.graph);
  if (spec.activation_checkpoint.mode != "none") {
    job.model.graph = spec.step.microbatches == 1
                          ? checkpoint_activations(job.model.graph, forward_nodes, job.model.params, spec.activation_checkpoint, &job.checkpointed)
                          : checkpoint_activations(job.model.graph, forward_nodes_of(job.model.graph), job.model.params, spec.activation_checkpoint, &job.checkpointed);
  }
  StrategyInput in;
  const auto roles = sharding::parameter_roles(job.model.graph, job.model.params);
  for (const auto& init : job.model.init) {
    if (init.trainable) in.parameters.push_back({init.name, init.shape, roles.count(init.name) ? roles.at(init.name) : TensorRole::unknown});
  }
  for (const char* name : {"tokens", "labels"}) in.inputs.push_back({name, job.model.graph.find_input(name)->meta().shape, TensorRole::input});
  std::map<std::string, Options> options;
  if (!spec.tp_plan.empty()) {
    options["tensor_parallel"] = spec.tp_plan;
    if (spec.dims.tp == 1) {  // checked all the same: a plan's mistakes show before tensor parallelism is switched on
      StrategyInput one = in;
      one.mesh = {{"tp", 1}};
      registry.make_strategy("tensor_parallel", spec.tp_plan)->place(one);
    }
  }
  job.inputs = sharding::parallelize(registry, job.mesh, in, spec.strategies, options, &job.decided_by);
  if (!spec.auto_choices.empty()) {
    for (auto& line : job.decided_by) line += "; each op's strategy chosen by planner '" + spec.planner + "'";
  }
  std::map<std::string, sharding::Placements> params;
  for (const auto& p : job.model.params) params[p] = job.inputs.at(p);
  job.use = sharding::use_placements(job.mesh, params);
  // Expert parallelism: each rank uses its own experts, Shard(0) over the expert dim (the tokens
  // move instead). With ep carved from dp_shard (mesh dim efsdp), the experts are FSDP-sharded
  // over efsdp on their next dim (torchtitan's efsdp sharding) and gathered there for use.
  if (!job.model.expert_params.empty()) {
    const int ep_dim = job.mesh.dim_index(job.model.args.moe.expert_dim), efsdp = job.mesh.dim_index("efsdp");
    for (const auto& p : job.model.expert_params) {
      sharding::Placements& stored = job.inputs.at(p);
      sharding::Placements use = stored;
      if (ep_dim >= 0) stored[static_cast<std::size_t>(ep_dim)] = use[static_cast<std::size_t>(ep_dim)] = Placement::shard(0);
      if (efsdp >= 0) {
        const auto& shape = job.model.graph.find_input(p)->meta().shape;
        stored[static_cast<std::size_t>(efsdp)] = shape.size() > 1 && shape[1] % job.mesh.size(efsdp) == 0 ? Placement::shard(1) : Placement::replicate();
        use[static_cast<std::size_t>(efsdp)] = Placement::replicate();
      }
      job.use[p] = use;
    }
  }
  for (const auto& p : job.model.params) job.inputs["exp_avg." + p] = job.inputs["exp_avg_sq." + p] = job.inputs.at(p);
  for (std::int64_t k = 1; k < spec.step.microbatches; ++k) {  // every microbatch's rows go where microbatch 0's do
    for (const char* name : {"tokens", "labels"}) job.inputs[microbatch_input(name, k)] = job.inputs.at(name);
  }
  const sharding::Placements whole(static_cast<std::size_t>(job.mesh.ndim()), Placement::replicate());
  for (const auto& b : updated_buffers(job.model.graph, job.model.params)) job.inputs[b] = whole;  // an MoE layer's expert_bias: whole on every rank
  for (const auto& s : step_state_names(job.model.graph, job.model.params)) job.outputs["next." + s] = job.inputs.at(s);
  for (const auto& [name, v] : job.model.graph.outputs()) {  // the whole step's load on every rank (summed over data-parallel ranks)
    if (is_tokens_per_expert(name)) job.outputs[name] = whole;
  }
  if (spec.sequence_parallel && spec.dims.tp == 1) {
    job.sequence_parallel_off = "parallelism.enable_sequence_parallel acts only with parallelism.tensor_parallel_degree > 1";
  } else if (spec.sequence_parallel && sharding::sequence_parallel_values(job.model.graph, spec.dims.tp).empty()) {
    job.sequence_parallel_off = "the model has no rms_norm or layer_norm op over a sequence of at least tensor_parallel_degree (" + std::to_string(spec.dims.tp) +
                                ") positions to shard (a norm written as its arithmetic, as Hugging Face exports do, is not one)";
  } else if (spec.sequence_parallel) {
    job.sequence_parallel_dim = job.mesh.dim_index("tp");
  }
  if (spec.fault_tolerance.enable) job.fault_domain_dim = job.mesh.dim_index("dp_replicate");
  if (!spec.auto_choices.empty()) {
    for (const auto& node : job.model.graph.nodes()) {
      if (const auto it = spec.auto_choices.find(node->id()); it != spec.auto_choices.end()) job.forced[node.get()] = it->second;
    }
  }
  return job;
}

CompiledJob::CompiledJob(const JobSpec& spec, PluginRegistry& registry) : job(place_job(spec, registry)), plan(propagate_job(job)) {}

CompiledJob compile_job(const JobSpec& spec, PluginRegistry& registry) { return CompiledJob(spec, registry); }

std::map<std::int64_t, std::map<int, std::string>> balance_choices(const JobSpec& spec, PluginRegistry& registry) {
  const std::int64_t rows = std::max<std::int64_t>(spec.global_batch_size, (65536 + spec.seq_len - 1) / spec.seq_len);
  return plan_choices(CompiledJob(rows_spec(spec, rows, {}), registry).plan);
}

JobSpec rows_spec(const JobSpec& spec, std::int64_t rows, const std::map<std::int64_t, std::map<int, std::string>>& choices) {
  JobSpec s = spec;
  s.global_batch_size = spec.dims.dp_replicate * spec.dims.dp_shard * rows;
  s.auto_choices = choices;
  return s;
}

std::map<std::int64_t, std::map<int, std::string>> plan_choices(const sharding::DistributedPlan& plan) {
  std::map<std::int64_t, std::map<int, std::string>> out;
  for (const auto& node : plan.graph->nodes()) {
    for (int i = 0; i < plan.mesh.ndim(); ++i) {
      if (plan.mesh.size(i) > 1) out[node->id()][i] = sharding::taken_signature(plan, *node, i);
    }
  }
  return out;
}

sharding::DistributedPlan propagate_job(const PlacedJob& job) {
  return sharding::propagate(job.model.graph, job.mesh, job.inputs, job.outputs, job.use, job.reshard_after_forward, job.sequence_parallel_dim,
                             job.context_parallel_dim, job.context_parallel_allgather, job.forced.empty() ? nullptr : &job.forced, job.fault_domain_dim);
}

sharding::DistributedPlan propagate_job(const PlacedJob& job, const spmdx::Planner& planner, const sharding::IntraOpCostModel& cost,
                                        std::vector<sharding::IntraOpDim>* report) {
  return sharding::propagate_optimal(job.model.graph, job.mesh, job.inputs, job.outputs, job.use, job.reshard_after_forward, job.sequence_parallel_dim,
                                     job.context_parallel_dim, job.context_parallel_allgather, planner, cost, report);
}

ContextParallelSummary context_parallel_summary(const JobSpec& spec, const PlacedJob& job, const sharding::DistributedPlan& plan) {
  ContextParallelSummary s;
  s.tokens_per_rank = spec.seq_len;
  if (job.context_parallel_dim < 0) return s;
  const auto dim = static_cast<std::size_t>(job.context_parallel_dim);
  s.degree = job.mesh.size(job.context_parallel_dim);
  s.tokens_per_rank = spec.seq_len / s.degree;
  s.pieces = job.context_parallel_chunks;
  s.in_order_why = job.context_parallel_order;
  const ir::Value* loss = job.model.graph.find_output("loss");
  const std::set<const ir::Node*> forward = loss != nullptr ? ir::producers_of(loss) : std::set<const ir::Node*>{};
  for (const auto& node : job.model.graph.nodes()) {
    if (node->op() != "sdpa" || forward.count(node.get()) == 0) continue;
    ++s.attentions;
    const auto& in = plan.inputs.at(node.get());
    if (in[0][dim] == Placement::shard(2) && in[1][dim].is_replicate()) ++s.query_rows;
    else if (in[0][dim].is_shard()) ++s.all_to_all;
  }
  if (const std::int64_t m = spec.step.microbatches; m > 1 && s.attentions % m == 0 && s.query_rows % m == 0 && s.all_to_all % m == 0) {
    s.attentions /= m, s.query_rows /= m, s.all_to_all /= m;  // a microbatch's (the same plan each)
  }
  return s;
}

std::vector<ShortParameters> short_parameters(const JobSpec& spec, const PlacedJob& job) {
  std::vector<ShortParameters> out;
  const auto& dims = job.mesh.dims();
  for (std::size_t d = 0; d < dims.size(); ++d) {
    const std::int64_t k = dims[d].size;
    if (k <= 1) continue;
    ShortParameters s;
    s.mesh_dim = dims[d].name;
    s.degree = k;
    bool shards = dims[d].name == "dp_shard", long_left_whole = false;
    for (const auto& name : job.model.params) {
      auto placed = job.inputs.find(name);
      const ir::Value* v = job.model.graph.find_input(name);
      if (placed == job.inputs.end() || v == nullptr || d >= placed->second.size()) continue;
      const ir::TensorMeta& m = v->meta();
      if (!placed->second[d].is_replicate()) {
        shards = shards || placed->second[d].is_shard();
        continue;
      }
      if (!m.shape.empty() && m.shape[0] >= k) {
        long_left_whole = true;  // whole by the strategy's design (tp's norms, ddp): not for its length
        continue;
      }
      s.parameters.push_back({name, m.shape, m.nbytes()});
      s.extra_bytes += 4 * (m.nbytes() - m.nbytes() / k);
    }
    if (!shards || long_left_whole || s.parameters.empty()) continue;
    s.all = s.parameters.size() == job.model.params.size();
    auto bound = spec.strategies.find(dims[d].name);
    try {
      s.strategy = bound != spec.strategies.end() ? bound->second : sharding::strategy_for(dims[d].name);
    } catch (const std::invalid_argument&) {
      s.strategy = "";  // a dim no strategy decides (cp): named alone
    }
    out.push_back(std::move(s));
  }
  return out;
}

namespace {
// "layers.0.attention.wq.weight" -> "wq.weight": a glob's tail for every layer's copy.
std::string last_two_parts(const std::string& name) {
  const std::size_t last = name.rfind('.');
  if (last == std::string::npos || last == 0) return name;
  const std::size_t before = name.rfind('.', last - 1);
  return before == std::string::npos ? name : name.substr(before + 1);
}

// The first `most` of `names`, then "and N more" for the rest.
std::vector<std::string> first_of(const std::vector<std::string>& names, std::size_t most) {
  std::vector<std::string> shown(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(std::min(names.size(), most)));
  if (names.size() > shown.size()) shown.push_back("and " + std::to_string(names.size() - shown.size()) + " more");
  return shown;
}
}  // namespace

std::vector<std::string> tp_replicated_parameters(const JobSpec& spec, const PlacedJob& job) {
  std::vector<std::string> out;
  const auto& dims = job.mesh.dims();
  std::size_t tp = dims.size();
  for (std::size_t d = 0; d < dims.size(); ++d) {
    if (dims[d].name == "tp" && dims[d].size > 1) tp = d;
  }
  if (tp == dims.size()) return out;
  std::int64_t total = 0;
  for (const auto& name : job.model.params) {
    if (const ir::Value* v = job.model.graph.find_input(name)) total += v->meta().numel();
  }
  auto bound = spec.strategies.find("tp");
  const std::string strategy = bound != spec.strategies.end() ? bound->second : sharding::strategy_for("tp");
  std::vector<std::string> small;  // replicated matrices of at most 1% each
  double small_share = 0;
  for (const auto& name : job.model.params) {
    auto placed = job.inputs.find(name);
    const ir::Value* v = job.model.graph.find_input(name);
    if (placed == job.inputs.end() || v == nullptr || tp >= placed->second.size() || !placed->second[tp].is_replicate()) continue;
    const ir::TensorMeta& m = v->meta();
    const double share = total > 0 ? static_cast<double>(m.numel()) / static_cast<double>(total) : 0.0;
    if (m.rank() < 2) continue;
    if (share <= 0.01) {  // small alone; many of them are not (a plan that names only the embeddings)
      small.push_back(name);
      small_share += share;
      continue;
    }
    char pct[32];
    std::snprintf(pct, sizeof pct, "%.1f%%", 100.0 * share);
    out.push_back(strategy + " on tp (" + std::to_string(dims[tp].size) + " ranks) keeps " + name + " " + ir::shape_str(m.shape) + " (" + pct +
                  " of the model's parameters) whole on every tp rank: the numbers are the same, the memory is not; to shard it, name it in "
                  "[parallelism.tp_plan] (\"" + name + "\" = \"colwise\", \"rowwise\" or \"shard(d)\")");
  }
  if (small_share > 0.1) {
    char pct[32];
    std::snprintf(pct, sizeof pct, "%.1f%%", 100.0 * small_share);
    out.push_back(strategy + " on tp (" + std::to_string(dims[tp].size) + " ranks) keeps " + std::to_string(small.size()) + " weight matrices, each under 1% but " +
                  pct + " of the model's parameters together, whole on every tp rank (" + join(first_of(small, 3)) +
                  "): the numbers are the same, the memory is not; to shard them, name them in [parallelism.tp_plan] (globs such as \"*." +
                  last_two_parts(small.front()) + "\" = \"colwise\")");
  }
  return out;
}

std::string ShortParameters::line() const {
  std::int64_t bytes = 0, shortest = degree;
  for (const auto& p : parameters) bytes += p.bytes, shortest = std::min<std::int64_t>(shortest, p.shape.empty() ? 1 : p.shape[0]);
  std::vector<std::string> named;
  for (const auto& p : parameters) named.push_back(p.name + " " + ir::shape_str(p.shape));
  const std::string n = std::to_string(parameters.size()) + (parameters.size() == 1 ? " parameter" : " parameters");
  const std::string which = all ? "every parameter (" + n + ", the whole model, " + human_bytes(static_cast<double>(bytes)) + ")"
                                : n + " (" + human_bytes(static_cast<double>(bytes)) + ")";
  return (strategy.empty() ? "" : strategy + " on ") + mesh_dim + " (" + std::to_string(degree) + " ranks) keeps " + which +
         " whole on every rank, not sharded: " + (parameters.size() == 1 ? "its" : "their") + " dim 0 is shorter than " + std::to_string(degree) + " (" +
         join(first_of(named, 4)) + "); that costs each rank " + human_bytes(static_cast<double>(extra_bytes)) + " more than an even share of them (parameters, gradients and AdamW state: 4 x " +
         human_bytes(static_cast<double>(bytes)) + ", less 1/" + std::to_string(degree) + " of it; FSDP2 would pad them and leave some ranks an empty shard)" +
         (shortest > 1 ? "; a degree of at most " + std::to_string(shortest) + " shards them all" : "");
}

std::string ContextParallelSummary::line() const {
  if (degree <= 1) return "";
  std::string out = "context parallel: cp " + std::to_string(degree) + ", " + std::to_string(tokens_per_rank) + " of " + std::to_string(tokens_per_rank * degree) +
                    " tokens a rank, ";
  out += pieces > 1 ? "load-balanced (" + std::to_string(pieces) + " pieces: rank r of cp holds pieces r and " + std::to_string(pieces - 1) + " - r)"
                    : "in order (" + in_order_why + ")";
  if (attentions == 0) return out + "; the model has no sdpa op (attention written as matmuls and softmax is split like any other op)";
  out += "; attention: " + std::to_string(query_rows) + " of " + std::to_string(attentions) + " split their query rows and all-gather k and v";
  if (all_to_all > 0) out += ", " + std::to_string(all_to_all) + " split batch or heads by all_to_all";
  if (const std::int64_t whole = attentions - query_rows - all_to_all; whole > 0) out += ", " + std::to_string(whole) + " run whole on every rank";
  return out;
}

PlacedValidation place_validation(const JobSpec& spec, const PlacedJob& job) {
  PlacedValidation v{forward_model(spec, spec.validation.global_batch_size), {}};
  if (job.context_parallel_dim >= 0) v.model.graph = context_parallel(v.model.graph, spec.seq_len, job.context_parallel_chunks);
  for (const ir::Value* in : v.model.graph.inputs()) {  // buffers (RoPE tables) have no placement given: replicated, as the train step's
    if (const auto it = job.inputs.find(in->name()); it != job.inputs.end()) v.inputs[in->name()] = it->second;
  }
  return v;
}

std::int64_t local_parameter_bytes(const PlacedJob& job, std::int64_t rank) {
  std::int64_t bytes = 0;
  const auto coord = job.mesh.coordinate(rank);
  for (const auto& p : job.model.params) {
    const ir::Value* v = job.model.graph.find_input(p);
    ir::TensorMeta local = v->meta();
    local.shape = sharding::ShardingSpec{job.inputs.at(p), v->meta()}.local_shape(job.mesh, coord);
    bytes += local.nbytes();
  }
  return bytes;
}

}  // namespace spmdx::job
