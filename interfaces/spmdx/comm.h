// Communication backend plugins (ucx, nccl, local): how ranks of one job talk.
//
// This is the lifecycle part of the interface; collectives and work handles are added with
// the comm backends (issue 5), each addition bumping SPMDX_ABI_MAJOR (plugin.h).
// Plain C++17: part of the plugin ABI.
#pragma once

#include <cstdint>
#include <string>

namespace spmdx {

struct CommInit {
  int rank = 0;        ///< this process, 0 <= rank < world_size
  int world_size = 1;  ///< ranks in the job
  /// Bootstrap generation: 0 at start, +1 at each hot-swap, so keys of one generation never
  /// meet those of another in the rendezvous store.
  std::int64_t generation = 0;
};

class CommBackend {
 public:
  virtual ~CommBackend() = default;

  /// Joins the job. Throws std::runtime_error naming the rank that could not be reached.
  virtual void init(const CommInit& init) = 0;
  /// Completes outstanding work and leaves the job; the object may then be destroyed.
  virtual void finalize() = 0;
  /// Fails all outstanding and future work at once (a peer died); never blocks.
  virtual void abort() noexcept = 0;
  /// A short description for logs: backend, transport, rank/world_size.
  virtual std::string describe() const = 0;
};

}  // namespace spmdx
