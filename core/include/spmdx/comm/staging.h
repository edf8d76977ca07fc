// Collectives between ranks whose tensors live in different memories (a mesh of CUDA and CPU
// ranks): a CUDA rank's call goes to the backend as it is when the backend picked for its
// CUDA buffer is also the one every host member picks (UCX built with CUDA moves both); else
// it is staged through host buffers: copied to host memory, run there on the backend's host
// pick, and copied back once done. This is what MPI libraries without CUDA awareness ask of
// their callers, and what PyTorch's gloo backend does for CUDA tensors (ProcessGroupGloo's
// CUDA all_reduce copies to pinned host memory, reduces there, and copies back).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "spmdx/comm.h"

namespace spmdx::comm {

/// Whether a call of `op` on a CUDA buffer of `bytes` (sized as the scored backend picks:
/// all_gather its output, all_to_all 0) is staged through host memory. `members` is the
/// job's backend's capability tables, one per member (member_capabilities, score_map.h);
/// `group_has_host`: some member of the call's group (or the peer, for send/recv) has host
/// memory. Staged when no member serves `op` on CUDA memory, or when the group mixes memories
/// and the CUDA pick is not the host pick (every rank of a group must call the same backend).
bool stages_through_host(const std::vector<std::vector<CommCapability>>& members, const std::string& op, std::size_t bytes, bool group_has_host);

/// The host buffers of the staging and the copies into and out of them: on a GPU pinned host
/// memory and copies after this rank's compute stream (exec::make_host_staging); in tests a
/// fake that copies host to host. Thread: the one that issues calls (copies back run in
/// Work::wait, which the executor also calls from that thread).
class HostStaging {
 public:
  virtual ~HostStaging() = default;
  /// Host memory of at least `bytes` (pinned where the device can), valid until release().
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void release(void* host) noexcept = 0;
  /// `bytes` from device memory at `device` into host memory at `host`, done when it returns.
  virtual void to_host(void* host, const void* device, std::size_t bytes) = 0;
  /// `bytes` from host memory at `host` into device memory at `device`, done when it returns.
  virtual void to_device(void* device, const void* host, std::size_t bytes) = 0;
};

/// What a staging backend copied: calls staged, and bytes each way.
struct StagingStats {
  std::int64_t staged_calls = 0;
  std::int64_t direct_calls = 0;  ///< CUDA calls passed to the backend as they were
  std::int64_t to_host_bytes = 0;
  std::int64_t to_device_bytes = 0;
};

/// A CommBackend over `inner` (not owned; outlives this) for a rank whose buffers are CUDA
/// memory in a job where `rank_memory[r]` is rank r's memory. Each call on a CUDA buffer is
/// staged or passed on as stages_through_host says for its group (the groups are learnt from
/// new_group, as each rank makes them; group 0 is every rank); host buffers always pass on.
/// A staged call's inputs are copied to host buffers before the call and its outputs back
/// when its Work completes (Work::wait or test true), so a reader waits for the Work as for
/// any call. Not StreamOrdered: the executor orders a staged rank with host waits. Has
/// VariableAllToAll when `inner` has it (throws as comm::all_to_all_v otherwise).
/// Throws std::invalid_argument when rank_memory is empty.
class StagingBackend final : public CommBackend, public VariableAllToAll {
 public:
  StagingBackend(CommBackend& inner, std::vector<MemoryType> rank_memory, HostStaging& staging);
  ~StagingBackend() override = default;

  void init(const CommInit& init) override { inner_.init(init); }
  void finalize() override { inner_.finalize(); }
  void abort() noexcept override { inner_.abort(); }
  std::string describe() const override;
  std::vector<CommCapability> capabilities() const override { return inner_.capabilities(); }
  int new_group(const std::vector<int>& ranks) override;

  std::unique_ptr<Work> all_reduce(int group, CommBuffer buf, ReduceOp op) override;
  std::unique_ptr<Work> all_gather(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts) override;
  std::unique_ptr<Work> reduce_scatter(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts, ReduceOp op) override;
  std::unique_ptr<Work> all_to_all(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                   std::vector<std::size_t> recv_counts) override;
  std::unique_ptr<Work> all_to_all_v(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                     std::size_t* recv_counts) override;
  std::unique_ptr<Work> broadcast(int group, CommBuffer buf, int root_member) override;
  std::unique_ptr<Work> send(CommBuffer buf, int peer_rank, int tag) override;
  std::unique_ptr<Work> recv(CommBuffer buf, int peer_rank, int tag) override;
  std::unique_ptr<Work> barrier(int group) override { return inner_.barrier(group); }

  const StagingStats& stats() const noexcept { return *stats_; }

 private:
  struct Staged;
  // The host buffers of a call to stage (stages_through_host), or null for one passed on as it is.
  std::shared_ptr<Staged> stage(const std::string& op, std::size_t bytes, bool has_host, const CommBuffer& buf);
  bool group_has_host(int group) const;
  bool peer_has_host(int peer_rank) const;
  std::unique_ptr<Work> wrap(std::unique_ptr<Work> work, std::shared_ptr<Staged> staged);

  CommBackend& inner_;
  std::vector<MemoryType> rank_memory_;
  HostStaging& staging_;
  std::vector<std::vector<CommCapability>> members_;
  std::map<int, bool> group_host_;  // the inner backend's group id -> whether a member has host memory
  std::shared_ptr<StagingStats> stats_ = std::make_shared<StagingStats>();  // shared with Works in flight
};

}  // namespace spmdx::comm
