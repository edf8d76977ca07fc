// [validation]: the held-out loss every validation.freq steps, on the job's mesh.
#pragma once

#include <cstdint>
#include <vector>

#include <c10/core/Device.h>

#include "spmdx/data/text_dataset.h"
#include "spmdx/data/tokenizer.h"
#include "spmdx/exec/device.h"
#include "spmdx/exec/distributed.h"
#include "spmdx/job/compile.h"

namespace spmdx::job {

// [validation]: the forward-only graph on the job's mesh with its own executor (which donates
// nothing: it reads the train state), and the held-out data, read from its start at each
// validation so that every validation sees the same batches (as torchtitan's validator makes a
// fresh iterator over its data loader each time).
struct Validation {
  /// `rank_memory`: each rank's memory in a mesh of CUDA and CPU ranks (DistributedExecutor's).
  Validation(const JobSpec& spec, const PlacedJob& job, std::int64_t rank, CommBackend* backend, double timeout, exec::Device& device,
             const data::Tokenizer& tokenizer, std::vector<MemoryType> rank_memory = {});

  // With pipeline stages, `rank`'s stage of the forward (one microbatch: the stages in turn).
  static ir::Graph stage_of(ir::Graph g, const PlacedJob& job, std::int64_t rank);

  static plan::PlanOptions options(plan::PlanOptions o);

  // The mean loss of `steps` held-out batches under the state's weights. Throws what the
  // executor throws (CommError when a collective fails).
  double run(const exec::TensorMap& state);

  PlacedValidation placed;
  sharding::DistributedPlan plan;
  ir::Graph graph;
  exec::DistributedExecutor executor;
  data::TextDataset dataset;
  std::int64_t steps;
  const sharding::DeviceMesh& mesh;
  std::vector<std::int64_t> coord;
  c10::Device on;
};

}  // namespace spmdx::job
