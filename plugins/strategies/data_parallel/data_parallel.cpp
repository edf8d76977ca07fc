// data_parallel: parameters replicated, batch inputs sharded on dim 0 across the mesh dim the
// host binds this strategy to (StrategyInput::mesh_dim; dp_replicate by default), as PyTorch
// DDP; gradients then come out Partial and the core's rewriter inserts the all_reduce.
#include <spmdx/plugin.h>

#include <stdexcept>

namespace {

class DataParallel final : public spmdx::Strategy {
 public:
  spmdx::PlacementMap place(const spmdx::StrategyInput& in) const override {
    if (in.mesh_dim < 0 || in.mesh_dim >= static_cast<int>(in.mesh.size())) {
      throw std::invalid_argument("data_parallel: mesh_dim " + std::to_string(in.mesh_dim) + " is not a dim of the mesh (" +
                                  std::to_string(in.mesh.size()) + " dims)");
    }
    const auto dim = static_cast<std::size_t>(in.mesh_dim);
    const spmdx::MeshDim& d = in.mesh[dim];
    spmdx::PlacementMap out;
    for (const auto& p : in.parameters) {
      out[p.name] = std::vector<spmdx::Placement>(in.mesh.size(), spmdx::Placement::replicate());
    }
    for (const auto& t : in.inputs) {
      if (t.shape.empty() || t.shape[0] % d.size != 0) {
        throw std::invalid_argument("data_parallel: input '" + t.name + "' has batch size " +
                                    (t.shape.empty() ? std::string("(a scalar)") : std::to_string(t.shape[0])) +
                                    ", not a multiple of the data-parallel degree " + std::to_string(d.size) + " (" + d.name +
                                    "): make the global batch size a multiple of " + std::to_string(d.size));
      }
      std::vector<spmdx::Placement> placements(in.mesh.size(), spmdx::Placement::replicate());
      placements[dim] = spmdx::Placement::shard(0);
      out[t.name] = std::move(placements);
    }
    return out;
  }
};

void register_data_parallel(spmdx::Registrar& r) {
  r.add_strategy("data_parallel", [](const spmdx::Options&) { return std::make_unique<DataParallel>(); });
}

}  // namespace

SPMDX_PLUGIN("data_parallel", strategy, "0.2.0",
             "Data parallel (as DDP): parameters replicated, batch sharded on dim 0 across its mesh dim",
             register_data_parallel)
