#include "spmdx/job/validation.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>

#include "spmdx/exec/shards.h"
#include "spmdx/sharding/propagate.h"

namespace spmdx::job {
using namespace spmdx::exec;
using namespace spmdx::train;

Validation::Validation(const JobSpec& spec, const PlacedJob& job, std::int64_t rank, CommBackend* backend, double timeout, Device& device,
           const data::Tokenizer& tokenizer, std::vector<MemoryType> rank_memory)
    : placed(place_validation(spec, job)),
      plan(sharding::propagate(placed.model.graph, job.mesh, placed.inputs, {}, job.use, false, -1, job.context_parallel_dim, job.context_parallel_allgather)),
      graph(stage_of(sharding::rank_graph(plan, rank % job.mesh.size()), job, rank)),
      executor(graph, run_mesh(job), rank, backend, timeout, options(spec.plan), &device, std::move(rank_memory)),
      dataset(validation_data(spec), tokenizer),
      steps(spec.validation.steps > 0 ? spec.validation.steps
                                      : std::max<std::int64_t>(1, static_cast<std::int64_t>(dataset.stream().size()) /
                                                                      (spec.validation.global_batch_size * spec.seq_len))),
      mesh(job.mesh),
      coord(job.mesh.coordinate(rank % job.mesh.size())),
      on(device.device()) {}


ir::Graph Validation::stage_of(ir::Graph g, const PlacedJob& job, std::int64_t rank) {
  if (job.pipeline.stages == 1) return g;
  train::PipelineSpec forward_only = job.pipeline;
  forward_only.microbatches = 1;
  return std::move(train::stage_graph(g, forward_only, job.model.params, rank, job.mesh.size()).graph);
}

plan::PlanOptions Validation::options(plan::PlanOptions o) {
  o.donate_state = false;  // the inputs are the train state: never a buffer of this graph's
  return o;
}

double Validation::run(const TensorMap& state) {
  c10::InferenceMode no_autograd;
  dataset.restore({});
  const sharding::Placements& tokens_pl = plan.placement.at(placed.model.graph.find_input("tokens"));
  const sharding::Placements& labels_pl = plan.placement.at(placed.model.graph.find_input("labels"));
  const std::int64_t rows = dataset.options().batch_size, seq = dataset.options().seq_len;
  double sum = 0;
  for (std::int64_t i = 0; i < steps; ++i) {
    const data::Batch batch = dataset.next_batch();
    TensorMap feed;
    for (const ir::Value* in : graph.inputs()) {
      if (const auto it = state.find(in->name()); it != state.end()) feed.emplace(in->name(), it->second);
    }
    feed["tokens"] = shard_tensor(at::tensor(batch.tokens, at::kLong).reshape({rows, seq}), tokens_pl, mesh, coord).to(on);
    feed["labels"] = shard_tensor(at::tensor(batch.labels, at::kLong).reshape({rows, seq}), labels_pl, mesh, coord).to(on);
    sum += executor.run(feed).at("loss").item<double>();
  }
  return sum / static_cast<double>(steps);
}

}  // namespace spmdx::job
