// data_parallel: parameters replicated on every mesh dim, batch inputs sharded on dim 0 across
// the data-parallel mesh dims (as PyTorch DDP; gradients then come out Partial and the core's
// rewriter inserts the all_reduce).
//
// Data-parallel mesh dims are those named "dp", "dp_replicate" or "dp_shard" (torchtitan's
// names); other dims (e.g. "tp") see replicated inputs.
#include <spmdx/plugin.h>

#include <stdexcept>

namespace {

bool is_data_parallel_dim(const std::string& name) {
  return name == "dp" || name == "dp_replicate" || name == "dp_shard";
}

class DataParallel final : public spmdx::Strategy {
 public:
  spmdx::PlacementMap place(const spmdx::StrategyInput& in) const override {
    std::int64_t degree = 1;
    std::string dims;
    std::string mesh_text;
    for (const auto& d : in.mesh) {
      mesh_text += (mesh_text.empty() ? "" : ", ") + d.name + "(" + std::to_string(d.size) + ")";
      if (is_data_parallel_dim(d.name)) {
        degree *= d.size;
        dims += (dims.empty() ? "" : "x") + d.name;
      }
    }
    if (dims.empty()) {
      throw std::invalid_argument("data_parallel needs a mesh dim named dp, dp_replicate or dp_shard; the mesh has " +
                                  (mesh_text.empty() ? std::string("no dims") : mesh_text));
    }
    spmdx::PlacementMap out;
    for (const auto& p : in.parameters) {
      out[p.name] = std::vector<spmdx::Placement>(in.mesh.size(), spmdx::Placement::replicate());
    }
    for (const auto& t : in.inputs) {
      if (t.shape.empty() || t.shape[0] % degree != 0) {
        throw std::invalid_argument("data_parallel: input '" + t.name + "' has batch size " +
                                    (t.shape.empty() ? std::string("(a scalar)") : std::to_string(t.shape[0])) +
                                    ", not a multiple of the data-parallel degree " + std::to_string(degree) + " (" +
                                    dims + "): make the global batch size a multiple of " + std::to_string(degree));
      }
      std::vector<spmdx::Placement> placements;
      for (const auto& d : in.mesh) {
        placements.push_back(is_data_parallel_dim(d.name) ? spmdx::Placement::shard(0) : spmdx::Placement::replicate());
      }
      out[t.name] = std::move(placements);
    }
    return out;
  }
};

void register_data_parallel(spmdx::Registrar& r) {
  r.add_strategy("data_parallel", [](const spmdx::Options&) { return std::make_unique<DataParallel>(); });
}

}  // namespace

SPMDX_PLUGIN("data_parallel", strategy, "0.1.0",
             "Data parallel (as DDP): parameters replicated, batch sharded on dim 0 across dp dims",
             register_data_parallel)
