// The calibration a job is priced with (job_calibration.h).
#include "job_calibration.h"

#include <filesystem>
#include <stdexcept>

#ifdef SPMDX_HAVE_EXEC
#include "spmdx/exec/calibrate.h"
#include "spmdx/exec/kernels.h"
#endif

namespace spmdx::cli {

spmdx::plan::Calibration job_calibration(const spmdx::config::Config& cfg) {
  const std::filesystem::path dump = cfg.get_string("job.dump_folder");
#ifdef SPMDX_HAVE_EXEC
  try {  // the linears' library, as the ranks will set it, is the one measured
    spmdx::exec::set_cpu_matmul(spmdx::exec::cpu_matmul_named(cfg.get_string("training.cpu_matmul")));
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument(cfg.where({"training.cpu_matmul"}) + ": " + e.what());
  }
#endif
  try {
#ifdef SPMDX_HAVE_EXEC
    return spmdx::exec::ensure_calibration(dump);
#else
    return spmdx::plan::load_calibration(spmdx::plan::calibration_path(dump));
#endif
  } catch (const std::runtime_error& e) {  // filesystem_error, or write_file_atomic's
    throw std::invalid_argument(cfg.where({"job.dump_folder"}) + ": job.dump_folder = \"" + dump.string() +
                                "\": the cost model's calibration.json cannot be kept there (" + e.what() + "): name a folder this user may write");
  }
}

}  // namespace spmdx::cli
