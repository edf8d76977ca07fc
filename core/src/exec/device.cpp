#include "spmdx/exec/device.h"

#include <dlfcn.h>

#define BOOST_DLL_USE_STD_FS  // std::filesystem, as registry.cpp: no Boost.Filesystem library
#include <boost/dll/shared_library.hpp>
#include <filesystem>
#include <mutex>
#include <stdexcept>

namespace spmdx::exec {
namespace {

class CpuDevice final : public Device {
 public:
  c10::Device device() const override { return c10::Device(c10::DeviceType::CPU); }
  MemoryType memory() const override { return MemoryType::host; }
  void* compute_stream() const override { return nullptr; }
  void synchronize() override {}
  std::int64_t peak_memory_bytes() const override { return -1; }
  void reset_peak_memory() override {}
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
  if (options.kind == "cpu") return std::make_unique<CpuDevice>();
  if (options.kind != "cuda") throw std::runtime_error("training.device = \"" + options.kind + "\": use \"cpu\" or \"cuda\"");
  auto make = cuda_library().get<Device*(const DeviceOptions&)>("spmdx_cuda_make_device");
  return std::unique_ptr<Device>(make(options));
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
