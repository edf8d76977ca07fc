#include "spmdx/plan/target.h"

#include <algorithm>
#include <cctype>
#include <stdexcept>

namespace spmdx::plan {
namespace {

// Alpha per message: NCCL's ring within a host of 8 NVLink GPUs spends about 1.5 us a step
// (nccl-tests' small-message all_reduce, ~20 us over 14 steps); between hosts, InfiniBand's
// ~2 us wire latency plus the proxy's, about 5 us.
constexpr double kNvlinkAlpha = 1.5e-6, kIbAlpha = 5e-6;

std::vector<TargetProfile> make_profiles() {
  std::vector<TargetProfile> p;
  // NVIDIA H100 Tensor Core GPU Architecture whitepaper (H100 SXM5, dense): FP32 66.9 TFLOPS,
  // TF32 494.7, BF16/FP16 with FP32 accumulate 989.4 (the datasheet's 67, 989 and 1,979 are
  // rounded, the last two "with sparsity"); datasheet: 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s
  // (both directions: 450 a direction); DGX H100: one ConnectX-7 400 Gb/s InfiniBand NIC a GPU
  // (50 GB/s). torchtitan's get_peak_flops: 989e12 for the H100 SXM.
  p.push_back({"h100-sxm", "NVIDIA H100 SXM5 80GB", 66.9e12, 494.7e12, 989.4e12, 80e9, 3.35e12, 8, {kNvlinkAlpha, 450e9}, {kIbAlpha, 50e9},
               "NVIDIA H100 whitepaper and datasheet (SXM5), DGX H100 user guide (8 x ConnectX-7 400 Gb/s)"});
  // NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): the H100 SXM's compute (its datasheet's
  // same 67 / 989 / 1,979 TFLOPS), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; DGX H200:
  // ConnectX-7 400 Gb/s a GPU. torchtitan: 989e12.
  p.push_back({"h200", "NVIDIA H200 SXM 141GB", 66.9e12, 494.7e12, 989.4e12, 141e9, 4.8e12, 8, {kNvlinkAlpha, 450e9}, {kIbAlpha, 50e9},
               "NVIDIA H200 Tensor Core GPU datasheet (SXM), DGX H200 datasheet (8 x ConnectX-7 400 Gb/s)"});
  // NVIDIA HGX B200 datasheet, per GPU of the 8: FP32 600 / 8 = 75 TFLOPS, TF32 18 PFLOPS / 8
  // with sparsity (dense 1.125 PFLOPS), BF16/FP16 36 PFLOPS / 8 with sparsity (dense 2.25
  // PFLOPS), 1,440 GB / 8 = 180 GB HBM3e at 8 TB/s, NVLink 5 at 1.8 TB/s (900 GB/s a direction);
  // DGX B200: ConnectX-7 400 Gb/s a GPU. torchtitan: 2.25e15.
  p.push_back({"b200", "NVIDIA B200 (HGX) 180GB", 75e12, 1.125e15, 2.25e15, 180e9, 8e12, 8, {kNvlinkAlpha, 900e9}, {kIbAlpha, 50e9},
               "NVIDIA HGX B200 datasheet (per GPU of 8), DGX B200 datasheet (8 x ConnectX-7 400 Gb/s)"});
  return p;
}

std::string normalized(std::string s) {
  for (char& c : s) c = c == '_' ? '-' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

double TargetProfile::peak_flops(const std::string& dtype, bool tf32) const {
  if (dtype == "float32") return tf32 ? tf32_flops : float32_flops;
  if (dtype == "bfloat16" || dtype == "float16") return bfloat16_flops;
  throw std::invalid_argument("peak FLOP/s of dtype '" + dtype + "': float32, bfloat16 or float16");
}

Calibration TargetProfile::calibration(const std::string& dtype, bool tf32) const {
  Calibration c;
  c.matmul_flops_per_second = peak_flops("float32", tf32);
  c.half_matmul_flops_per_second = c.float16_matmul_flops_per_second = bfloat16_flops;
  c.memory_bytes_per_second = memory_bytes_per_second;
  c.node_seconds = 4e-6;  // a kernel launch (CUDA graphs lower it)
  c.compute_source = "target " + name + " (" + label + ": " + source + "; matmuls at the dense peak of " + dtype + (dtype == "float32" && tf32 ? " on TF32" : "") +
                     ", an upper bound)";
  c.intra_host = intra_host;
  c.inter_host = inter_host;
  c.intra_source = "target " + name + ": NVLink, datasheet bandwidth per direction";
  c.inter_source = "target " + name + ": one 400 Gb/s NIC a GPU";
  return c;
}

const std::vector<TargetProfile>& target_profiles() {
  static const std::vector<TargetProfile> profiles = make_profiles();
  return profiles;
}

const TargetProfile* find_target(const std::string& name) {
  const std::string n = normalized(name);
  for (const auto& t : target_profiles()) {
    if (t.name == n || (n == "h100" && t.name == "h100-sxm") || (n == "h200-sxm" && t.name == "h200")) return &t;
  }
  return nullptr;
}

const TargetProfile* target_for_device_name(const std::string& device_name) {
  const std::string n = normalized(device_name);
  auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
  if (has("h100") && !has("pcie") && !has("nvl")) return find_target("h100-sxm");  // "NVIDIA H100 80GB HBM3"
  if (has("h200") && !has("nvl")) return find_target("h200");
  if (has("b200")) return find_target("b200");
  return nullptr;
}

std::string target_names() {
  std::string out;
  for (const auto& t : target_profiles()) out += t.name + ", ";
  return out + "this-machine";
}

}  // namespace spmdx::plan
