// libspmdx_cuda.so: the CUDA Device (device.h), loaded by make_device() only for
// training.device = "cuda". The one place spmdx calls LibTorch's CUDA side: streams, the
// caching allocator's statistics, TF32 switches and CUDA graphs (ATen's CUDAGraph, as
// torch.cuda.graph uses it).
#include <ATen/Context.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>

#include "spmdx/exec/device.h"

namespace spmdx::exec {
namespace {

std::string gib(std::size_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return text;
}

// What this machine's CUDA runtime says of its GPUs: "" and their count, or why there are none.
std::string probe(int& count) {
  count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    count = 0;
    return std::string("no usable CUDA device on this machine (CUDA: ") + cudaGetErrorString(e) + ")";
  }
  if (count == 0) return "no CUDA device on this machine (the CUDA runtime sees 0 GPUs)";
  return "";
}

class CudaGraphStep final : public CapturedStep {
 public:
  void replay() override { graph_.replay(); }
  at::cuda::CUDAGraph graph_;
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(const DeviceOptions& options) : index_(static_cast<c10::DeviceIndex>(options.local_rank)), allow_tf32_(options.allow_tf32) {
    int count = 0;
    if (std::string why = probe(count); !why.empty()) throw std::runtime_error(why + "; use training.device = \"cpu\"");
    if (options.local_rank < 0 || options.local_rank >= count) {
      throw std::runtime_error("LOCAL_RANK " + std::to_string(options.local_rank) + " has no GPU: this machine has " + std::to_string(count) +
                               " (one rank per GPU: start at most " + std::to_string(count) + " ranks per host)");
    }
    // As PyTorch's first CUDA call: the CUDA hooks' init (the caching allocator for every GPU),
    // without which the allocator's statistics throw "Invalid device argument" until something
    // is allocated.
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    c10::cuda::set_device(index_);
    // The kernels run on a stream of their own (not the legacy default stream, which would
    // serialise with every other stream, and which CUDA graphs cannot capture).
    stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index_);
    c10::cuda::setCurrentCUDAStream(*stream_);
    at::globalContext().setAllowTF32CuBLAS(allow_tf32_);
    at::globalContext().setAllowTF32CuDNN(allow_tf32_);
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, index_) == cudaSuccess) {
      name_ = prop.name;
      total_ = prop.totalGlobalMem;
    }
  }

  c10::Device device() const override { return {c10::DeviceType::CUDA, index_}; }
  MemoryType memory() const override { return MemoryType::cuda; }
  void* compute_stream() const override { return stream_->stream(); }
  void synchronize() override { stream_->synchronize(); }

  std::int64_t peak_memory_bytes() const override {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index_);
    return stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
  }
  void reset_peak_memory() override { c10::cuda::CUDACachingAllocator::resetPeakStats(index_); }

  std::string describe() const override {
    return "cuda:" + std::to_string(index_) + " (" + name_ + ", " + gib(total_) + ", TF32 " + (allow_tf32_ ? "on" : "off") + ")";
  }

  std::unique_ptr<CapturedStep> capture(const std::function<void()>& body) override {
    auto step = std::make_unique<CudaGraphStep>();
    // As torch.cuda.graph: start from an idle device, so that capture sees no work of before,
    // and hand the eager steps' cached blocks back (the graph's private pool cannot use them).
    stream_->synchronize();
    c10::cuda::CUDACachingAllocator::emptyCache();
    step->graph_.capture_begin();
    try {
      body();
    } catch (...) {
      try {
        step->graph_.capture_end();  // leaves capture mode; the half-made graph is dropped
      } catch (...) {
      }
      throw;
    }
    step->graph_.capture_end();
    return step;
  }

 private:
  c10::DeviceIndex index_;
  bool allow_tf32_;
  std::optional<c10::cuda::CUDAStream> stream_;  // made once the GPU is known to be there
  std::string name_ = "unknown GPU";
  std::size_t total_ = 0;
};

}  // namespace
}  // namespace spmdx::exec

// The library's entry points, found by name (device.cpp). Errors are thrown: the library is
// built with the host, by the same toolchain.
extern "C" __attribute__((visibility("default"))) spmdx::exec::Device* spmdx_cuda_make_device(const spmdx::exec::DeviceOptions& options) {
  return new spmdx::exec::CudaDevice(options);
}

extern "C" __attribute__((visibility("default"))) void spmdx_cuda_problem(int ranks_per_host, std::string& why) {
  int count = 0;
  why = spmdx::exec::probe(count);
  if (!why.empty()) why += "; use training.device = \"cpu\"";
  if (why.empty() && ranks_per_host > count) {
    why = std::to_string(ranks_per_host) + " ranks per host, but this machine has " + std::to_string(count) +
          " GPU" + (count == 1 ? "" : "s") + ": training.device = \"cuda\" takes one GPU per rank (--nproc at most " + std::to_string(count) + ")";
  }
}

extern "C" __attribute__((visibility("default"))) void spmdx_cuda_device_count(int& count, std::string& why) {
  count = 0;
  why = spmdx::exec::probe(count);
  if (!why.empty()) count = 0;
}
