// fsdp: fully sharded data parallel (ZeRO-3, Rajbhandari et al. 2020; PyTorch FSDP2):
// parameters, and so their gradients and AdamW state, Shard(0) on the "dp_shard" mesh dim;
// batch inputs Shard(0) on "dp_shard" and "dp_replicate" (HSDP: replicated across
// dp_replicate). The core's propagation then all_gathers a parameter where an op needs it
// whole and reduce_scatters its gradient.
#include <spmdx/plugin.h>

#include <stdexcept>

namespace {

class Fsdp final : public spmdx::Strategy {
 public:
  spmdx::PlacementMap place(const spmdx::StrategyInput& in) const override {
    int shard_dim = -1;
    std::int64_t data_degree = 1;
    for (std::size_t i = 0; i < in.mesh.size(); ++i) {
      if (in.mesh[i].name == "dp_shard") shard_dim = static_cast<int>(i);
      if (in.mesh[i].name == "dp_shard" || in.mesh[i].name == "dp_replicate") data_degree *= in.mesh[i].size;
    }
    if (shard_dim < 0) throw std::invalid_argument("fsdp needs a mesh dim named dp_shard (data_parallel_shard_degree)");
    const std::int64_t k = in.mesh[static_cast<std::size_t>(shard_dim)].size;
    spmdx::PlacementMap out;
    for (const auto& p : in.parameters) {
      std::vector<spmdx::Placement> pl(in.mesh.size(), spmdx::Placement::replicate());
      // A parameter with fewer rows than ranks stays whole (FSDP2 pads instead).
      if (!p.shape.empty() && p.shape[0] >= k) pl[static_cast<std::size_t>(shard_dim)] = spmdx::Placement::shard(0);
      out[p.name] = pl;
    }
    for (const auto& t : in.inputs) {
      if (t.shape.empty() || t.shape[0] % data_degree != 0) {
        throw std::invalid_argument("fsdp: input '" + t.name + "' has batch size " +
                                    (t.shape.empty() ? std::string("(a scalar)") : std::to_string(t.shape[0])) +
                                    ", not a multiple of the data-parallel degree " + std::to_string(data_degree));
      }
      std::vector<spmdx::Placement> pl;
      for (const auto& d : in.mesh) {
        pl.push_back(d.name == "dp_shard" || d.name == "dp_replicate" ? spmdx::Placement::shard(0) : spmdx::Placement::replicate());
      }
      out[t.name] = pl;
    }
    return out;
  }
};

void register_fsdp(spmdx::Registrar& r) {
  r.add_strategy("fsdp", [](const spmdx::Options&) { return std::make_unique<Fsdp>(); });
}

}  // namespace

SPMDX_PLUGIN("fsdp", strategy, "0.1.0",
             "Fully sharded data parallel (ZeRO-3, as FSDP2): parameters and optimizer state S(0) on dp_shard",
             register_fsdp)
