// Which device each rank of a job runs on, when they differ: training.device = "auto" (CUDA for
// a local rank that has a GPU, else the CPU, as torchrun users write
// `"cuda" if torch.cuda.is_available() else "cpu"` per process) or training.devices, one entry
// per rank. The ranks tell each other their devices through the job's store at start; a mesh
// of CUDA and CPU ranks then moves its collectives in host memory (comm/staging.h). No LibTorch.
#pragma once

#include <string>
#include <vector>

#include "spmdx/comm.h"

namespace spmdx::job {

/// The devices configured, one per rank when training.devices (`devices`) is given, else
/// training.device (`device`) alone, standing for every rank.
std::vector<std::string> configured_devices(const std::string& device, const std::vector<std::string>& devices);

/// What a rank configured `configured` runs on: "cpu" or "cuda"; "auto" is "cuda" when
/// local_rank < gpus_here (this host's GPUs), else "cpu".
std::string resolve_device(const std::string& configured, int local_rank, int gpus_here);

/// Each rank's memory for the comm backends: cuda for a "cuda" rank, host for a "cpu" rank.
std::vector<MemoryType> rank_memory(const std::vector<std::string>& devices);

/// Whether the ranks' devices differ (some "cuda", some "cpu").
bool mixed_devices(const std::vector<std::string>& devices);

/// The memory types the job's comm backend must move (comm.backend = "auto" chooses by them):
/// CUDA first, then host, when every rank is on CUDA (comm::job_memory("cuda")); host alone
/// otherwise, also for a mixed mesh, where every rank must make the same backend and a CPU
/// rank can make none that moves only CUDA memory (nccl): its CUDA ranks stage their calls
/// through host memory.
std::vector<MemoryType> job_comm_memory(const std::vector<std::string>& devices);

/// "cuda" when every rank is on CUDA, "cpu" otherwise: the device preflight checks the comm
/// backends against (a mixed mesh moves host memory).
std::string comm_device(const std::vector<std::string>& devices);

/// Every rank's device, rank by rank: this rank's `mine` published under
/// spmdx/devices/<generation>/r<rank>, then each rank's read (each waits up to
/// timeout_seconds for a rank's entry: CommError naming the key, from Store::get).
std::vector<std::string> exchange_devices(Store& store, int rank, int world_size, const std::string& mine, double timeout_seconds,
                                          const std::string& generation = "0");

/// For logs: "cuda" or "cpu" when all ranks agree; else "ranks 0-1 cuda, rank 2 cpu".
std::string devices_text(const std::vector<std::string>& devices);

}  // namespace spmdx::job
