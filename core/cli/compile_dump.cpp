// A compiled job as documents (compile_dump.h).
#include "compile_dump.h"

#include <nlohmann/json.hpp>

#include "spmdx/ir/serialize.h"
#include "spmdx/plan/memory_plan.h"
#include "spmdx/plan/runtime_plan.h"

namespace spmdx::cli {

std::vector<std::pair<std::string, std::string>> dump_documents(const spmdx::job::PlacedJob& job, const spmdx::sharding::DistributedPlan& plan,
                                                                const spmdx::job::JobSpec& spec, std::int64_t ranks, bool everything) {
  std::vector<std::pair<std::string, std::string>> docs;
  if (everything) docs.emplace_back("logical.txt", job.model.graph.str());
  docs.emplace_back("logical.json", spmdx::ir::to_json(job.model.graph));
  if (everything) docs.emplace_back("plan.txt", plan.str());
  if (job.pipeline.stages > 1 || job.context_parallel_dim >= 0) {
    nlohmann::json p = nlohmann::json::parse(plan.to_json());
    if (job.pipeline.stages > 1) {  // the stages, and the mesh the rank graphs' collectives count their dims in
      p["pipeline"] = {{"stages", job.pipeline.stages}, {"schedule", job.pipeline.schedule}, {"microbatches", job.pipeline.microbatches},
                       {"first_layer", job.pipeline.first_layer}};
      p["run_mesh"] = nlohmann::json::array();
      const spmdx::sharding::DeviceMesh mesh = spmdx::job::run_mesh(job);
      for (const auto& d : mesh.dims()) p["run_mesh"].push_back({{"name", d.name}, {"size", d.size}});
    }
    if (job.context_parallel_dim >= 0) {  // what spmdx diff names when two jobs' context parallelism differs
      p["context_parallel"] = {{"degree", job.mesh.size(job.context_parallel_dim)}, {"load_balance", job.context_parallel_chunks > 1},
                               {"rotate_method", job.context_parallel_allgather ? "allgather" : "auto"}};
    }
    docs.emplace_back("plan.json", p.dump(1));
  } else {
    docs.emplace_back("plan.json", plan.to_json());
  }
  for (std::int64_t r = 0; r < ranks; ++r) {
    const std::string rank = "rank" + std::to_string(r);
    const spmdx::ir::Graph g = spmdx::job::rank_program(job, plan, r, spec);
    const spmdx::sharding::DeviceMesh mesh = spmdx::job::run_mesh(job);
    const spmdx::plan::RuntimePlan runtime = spmdx::plan::make_runtime_plan(g, mesh, spec.plan);
    if (everything) {
      docs.emplace_back(rank + ".txt", g.str());
      docs.emplace_back(rank + ".plan.txt", runtime.str(g, mesh));
      docs.emplace_back(rank + ".memory.txt", spmdx::plan::plan_memory(g, runtime).report(g, runtime));
      if (job.pipeline.stages > 1) docs.emplace_back(rank + ".schedule.txt", spmdx::train::schedule_table(job.pipeline, r / job.mesh.size()));
    }
    docs.emplace_back(rank + ".json", spmdx::ir::to_json(g));
    docs.emplace_back(rank + ".plan.json", runtime.to_json(g, mesh));
  }
  return docs;
}

}  // namespace spmdx::cli
