// fsdp: fully sharded data parallel (ZeRO-3, Rajbhandari et al. 2020; PyTorch FSDP2):
// parameters, and so their gradients and AdamW state, Shard(0) on the mesh dim the host binds
// this strategy to (StrategyInput::mesh_dim; dp_shard by default), batch inputs Shard(0) there
// too (HSDP: data_parallel shards the batch on dp_replicate). The core's propagation then
// all_gathers a parameter where an op needs it whole and reduce_scatters its gradient.
#include <spmdx/plugin.h>

#include <stdexcept>

namespace {

class Fsdp final : public spmdx::Strategy {
 public:
  spmdx::PlacementMap place(const spmdx::StrategyInput& in) const override {
    if (in.mesh_dim < 0 || in.mesh_dim >= static_cast<int>(in.mesh.size())) {
      throw std::invalid_argument("fsdp: mesh_dim " + std::to_string(in.mesh_dim) + " is not a dim of the mesh (" + std::to_string(in.mesh.size()) +
                                  " dims)");
    }
    const auto shard_dim = static_cast<std::size_t>(in.mesh_dim);
    const std::int64_t k = in.mesh[shard_dim].size;
    spmdx::PlacementMap out;
    for (const auto& p : in.parameters) {
      std::vector<spmdx::Placement> pl(in.mesh.size(), spmdx::Placement::replicate());
      // A parameter with fewer rows than ranks stays whole (FSDP2 pads instead).
      if (!p.shape.empty() && p.shape[0] >= k) pl[shard_dim] = spmdx::Placement::shard(0);
      out[p.name] = pl;
    }
    for (const auto& t : in.inputs) {
      if (t.shape.empty() || t.shape[0] % k != 0) {
        throw std::invalid_argument("fsdp: input '" + t.name + "' has batch size " +
                                    (t.shape.empty() ? std::string("(a scalar)") : std::to_string(t.shape[0])) +
                                    ", not a multiple of the data-parallel degree " + std::to_string(k) + " (" + in.mesh[shard_dim].name + ")");
      }
      std::vector<spmdx::Placement> pl(in.mesh.size(), spmdx::Placement::replicate());
      pl[shard_dim] = spmdx::Placement::shard(0);
      out[t.name] = pl;
    }
    return out;
  }
};

void register_fsdp(spmdx::Registrar& r) {
  r.add_strategy("fsdp", [](const spmdx::Options&) { return std::make_unique<Fsdp>(); });
}

}  // namespace

SPMDX_PLUGIN("fsdp", strategy, "0.2.0",
             "Fully sharded data parallel (ZeRO-3, as FSDP2): parameters and optimizer state S(0) on its mesh dim (dp_shard)",
             register_fsdp)
