#include "spmdx/job/devices.h"

#include <algorithm>
#include <stdexcept>

namespace spmdx::job {

std::vector<std::string> configured_devices(const std::string& device, const std::vector<std::string>& devices) {
  return devices.empty() ? std::vector<std::string>{device} : devices;
}

std::string resolve_device(const std::string& configured, int local_rank, int gpus_here) {
  if (configured == "cpu" || configured == "cuda") return configured;
  if (configured == "auto") return local_rank >= 0 && local_rank < gpus_here ? "cuda" : "cpu";
  throw std::invalid_argument("training.device \"" + configured + "\": use \"cpu\", \"cuda\" or \"auto\"");
}

std::vector<MemoryType> rank_memory(const std::vector<std::string>& devices) {
  std::vector<MemoryType> out;
  for (const auto& d : devices) out.push_back(d == "cuda" ? MemoryType::cuda : MemoryType::host);
  return out;
}

bool mixed_devices(const std::vector<std::string>& devices) {
  return std::any_of(devices.begin(), devices.end(), [&](const std::string& d) { return d != devices.front(); });
}

std::vector<MemoryType> job_comm_memory(const std::vector<std::string>& devices) {
  if (comm_device(devices) == "cuda") return {MemoryType::cuda, MemoryType::host};
  return {MemoryType::host};
}

std::string comm_device(const std::vector<std::string>& devices) {
  const bool cuda = !devices.empty() && std::all_of(devices.begin(), devices.end(), [](const std::string& d) { return d == "cuda"; });
  return cuda ? "cuda" : "cpu";
}

std::vector<std::string> exchange_devices(Store& store, int rank, int world_size, const std::string& mine, double timeout_seconds,
                                          const std::string& generation) {
  const std::string prefix = "spmdx/devices/" + generation + "/r";
  store.set(prefix + std::to_string(rank), mine);
  std::vector<std::string> out;
  for (int r = 0; r < world_size; ++r) out.push_back(r == rank ? mine : store.get(prefix + std::to_string(r), timeout_seconds));
  return out;
}

std::string devices_text(const std::vector<std::string>& devices) {
  if (devices.empty()) return "";
  if (!mixed_devices(devices)) return devices.front();
  std::string out;
  for (std::size_t i = 0; i < devices.size();) {
    std::size_t j = i;
    while (j + 1 < devices.size() && devices[j + 1] == devices[i]) ++j;
    if (!out.empty()) out += ", ";
    out += i == j ? "rank " + std::to_string(i) : "ranks " + std::to_string(i) + "-" + std::to_string(j);
    out += " " + devices[i];
    i = j + 1;
  }
  return out;
}

}  // namespace spmdx::job
