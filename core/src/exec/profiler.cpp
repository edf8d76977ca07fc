#include "spmdx/exec/profiler.h"

#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdlib>
#include <fstream>
#include <set>
#include <stdexcept>
#include <string>

#include "spmdx/files.h"

namespace spmdx::exec {

namespace prof = torch::profiler::impl;

StepProfiler::StepProfiler(std::filesystem::path folder, std::int64_t freq, int rank, bool cuda)
    : folder_(std::move(folder)), freq_(freq), rank_(rank), cuda_(cuda) {
  // Kineto logs each start and stop, and on a machine without a GPU driver an error about it,
  // to stderr: quiet unless the user asks (its levels: 0 verbose .. 5 USDT markers).
  ::setenv("KINETO_LOG_LEVEL", "6", /*overwrite=*/0);
}

namespace {
std::set<prof::ActivityType> activities(bool cuda) {
  std::set<prof::ActivityType> a{prof::ActivityType::CPU};
  if (cuda) a.insert(prof::ActivityType::CUDA);
  return a;
}
const prof::ProfilerConfig& config() {
  static const prof::ProfilerConfig c(prof::ProfilerState::KINETO, /*report_input_shapes=*/true);
  return c;
}
}  // namespace

void StepProfiler::start() {
  if (torch::autograd::profiler::profilerEnabled()) throw std::runtime_error("profiling: the PyTorch profiler is already on in this process");
  torch::autograd::profiler::prepareProfiler(config(), activities(cuda_));
  torch::autograd::profiler::enableProfiler(config(), activities(cuda_));
}

void StepProfiler::cancel() {
  if (torch::autograd::profiler::profilerEnabled()) torch::autograd::profiler::disableProfiler();
}

std::filesystem::path StepProfiler::stop(std::int64_t step, const std::vector<Span>& spans) {
  const std::unique_ptr<torch::autograd::profiler::ProfilerResult> result = torch::autograd::profiler::disableProfiler();
  const std::filesystem::path dir = folder_ / ("iteration_" + std::to_string(step));
  const std::filesystem::path file = dir / ("rank" + std::to_string(rank_) + "_trace.json");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw std::runtime_error("profiling: cannot make " + dir.string() + ": " + ec.message());
  const std::filesystem::path kineto = dir / ("rank" + std::to_string(rank_) + "_trace.kineto.json");
  result->save(kineto.string());
  nlohmann::json trace;
  {
    std::ifstream in(kineto);
    if (!in) throw std::runtime_error("profiling: the PyTorch profiler wrote no trace at " + kineto.string());
    trace = nlohmann::json::parse(in);
  }
  std::filesystem::remove(kineto, ec);
  // Kineto's "ts" are microseconds since baseTimeNanoseconds (absolute since the epoch when
  // the trace has no base); the spans are seconds since the epoch.
  const double base_us = trace.contains("baseTimeNanoseconds") ? trace["baseTimeNanoseconds"].get<double>() / 1e3 : 0.0;
  nlohmann::json& events = trace["traceEvents"];
  const std::string pid = "spmdx rank " + std::to_string(rank_);
  for (const char* tid : {"spmdx compute", "spmdx comm"}) {
    events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", tid}}}});
  }
  events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"args", {{"name", pid}}}});
  for (const Span& s : spans) {
    nlohmann::json e{{"ph", "X"}, {"cat", "spmdx"}, {"name", s.name}, {"pid", pid}, {"tid", s.thread == "comm" ? "spmdx comm" : "spmdx compute"},
                     {"ts", s.start * 1e6 - base_us}, {"dur", (s.end - s.start) * 1e6}};
    if (s.bytes > 0) e["args"] = {{"bytes", s.bytes}};
    events.push_back(std::move(e));
  }
  write_file_atomic(file, trace.dump());
  return file;
}

}  // namespace spmdx::exec
