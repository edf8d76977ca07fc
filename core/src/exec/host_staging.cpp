// Host buffers for comm::StagingBackend (a mixed mesh's CUDA rank): pinned ATen tensors, and
// copies between them and device memory (exec/device.h, make_host_staging).
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <map>
#include <mutex>
#include <stdexcept>

#include "spmdx/exec/device.h"

namespace spmdx::exec {
namespace {

class TensorStaging final : public comm::HostStaging {
 public:
  explicit TensorStaging(c10::Device device) : device_(device) {}
  void* allocate(std::size_t bytes) override {
    // Page-locked memory: a device copy from it is a DMA, not a bounce through a driver
    // buffer (as torch.Tensor.pin_memory()).
    at::Tensor t = at::empty({static_cast<std::int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(device_.is_cuda()));
    void* p = t.data_ptr();
    const std::lock_guard<std::mutex> lock(mutex_);
    held_[p] = std::move(t);
    return p;
  }
  void release(void* host) noexcept override {
    const std::lock_guard<std::mutex> lock(mutex_);
    held_.erase(host);
  }
  void to_host(void* host, const void* device, std::size_t bytes) override { bytes_of(host, c10::Device(at::kCPU), bytes).copy_(bytes_of(device, device_, bytes)); }
  void to_device(void* device, const void* host, std::size_t bytes) override { bytes_of(device, device_, bytes).copy_(bytes_of(host, c10::Device(at::kCPU), bytes)); }

 private:
  static at::Tensor bytes_of(const void* p, c10::Device where, std::size_t bytes) {
    return at::from_blob(const_cast<void*>(p), {static_cast<std::int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(where));
  }
  c10::Device device_;
  std::mutex mutex_;
  std::map<void*, at::Tensor> held_;
};

}  // namespace

std::unique_ptr<comm::HostStaging> make_host_staging(const Device& device) { return std::make_unique<TensorStaging>(device.device()); }

}  // namespace spmdx::exec
