#include "spmdx/plan/estimate.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "spmdx/files.h"
#include "spmdx/sharding/cost_model.h"
#include "spmdx/sharding/redistribute.h"
#include "spmdx/sharding/spec.h"
#include "spmdx/text.h"

namespace spmdx::plan {

std::string Calibration::to_json() const {
  nlohmann::json j{{"format", "spmdx.calibration/1"},
                   {"compute", {{"matmul_flops_per_second", matmul_flops_per_second}, {"half_matmul_flops_per_second", half_matmul_flops_per_second},
                                {"float16_matmul_flops_per_second", float16_matmul_flops_per_second},
                                {"memory_bytes_per_second", memory_bytes_per_second}, {"threads", 1},
                                {"node_seconds", node_seconds}, {"source", compute_source}}},
                   {"step", {{"collective_seconds", collective_seconds}, {"source", collective_source}}},
                   {"links", {{"intra_host", {{"alpha_s", intra_host.alpha}, {"beta_bytes_per_s", intra_host.beta}, {"source", intra_source}}},
                              {"inter_host", {{"alpha_s", inter_host.alpha}, {"beta_bytes_per_s", inter_host.beta}, {"source", inter_source}}}}}};
  return j.dump(1) + "\n";
}

Calibration Calibration::from_json(const std::string& text, const std::string& where) {
  Calibration c;
  nlohmann::json j;
  try {
    check_json_nesting(text);
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw std::invalid_argument(where + ": not JSON (" + e.what() + "); delete it and spmdx measures again");
  }
  const std::string again = "; delete the file and spmdx measures again";
  // A number within [lo, hi]: rates a machine can have (a value far outside is a typo or a
  // corrupt file, and would make every plan's cost meaningless).
  auto number = [&](const nlohmann::json& obj, const char* key, double& out, const std::string& path, double lo, double hi) {
    if (!obj.is_object() || !obj.contains(key)) return;
    if (!obj[key].is_number() || !std::isfinite(obj[key].get<double>()) || obj[key].get<double>() < lo || obj[key].get<double>() > hi) {
      char range[96];
      std::snprintf(range, sizeof range, " must be a number from %g to %g", lo, hi);
      throw std::invalid_argument(where + ": " + path + "." + key + range + again);
    }
    out = obj[key].get<double>();
  };
  auto rate = [&](const nlohmann::json& obj, const char* key, double& out, const std::string& path) { number(obj, key, out, path, 1e3, 1e16); };
  auto text_of = [](const nlohmann::json& obj, std::string& out) {
    if (obj.is_object() && obj.contains("source") && obj["source"].is_string()) out = obj["source"].get<std::string>();
  };
  if (!j.is_object()) throw std::invalid_argument(where + ": not a calibration (a JSON object)" + again);
  if (j.contains("format") && j["format"] != "spmdx.calibration/1") {
    throw std::invalid_argument(where + ": format " + j["format"].dump() + " is not spmdx.calibration/1 (another spmdx's?)" + again);
  }
  // A section present must be an object (a null or a list was read as "no measurements").
  auto section = [&](const nlohmann::json& obj, const char* key, const std::string& path) {
    if (obj.contains(key) && !obj[key].is_object()) throw std::invalid_argument(where + ": " + path + " is " + obj[key].dump().substr(0, 40) + ", not an object" + again);
    return obj.contains(key);
  };
  if (section(j, "compute", "compute")) {
    rate(j["compute"], "matmul_flops_per_second", c.matmul_flops_per_second, "compute");
    rate(j["compute"], "memory_bytes_per_second", c.memory_bytes_per_second, "compute");
    if (j["compute"].contains("half_matmul_flops_per_second") && j["compute"]["half_matmul_flops_per_second"] != 0) {
      rate(j["compute"], "half_matmul_flops_per_second", c.half_matmul_flops_per_second, "compute");
    }
    if (j["compute"].contains("float16_matmul_flops_per_second") && j["compute"]["float16_matmul_flops_per_second"] != 0) {
      rate(j["compute"], "float16_matmul_flops_per_second", c.float16_matmul_flops_per_second, "compute");
    }
    number(j["compute"], "node_seconds", c.node_seconds, "compute", 0, 1);
    text_of(j["compute"], c.compute_source);
  }
  if (section(j, "step", "step") && j["step"].contains("collective_seconds")) {
    number(j["step"], "collective_seconds", c.collective_seconds, "step", 0, 10);
    text_of(j["step"], c.collective_source);
  }
  if (section(j, "links", "links")) {
    for (auto [key, model, source] : {std::tuple{"intra_host", &c.intra_host, &c.intra_source}, std::tuple{"inter_host", &c.inter_host, &c.inter_source}}) {
      if (!section(j["links"], key, std::string("links.") + key)) continue;
      const auto& l = j["links"][key];
      double beta = model->beta;
      rate(l, "beta_bytes_per_s", beta, std::string("links.") + key);
      model->beta = beta;
      number(l, "alpha_s", model->alpha, std::string("links.") + key, 0, 1);
      text_of(l, *source);
    }
  }
  return c;
}

std::string Calibration::str() const {
  char half[48] = "";
  if (half_matmul_flops_per_second > 0) std::snprintf(half, sizeof half, " (bf16 %.1f)", half_matmul_flops_per_second / 1e9);
  char text[1024];
  std::snprintf(text, sizeof text,
                "matmul %.1f GFLOP/s%s, memory %.1f GB/s a thread, %.1f us a kernel (%s); this host: alpha %.1f us, beta %.2f GB/s (%s); between hosts: "
                "alpha %.1f us, beta %.2f GB/s (%s); %.0f us a collective (%s)",
                matmul_flops_per_second / 1e9, half, memory_bytes_per_second / 1e9, node_seconds * 1e6, compute_source.c_str(), intra_host.alpha * 1e6,
                intra_host.beta / 1e9, intra_source.c_str(), inter_host.alpha * 1e6, inter_host.beta / 1e9, inter_source.c_str(), collective_seconds * 1e6,
                collective_source.c_str());
  return text;
}

std::filesystem::path calibration_path(const std::filesystem::path& dump_folder) { return dump_folder / "calibration.json"; }

Calibration load_calibration(const std::filesystem::path& file) {
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) return {};
  try {
    return Calibration::from_json(read_file_bytes(file), file.string());
  } catch (const std::runtime_error& e) {  // from_json throws std::invalid_argument
    throw std::invalid_argument(file.string() + ": cannot be read (" + e.what() + "): remove it, and spmdx measures again");
  }
}

void save_calibration(const std::filesystem::path& file, const Calibration& c) {
  if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path());
  write_file_atomic(file, c.to_json());
}

sharding::CostModel fit_alpha_beta(const std::vector<double>& messages, const std::vector<double>& bytes, const std::vector<double>& seconds) {
  const std::size_t n = std::min({messages.size(), bytes.size(), seconds.size()});
  std::vector<double> distinct(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n));
  std::sort(distinct.begin(), distinct.end());
  if (std::unique(distinct.begin(), distinct.end()) - distinct.begin() < 2) throw std::invalid_argument("fitting alpha and beta needs at least 2 sizes");
  // t = m a + b g (g = 1 / beta): least squares on the normal equations, in relative error
  // (each point weighted by 1 / t^2) so that small sizes fit alpha and large ones beta.
  double smm = 0, smb = 0, sbb = 0, smt = 0, sbt = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double w = 1.0 / (seconds[i] * seconds[i]);
    smm += w * messages[i] * messages[i], smb += w * messages[i] * bytes[i], sbb += w * bytes[i] * bytes[i];
    smt += w * messages[i] * seconds[i], sbt += w * bytes[i] * seconds[i];
  }
  const double det = smm * sbb - smb * smb;
  double a = det != 0 ? (smt * sbb - sbt * smb) / det : 0, g = det != 0 ? (smm * sbt - smb * smt) / det : 0;
  if (a < 0 || det == 0) a = 0, g = sbt / sbb;  // a fit through the origin
  if (g <= 0) throw std::invalid_argument("the sweep's times do not grow with size: no bandwidth to fit (run it with larger --max-bytes)");
  return {a, 1.0 / g};
}

std::vector<sharding::CostModel> mesh_links(const sharding::DeviceMesh& mesh, std::int64_t ranks_per_host, const Calibration& c) {
  std::vector<sharding::CostModel> out(static_cast<std::size_t>(mesh.ndim()), c.intra_host);
  std::int64_t stride = 1;
  for (int d = mesh.ndim() - 1; d >= 0; --d) {
    if (stride * mesh.size(d) > std::max<std::int64_t>(1, ranks_per_host)) out[static_cast<std::size_t>(d)] = c.inter_host;
    stride *= mesh.size(d);
  }
  return out;
}

double compute_seconds(const ir::Graph& rank_graph, const Calibration& c, std::int64_t threads) {
  const double t = static_cast<double>(std::max<std::int64_t>(1, threads));
  double total = 0;
  for (const auto& node : rank_graph.nodes()) {
    if (sharding::is_communication(node->op()) || node->op() == "send" || node->op() == "recv") continue;  // priced as traffic
    const ir::DType dtype = !node->inputs().empty() ? node->input(0)->meta().dtype : ir::DType::f32;
    total += c.node_seconds + sharding::node_seconds(*node, c.matmul_rate(dtype) * t, c.memory_bytes_per_second * t);
  }
  return total;
}

Traffic rank_traffic(const ir::Graph& rank_graph, const sharding::DeviceMesh& mesh) {
  Traffic t;
  t.bytes_by_dim.assign(static_cast<std::size_t>(mesh.ndim()), 0);
  t.messages_by_dim.assign(static_cast<std::size_t>(mesh.ndim()), 0);
  int pp = -1;
  for (int d = 0; d < mesh.ndim(); ++d) {
    if (mesh.dims()[static_cast<std::size_t>(d)].name == "pp") pp = d;
  }
  for (const auto& node : rank_graph.nodes()) {
    const std::string& op = node->op();
    if (op == "send" && pp >= 0) {
      t.bytes_by_dim[static_cast<std::size_t>(pp)] += static_cast<double>(node->input(0)->meta().nbytes());
      t.messages_by_dim[static_cast<std::size_t>(pp)] += 1;
      continue;
    }
    if (!sharding::is_collective(op)) continue;
    const auto d = static_cast<std::size_t>(node->attr_int("mesh_dim"));
    if (d >= t.bytes_by_dim.size()) continue;
    const std::int64_t k = mesh.size(static_cast<int>(d));
    if (k <= 1) continue;
    const double f = static_cast<double>(k - 1) / static_cast<double>(k);
    const double in = static_cast<double>(node->input(0)->meta().nbytes());
    const double out = static_cast<double>(node->output(0)->meta().nbytes());
    t.bytes_by_dim[d] += op == "all_reduce" ? 2 * f * in : op == "all_gather" ? f * out : f * in;
    t.messages_by_dim[d] += static_cast<double>(k - 1) * (op == "all_reduce" ? 2 : 1);
  }
  return t;
}

StepEstimate estimate_step(const ir::Graph& rank_graph, const sharding::DeviceMesh& mesh, const Traffic& traffic, const Calibration& c,
                           std::int64_t ranks_per_host, std::int64_t cores, std::int64_t peak_bytes, std::int64_t issues) {
  StepEstimate e;
  e.issues = issues;
  for (const auto& node : rank_graph.nodes()) e.nodes += sharding::is_communication(node->op()) || node->op() == "send" || node->op() == "recv" ? 0 : 1;
  ranks_per_host = std::max<std::int64_t>(1, ranks_per_host);
  cores = std::max<std::int64_t>(1, cores);
  e.threads = std::max<std::int64_t>(1, cores / ranks_per_host);
  e.core_sharing = std::max(1.0, static_cast<double>(ranks_per_host * e.threads) / static_cast<double>(cores));
  e.compute_seconds = compute_seconds(rank_graph, c, e.threads) * e.core_sharing;
  const auto links = mesh_links(mesh, ranks_per_host, c);
  for (std::size_t d = 0; d < links.size(); ++d) {
    const double bytes = d < traffic.bytes_by_dim.size() ? traffic.bytes_by_dim[d] : 0;
    const double messages = d < traffic.messages_by_dim.size() ? traffic.messages_by_dim[d] : 0;
    const double seconds = messages * links[d].alpha + bytes / links[d].beta;
    e.comm_seconds_by_dim.push_back(seconds);
    e.comm_bytes_by_dim.push_back(bytes);
    e.comm_seconds += seconds;
  }
  e.comm_seconds += static_cast<double>(issues) * c.collective_seconds;
  e.step_seconds = e.compute_seconds + e.comm_seconds;
  e.peak_bytes = peak_bytes;
  return e;
}

StepEstimate pipeline_step(const std::vector<StepEstimate>& stages, double bubble_fraction) {
  if (stages.empty()) throw std::invalid_argument("pipeline_step: no stages");
  if (!(bubble_fraction >= 0 && bubble_fraction < 1)) throw std::invalid_argument("pipeline_step: a bubble fraction must lie in [0, 1)");
  std::size_t slowest = 0;
  for (std::size_t s = 1; s < stages.size(); ++s) {
    if (stages[s].step_seconds > stages[slowest].step_seconds) slowest = s;
  }
  StepEstimate e = stages[slowest];
  e.stages = static_cast<std::int64_t>(stages.size());
  e.bubble_fraction = bubble_fraction;
  e.stage_seconds.clear();
  for (const auto& s : stages) {
    e.stage_seconds.push_back(s.step_seconds);
    e.peak_bytes = std::max(e.peak_bytes, s.peak_bytes);
  }
  const double busy = stages[slowest].step_seconds;
  e.bubble_seconds = busy * bubble_fraction / (1 - bubble_fraction);
  e.step_seconds = busy + e.bubble_seconds;
  return e;
}

Calibration fit_collective_seconds(Calibration c, const std::filesystem::path& metrics, std::int64_t warmup) {
  const std::string why = unreadable_file(metrics);  // a FIFO would block
  std::ifstream in;
  if (why.empty()) in.open(metrics);
  if (!why.empty() || !in) {
    throw std::invalid_argument(metrics.string() + ": cannot be read (" + (why.empty() ? std::strerror(errno) : why) +
                                "; give a run's job.dump_folder or its metrics.jsonl)");
  }
  std::vector<double> exposed, bytes, collectives;
  std::string line;
  std::int64_t n = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      check_json_nesting(line);
      j = nlohmann::json::parse(line);
    } catch (const std::exception&) {
      continue;
    }
    if (!j.contains("exposed_comm_ms") || !j.contains("collectives") || !j.contains("comm_bytes") || ++n <= warmup) continue;
    exposed.push_back(j["exposed_comm_ms"].get<double>() * 1e-3);
    bytes.push_back(j["comm_bytes"].get<double>());
    collectives.push_back(j["collectives"].get<double>());
  }
  if (exposed.empty()) {
    throw std::invalid_argument(metrics.string() + ": no step after the first " + std::to_string(warmup) +
                                " with exposed_comm_ms, comm_bytes and collectives: run more steps of a job of several ranks");
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double k = median(collectives);
  if (k <= 0) throw std::invalid_argument(metrics.string() + ": its steps run no collective: fit to a run of several ranks");
  c.collective_seconds = std::max(0.0, (median(exposed) - median(bytes) / c.intra_host.beta) / k);
  char source[512];
  std::snprintf(source, sizeof source, "fitted to %s: %.2f ms exposed, %.0f collectives a step", metrics.string().c_str(), median(exposed) * 1e3, k);
  c.collective_source = source;
  return c;
}

}  // namespace spmdx::plan
