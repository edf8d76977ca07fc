#include "spmdx/exec/device.h"
#include "spmdx/exec/kernels.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <dlfcn.h>
#include <malloc.h>

#define BOOST_DLL_USE_STD_FS  // std::filesystem, as registry.cpp: no Boost.Filesystem library
#include <boost/dll/shared_library.hpp>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace spmdx::exec {
namespace {

// The CPU's memory statistics, as the CUDA caching allocator keeps them for a GPU: every CPU
// tensor's bytes go through this allocator (installed as c10's CPU allocator when the first
// CpuDevice is made), which counts the bytes allocated now and their peak. Blocks come from
// c10::alloc_cpu, as c10's DefaultCPUAllocator takes them; each carries its size in a 64-byte
// header (c10's alignment), so data and context stay one pointer and ATen's raw interface
// (raw_allocate, raw_deleter) works.
//
// Blocks of kCacheMin bytes or more are cached when freed and handed out again for the same size,
// as the CUDA caching allocator does: a train step allocates the same sizes every step, and glibc
// serves them with mmap, whose pages fault in again at each first touch (measured: 1.1M minor
// faults a step, the bfloat16 casts of Llama `large`'s weights and gradients running 5x slower
// than on reused memory: 10.2 s steps against 7.7 s). The bytes held (in use + cached) never
// pass the most ever in use: a request no cached block fits frees cached blocks first until
// they do not, so the process's memory stays what peak_mem_bytes says.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  static constexpr std::size_t kHeader = 64;
  static constexpr std::size_t kCacheMin = std::size_t{1} << 20;

  static CountingCpuAllocator& instance() {
    static CountingCpuAllocator* allocator = [] {
      // The memory of what bypasses c10 (oneDNN's reorder and scratch buffers, the kernels' own
      // mallocs) reused too: glibc's heap rather than a fresh mmap up to 1 GiB, and freed memory
      // kept rather than trimmed back to the kernel (as the cache below keeps c10's blocks).
      mallopt(M_MMAP_THRESHOLD, 1 << 30);
      mallopt(M_TRIM_THRESHOLD, 1 << 30);
      auto* a = new CountingCpuAllocator();  // never freed: tensors outlive any owner
      c10::SetCPUAllocator(a, /*priority=*/1);
      return a;
    }();
    return *allocator;
  }

  c10::DataPtr allocate(std::size_t n) override {
    if (n == 0) return {nullptr, nullptr, &release, c10::Device(c10::DeviceType::CPU)};
    char* base = n >= kCacheMin ? from_cache(n) : nullptr;
    if (base == nullptr) {
      base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
      std::memcpy(base, &n, sizeof n);
    }
    add(static_cast<std::int64_t>(n));
    void* data = base + kHeader;
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  std::int64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  void reset_peak() { peak_.store(allocated_.load(std::memory_order_relaxed), std::memory_order_relaxed); }

 private:
  static void release(void* data) {
    if (data == nullptr) return;
    char* base = static_cast<char*>(data) - kHeader;
    std::size_t n = 0;
    std::memcpy(&n, base, sizeof n);
    instance().add(-static_cast<std::int64_t>(n));
    if (n >= kCacheMin) {
      instance().to_cache(base, n);
      return;
    }
    c10::free_cpu(base);
  }
  // A cached block of exactly n bytes, or nullptr after freeing cached blocks until the bytes
  // held and n fit under the most ever in use (or none is left).
  char* from_cache(std::size_t n) {
    const std::lock_guard<std::mutex> lock(cache_mutex_);
    if (auto it = cache_.find(n); it != cache_.end() && !it->second.empty()) {
      char* base = it->second.back();
      it->second.pop_back();
      cached_bytes_ -= n;
      return base;
    }
    const std::size_t most = static_cast<std::size_t>(most_.load(std::memory_order_relaxed));
    const std::size_t in_use = static_cast<std::size_t>(allocated_.load(std::memory_order_relaxed));
    for (auto it = cache_.rbegin(); it != cache_.rend() && cached_bytes_ > 0 && in_use + cached_bytes_ + n > most; ++it) {
      while (!it->second.empty() && in_use + cached_bytes_ + n > most) {
        c10::free_cpu(it->second.back());
        it->second.pop_back();
        cached_bytes_ -= it->first;
      }
    }
    return nullptr;
  }
  void to_cache(char* base, std::size_t n) {
    const std::lock_guard<std::mutex> lock(cache_mutex_);
    cache_[n].push_back(base);
    cached_bytes_ += n;
  }
  void add(std::int64_t bytes) {
    const std::int64_t now = allocated_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    std::int64_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    std::int64_t most = most_.load(std::memory_order_relaxed);
    while (now > most && !most_.compare_exchange_weak(most, now, std::memory_order_relaxed)) {
    }
  }
  std::atomic<std::int64_t> allocated_{0}, peak_{0};
  std::atomic<std::int64_t> most_{0};  ///< the most bytes ever in use (peak_ is reset each step)
  std::mutex cache_mutex_;
  std::map<std::size_t, std::vector<char*>> cache_;  ///< freed blocks by their size (bytes past the header)
  std::size_t cached_bytes_ = 0;
};

class CpuDevice final : public Device {
 public:
  c10::Device device() const override { return c10::Device(c10::DeviceType::CPU); }
  MemoryType memory() const override { return MemoryType::host; }
  void* compute_stream() const override { return nullptr; }
  void synchronize() override {}
  CpuDevice() { CountingCpuAllocator::instance(); }
  std::int64_t peak_memory_bytes() const override { return CountingCpuAllocator::instance().peak(); }
  void reset_peak_memory() override { CountingCpuAllocator::instance().reset_peak(); }
  std::string describe() const override { return "cpu"; }
  std::unique_ptr<CapturedStep> capture(const std::function<void()>&) override {
    throw std::runtime_error("CUDA graphs need training.device = \"cuda\" (training.cuda_graphs is for GPUs)");
  }
};

// libspmdx_cuda.so, beside this library (both in lib/ of the build and of an install), loaded
// once with its symbols global: LibTorch's CUDA libraries register their kernels and hooks
// with ATen as they load.
boost::dll::shared_library& cuda_library() {
  static std::once_flag once;
  static boost::dll::shared_library lib;
  static std::string error;
  std::call_once(once, [] {
#ifndef SPMDX_WITH_CUDA
    error = "this spmdx was built without CUDA (configured with -DSPMDX_WITH_CUDA=OFF, or no CUDA toolkit and CUDA LibTorch were found: see "
            "cmake's 'spmdx: CUDA' line); use training.device = \"cpu\"";
#else
    Dl_info info{};
    std::filesystem::path dir;
    if (::dladdr(reinterpret_cast<void*>(&cuda_library), &info) != 0 && info.dli_fname != nullptr) {
      std::error_code ec;
      dir = std::filesystem::canonical(info.dli_fname, ec).parent_path();
    }
    const std::filesystem::path file = dir / "libspmdx_cuda.so";
    try {
      lib.load(file.string(), boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_global);
    } catch (const std::exception& e) {
      error = "cannot load " + file.string() + " (" + e.what() + "): training.device = \"cuda\" needs it and LibTorch's CUDA libraries (ldd names what is missing)";
    }
#endif
  });
  if (!error.empty()) throw std::runtime_error(error);
  return lib;
}

}  // namespace

std::unique_ptr<Device> make_device(const DeviceOptions& options) {
  set_cpu_matmul(cpu_matmul_named(options.cpu_matmul));
  if (options.kind == "cpu") return std::make_unique<CpuDevice>();
  if (options.kind != "cuda") throw std::runtime_error("training.device = \"" + options.kind + "\": use \"cpu\" or \"cuda\"");
  auto make = cuda_library().get<Device*(const DeviceOptions&)>("spmdx_cuda_make_device");
  return std::unique_ptr<Device>(make(options));
}

int cuda_device_count(std::string* why) {
  // Without the driver's control node there is no GPU to find: the CUDA libraries (about
  // 500 MB) are not mapped to learn so.
  if (!std::filesystem::exists("/dev/nvidiactl")) {
    if (why != nullptr) *why = "no NVIDIA driver here (/dev/nvidiactl is absent)";
    return 0;
  }
  try {
    int count = 0;
    std::string problem;
    cuda_library().get<void(int&, std::string&)>("spmdx_cuda_device_count")(count, problem);
    if (why != nullptr) *why = problem;
    return count;
  } catch (const std::exception& e) {
    if (why != nullptr) *why = e.what();
    return 0;
  }
}

std::string cuda_problem(int ranks_per_host) {
  try {
    std::string why;
    cuda_library().get<void(int, std::string&)>("spmdx_cuda_problem")(ranks_per_host, why);
    return why;
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace spmdx::exec
