#include "spmdx/job/metrics.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "spmdx/core/log.h"
#include "spmdx/files.h"
#include "spmdx/text.h"

namespace spmdx::job {
using namespace spmdx::exec;
using namespace spmdx::train;

namespace {

// Resident memory of this process, in bytes (from /proc/self/statm).
std::int64_t rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<std::int64_t>(sysconf(_SC_PAGESIZE));
}

// Resuming at `first_step`: metrics.jsonl keeps the rows of the steps before it and the resumed
// run appends. When the file holds more (rows of steps past the checkpoint, from a run that went
// on after it; lines that are not a step's row, torn by a crash), it is kept whole as
// metrics.<N>.jsonl first, said, and rewritten with those rows alone: no row is ever lost.
void keep_rows_before(const std::filesystem::path& file, std::int64_t first_step) {
  if (!unreadable_file(file).empty()) return;  // none (or a FIFO, which would block)
  const std::string text = read_file_bytes(file);
  std::string kept, line;
  std::int64_t past = 0, torn = 0;
  std::istringstream in(text);
  while (std::getline(in, line)) {
    try {
      check_json_nesting(line);
      const auto row = nlohmann::json::parse(line);
      const std::int64_t step = row.at("step").get<std::int64_t>();
      if (step >= 1 && step < first_step) {
        kept += line + "\n";
        continue;
      }
      if (step >= 1) {  // past the checkpoint: the resumed run writes it again
        ++past;
        continue;
      }
    } catch (const std::exception&) {
    }
    if (!line.empty()) ++torn;
  }
  if (kept == text) return;  // nothing to leave out: appended to as it is
  if (past == 0 && torn == 0) {  // every row kept, the last one without its newline (cut just before it): added
    write_file_atomic(file, kept);
    return;
  }
  const std::filesystem::path aside = move_aside(file);
  write_file_atomic(file, kept);
  std::ostringstream what;
  if (past > 0) what << past << " row" << (past == 1 ? "" : "s") << " of steps past the checkpoint's (a run that went on after it: step " << first_step << " on is trained again)";
  if (torn > 0) {
    what << (past > 0 ? " and " : "") << torn << " line" << (torn == 1 ? "" : "s") << " that " << (torn == 1 ? "is" : "are")
         << " not a step's metrics (not JSON, or no step >= 1: torn by a crash, or edited)";
  }
  SPMDX_WARN(file.string() << ": resuming at step " << first_step << ", it keeps the rows of steps 1-" << first_step - 1 << " and leaves out " << what.str()
                           << "; the file as it was is kept whole as " << aside.string());
}

// What metrics.enable_tensorboard writes: TensorBoard tag (torchtitan's names where it has
// them), the metrics.jsonl key, and the factor from the key's unit to the tag's.
struct TensorBoardScalar {
  const char* tag;
  const char* key;
  double scale;
};
constexpr TensorBoardScalar kTensorBoardScalars[] = {
    {"loss_metrics/global_avg_loss", "loss", 1.0},
    {"grad_norm", "grad_norm", 1.0},
    {"lr", "lr", 1.0},
    {"throughput(tps)", "tokens_per_s", 1.0},
    {"tflops", "tflops", 1.0},
    {"mfu(%)", "mfu", 1.0},
    {"time_metrics/end_to_end(s)", "step_ms", 1e-3},
    {"time_metrics/comm(s)", "comm_ms", 1e-3},
    {"time_metrics/exposed_comm(s)", "exposed_comm_ms", 1e-3},
    {"memory/max_active(GiB)", "peak_mem_bytes", 1.0 / (1024.0 * 1024.0 * 1024.0)},
    {"memory/planned_peak(GiB)", "planned_peak_mem_bytes", 1.0 / (1024.0 * 1024.0 * 1024.0)},
    {"validation_metrics/loss", "val_loss", 1.0},
    {"validation_metrics/perplexity", "val_perplexity", 1.0},
    {"moe/load_imbalance", "moe_load_imbalance", 1.0},
    {"moe/load_max", "moe_load_max", 1.0},
};

}  // namespace

MetricsWriter::MetricsWriter(const OutputSpec& output, std::int64_t first_step, bool checkpointing, std::int64_t planned_peak_bytes, std::int64_t microbatches)
    : dump_(output.dump_folder), log_freq_(output.log_freq), planned_peak_(planned_peak_bytes), microbatches_(microbatches) {
  if (!output.tensorboard_folder.empty()) tensorboard_.emplace(output.tensorboard_folder);
  std::filesystem::create_directories(dump_);
  if (first_step > 1) {
    // Resumed: keep the history of the steps up to the checkpoint, drop those past it (a run
    // that went on after it and failed), and append from here.
    keep_rows_before(file(), first_step);
    out_.open(file(), std::ios::app);
  } else {
    // Starting at step 1 beside an earlier run's metrics: they are kept whole, aside.
    std::error_code ec;
    if (std::filesystem::file_size(file(), ec) > 0 && !ec) {
      const std::filesystem::path aside = move_aside(file());
      SPMDX_WARN("starting from step 1 in " << dump_.string() << ", which holds the metrics of an earlier run: they are kept whole as " << aside.string()
                                             << ", and metrics.jsonl holds this run's"
                                             << (checkpointing ? "" : " (with checkpoint.enable true, a run saves checkpoints and resumes from the newest)"));
    }
    out_.open(file(), std::ios::trunc);
  }
  if (!out_) throw std::runtime_error("cannot write " + file().string());
}

void MetricsWriter::row(std::int64_t step, std::int64_t last_step, double loss, double grad_norm, double lr, double tokens_per_s, const RunStats& st,
         const std::optional<std::pair<double, bool>>& scaling) {
  const double now = metrics::unix_time_s();  // when the step's row is written: its wall clock, and TensorBoard's wall_time
  nlohmann::json row{{"step", step},
                     {"time", now},
                     {"loss", loss},
                     {"grad_norm", grad_norm},
                     {"lr", lr},
                     {"tokens_per_s", tokens_per_s},
                     {"step_ms", st.total * 1e3},
                     {"compute_ms", (st.total - st.exposed_comm) * 1e3},
                     {"comm_ms", st.comm * 1e3},
                     {"exposed_comm_ms", st.exposed_comm * 1e3},
                     {"overlap_ratio", st.overlap_ratio()},
                     {"collectives", st.collectives},
                     {"comm_bytes", st.comm_bytes},
                     {"peak_mem_bytes", st.peak_bytes},
                     {"planned_peak_mem_bytes", planned_peak_},
                     {"rss_bytes", rss_bytes()}};
  if (scaling) row["loss_scale"] = scaling->first, row["skipped"] = scaling->second;
  double mfu = -1;
  if (flops_per_token_ > 0) {
    const double flops_per_s = flops_per_token_ * tokens_per_s / static_cast<double>(ranks_);  // one rank's
    row["tflops"] = flops_per_s / 1e12;
    if (peak_flops_per_rank_ > 0) row["mfu"] = mfu = 100.0 * flops_per_s / peak_flops_per_rank_, row["peak_tflops"] = peak_flops_per_rank_ / 1e12;
  }
  row.update(next_row_);
  next_row_ = nlohmann::json::object();
  out_ << row.dump() << "\n" << std::flush;
  if (!out_) throw std::runtime_error("cannot write " + file().string() + ": " + std::strerror(errno));
  if (tensorboard_) {
    for (const auto& [tag, key, scale] : kTensorBoardScalars) {
      if (row.contains(key)) tensorboard_->add_scalar(tag, row.at(key).get<double>() * scale, step, now);
    }
    tensorboard_->flush();
  }
  if (step % log_freq_ == 0 || step == last_step) {
    char validation[48] = "";
    if (row.contains("val_loss")) std::snprintf(validation, sizeof validation, " | val_loss %.4f", row.at("val_loss").get<double>());
    char scale[96] = "";
    if (scaling) std::snprintf(scale, sizeof scale, " | loss scale %.9g%s", scaling->first, scaling->second ? " (overflow: update skipped)" : "");
    if (std::isnan(grad_norm)) grad_norm = std::fabs(grad_norm);  // "nan", not "-nan": a float16 overflow's
    char moe[48] = "";
    if (row.contains("moe_load_imbalance")) std::snprintf(moe, sizeof moe, " | moe load max/mean %.2f", row.at("moe_load_imbalance").get<double>());
    char accum[32] = "";
    if (microbatches_ > 1) std::snprintf(accum, sizeof accum, " | accum %lld", static_cast<long long>(microbatches_));
    char replicas[48] = "";  // fault tolerance: while a replica group is away
    if (row.contains("replicas_live") && row.contains("replica_groups") && row.at("replicas_live") != row.at("replica_groups")) {
      std::snprintf(replicas, sizeof replicas, " | replicas %lld/%lld", row.at("replicas_live").get<long long>(), row.at("replica_groups").get<long long>());
    }
    char mfu_text[32] = "";
    if (mfu >= 0) std::snprintf(mfu_text, sizeof mfu_text, " | mfu %5.1f%%", mfu);
    std::printf("step %4lld | loss %8.4f | grad_norm %7.3f | lr %.2e | %9.0f tok/s%s | %7.1f ms | exposed comm %4.1f%% | peak %s%s%s%s%s%s\n",
                static_cast<long long>(step), loss, grad_norm, lr, tokens_per_s, mfu_text, st.total * 1e3, 100.0 * st.exposed_comm / st.total,
                human_bytes(static_cast<double>(st.peak_bytes)).c_str(), moe, accum, validation, scale, replicas);
    std::fflush(stdout);
  }
}

}  // namespace spmdx::job
