// sample_column: shards the weights of the linear layers (TensorInfo::role linear or output,
// whatever the model names them) on dim 1 (column-wise) across the mesh dim the host binds it to
// (StrategyInput::mesh_dim); embeddings, norms and the rest stay whole.
#include <spmdx/plugin.h>

namespace {

class SampleColumn final : public spmdx::Strategy {
 public:
  spmdx::PlacementMap place(const spmdx::StrategyInput& in) const override {
    spmdx::PlacementMap out;
    for (const auto& p : in.parameters) {
      std::vector<spmdx::Placement> placements(in.mesh.size(), spmdx::Placement::replicate());
      const bool linear = p.role == spmdx::TensorRole::linear || p.role == spmdx::TensorRole::output;
      if (linear && p.shape.size() == 2) placements[static_cast<std::size_t>(in.mesh_dim)] = spmdx::Placement::shard(1);
      out[p.name] = placements;
    }
    return out;
  }
};

void register_sample(spmdx::Registrar& r) {
  r.add_strategy("sample_column", [](const spmdx::Options&) { return std::make_unique<SampleColumn>(); });
}

}  // namespace

SPMDX_PLUGIN("sample_column", strategy, "0.0.1", "sample out-of-tree plugin: linear weights S(1)", register_sample)
