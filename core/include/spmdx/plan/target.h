// Hardware you are not on: the profiles `spmdx compile --target` and `[planning] target` price a
// plan for (the cost model of plan/estimate.h at another machine's rates), so a GPU job is
// planned from a laptop. Each profile holds one device's datasheet figures: dense peak FLOP/s
// per dtype, memory and its bandwidth, and the links between devices (NVLink within a host,
// InfiniBand/RoCE between hosts, one NIC per GPU). No LibTorch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spmdx/plan/estimate.h"

namespace spmdx::plan {

/// One device of a target machine, from its vendor's datasheet (`source`). FLOP/s are dense
/// (without 2:4 sparsity, half the datasheets' headline figures).
struct TargetProfile {
  std::string name;   ///< what --target takes: "h100-sxm", "h200", "b200"
  std::string label;  ///< "NVIDIA H100 SXM5 80GB"
  double float32_flops = 0;   ///< FP32 (CUDA cores), FLOP/s
  double tf32_flops = 0;      ///< TF32 tensor cores (training.allow_tf32), FLOP/s
  double bfloat16_flops = 0;  ///< BF16 tensor cores, FLOP/s (FP16 the same on these devices)
  double memory_bytes = 0;    ///< device memory (HBM), bytes
  double memory_bytes_per_second = 0;  ///< HBM bandwidth
  std::int64_t devices_per_host = 8;   ///< GPUs sharing a host's NVLink domain (HGX/DGX boards: 8)
  sharding::CostModel intra_host;      ///< NVLink, per direction: alpha (s a message), beta (bytes/s)
  sharding::CostModel inter_host;      ///< the GPU's own NIC: alpha, beta (bytes/s)
  std::string source;                  ///< the datasheets the figures are from

  /// Peak FLOP/s of a matmul in `dtype` ("float32", "bfloat16", "float16"); float32 on tensor
  /// cores (TF32) when `tf32`. Throws std::invalid_argument for another dtype.
  double peak_flops(const std::string& dtype, bool tf32) const;
  /// The cost model's rates for one device of it (one "thread": a device is one rank): matmuls at
  /// the peak of the compute dtype (an upper bound: real kernels reach 50-80% of it), memory-bound
  /// ops at the HBM bandwidth, a kernel launch's fixed cost, and the links.
  Calibration calibration(const std::string& dtype, bool tf32) const;
};

/// The share of a target's device memory a plan may take (parallelism.memory_budget's default
/// under planning.target): the planned peak counts the tensors' bytes, as
/// torch.cuda.max_memory_allocated; the CUDA context (~0.5 GB), NCCL's buffers and the caching
/// allocator's fragmentation take the rest.
constexpr double kTargetMemoryShare = 0.9;

/// The profiles spmdx knows: H100 SXM, H200 (SXM), B200 (HGX).
const std::vector<TargetProfile>& target_profiles();
/// The one named (case-insensitive, '-' and '_' alike, "h100" for "h100-sxm"; planning.target
/// itself takes the lowercase names), or nullptr. "this-machine" and "" are not profiles (the
/// machine's own calibration).
const TargetProfile* find_target(const std::string& name);
/// The profile of a CUDA device name as the driver reports it ("NVIDIA H100 80GB HBM3" is the
/// SXM part; "NVIDIA H200", "NVIDIA B200"), or nullptr (a PCIe or NVL H100, another GPU).
const TargetProfile* target_for_device_name(const std::string& device_name);
/// "h100-sxm, h200, b200, this-machine": the names --target takes.
std::string target_names();

}  // namespace spmdx::plan
