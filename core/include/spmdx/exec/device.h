// Where one rank's tensors live and how its work is ordered: the CPU, or one CUDA device.
// The CUDA side lives in libspmdx_cuda.so, loaded on first use, so a CPU run never maps
// LibTorch's CUDA libraries (about 500 MB) and a build without CUDA still has this interface.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "spmdx/comm.h"
#include "spmdx/comm/staging.h"

namespace spmdx::exec {

struct DeviceOptions {
  std::string kind = "cpu";  ///< training.device: "cpu" or "cuda"
  /// CUDA: the GPU this rank takes, as torchrun's convention (LOCAL_RANK; one rank per GPU).
  int local_rank = 0;
  /// CUDA: TF32 in matmuls and cuDNN (torch.backends.cuda.matmul.allow_tf32 and
  /// torch.backends.cudnn.allow_tf32). Off by default so CUDA losses compare with the CPU's.
  bool allow_tf32 = false;
  /// CPU: the library float32 linears run on (exec::CpuMatmul, kernels.h): "onednn", "aten",
  /// or "auto" (onednn where this LibTorch has it). Set for the whole process by make_device.
  std::string cpu_matmul = "auto";
};

/// A whole step captured as one CUDA graph (torch.cuda.CUDAGraph): replay() launches it on the
/// compute stream. The tensors the step read and wrote during capture are its fixed buffers.
class CapturedStep {
 public:
  virtual ~CapturedStep() = default;
  virtual void replay() = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  /// The device ATen tensors of this rank are made on (kCPU, or kCUDA with the GPU's index).
  virtual c10::Device device() const = 0;
  /// The memory type its tensors' buffers have for the comm backends (CommBuffer::memory).
  virtual MemoryType memory() const = 0;
  /// The stream the executor's kernels are queued on (a cudaStream_t, the current CUDA stream
  /// while the rank runs), or nullptr on the CPU, where a kernel is done when it returns.
  virtual void* compute_stream() const = 0;
  /// Blocks the calling thread until everything queued on the compute stream has run. No-op on
  /// the CPU. Throws std::runtime_error for an error a kernel raised asynchronously.
  virtual void synchronize() = 0;
  /// Peak memory, in bytes, of the tensors allocated on the device since the last
  /// reset_peak_memory(): on a GPU the CUDA caching allocator's allocated_bytes peak (as
  /// torch.cuda.max_memory_allocated); on the CPU the peak of the bytes held by c10's CPU
  /// allocator, which the first CPU device replaces with one that counts (every ATen CPU
  /// tensor of the process, kernels' temporaries included, any thread). -1 where the device
  /// keeps no statistics.
  virtual std::int64_t peak_memory_bytes() const = 0;
  virtual void reset_peak_memory() = 0;
  /// For logs: "cpu", or "cuda:0 (NVIDIA H200, 139.8 GiB, TF32 off)".
  virtual std::string describe() const = 0;
  /// Records what `body` queues on the compute stream as one CUDA graph, without running it
  /// (torch.cuda.graph: capture on a side stream, memory from the graph's private pool).
  /// `body` must not synchronise with the host. Throws std::runtime_error on the CPU and when
  /// capture fails, with CUDA's reason.
  virtual std::unique_ptr<CapturedStep> capture(const std::function<void()>& body) = 0;
};

/// The device `options` names. Throws std::runtime_error saying what to do when it cannot be
/// had: a build without CUDA (-DSPMDX_WITH_CUDA=OFF, or no CUDA LibTorch found), a machine
/// without a usable GPU, or local_rank beyond the GPUs there are.
std::unique_ptr<Device> make_device(const DeviceOptions& options);

/// The GPUs this process can use; 0 when this spmdx was built without CUDA, when no NVIDIA
/// driver is present (no /dev/nvidiactl: libspmdx_cuda.so is then not loaded), or when
/// libspmdx_cuda.so or the driver fails (then `why`, when given, says which).
/// training.device = "auto" reads it.
int cuda_device_count(std::string* why = nullptr);

/// Host buffers for comm::StagingBackend on `device`: pinned (page-locked) on CUDA, as
/// ProcessGroupGloo's CUDA paths stage through at::empty(..., pinned_memory); plain on the
/// CPU. Copies run on the current stream and are done when they return.
std::unique_ptr<comm::HostStaging> make_host_staging(const Device& device);

/// Why `ranks_per_host` ranks cannot each take a GPU here ("" when they can): the launcher's
/// check before it starts any rank. Loads libspmdx_cuda.so.
std::string cuda_problem(int ranks_per_host);

}  // namespace spmdx::exec
