// The collective engine: every collective of comm.h built on a point-to-point Transport
// (interfaces/spmdx/transport.h), as gloo's algorithms run over its transport pairs and UCC's
// CLs over its TLs. The algorithms, each as the literature gives it:
//   all_reduce      ring: reduce-scatter then all-gather (Patarasuk & Yuan 2009), its steps
//                   pipelined in chunks (ring.cpp); recursive doubling for small messages on
//                   power-of-two groups (Thakur et al. 2005); direct (all-pairs) reduce-scatter
//                   then all-gather for mid sizes on small groups (direct.cpp), as MPICH's and
//                   Open MPI's shared-memory collectives read every peer's block at once
//   all_gather      ring or direct, uneven blocks (MPI_Allgatherv)
//   reduce_scatter  ring (pipelined) or direct, uneven blocks
//   all_to_all      pairwise exchange (direct.cpp)
//   all_to_all_v    the counts all-pairs, then the pairwise exchange (direct.cpp)
//   broadcast       binomial tree; barrier: dissemination (tree.cpp)
// Groups whose members share a host run all_reduce, reduce_scatter and all_gather through a
// shared-memory segment instead (shm.cpp: Open MPI's coll/sm, UCC's tl/shm). Operations run in
// submission order on one communication thread per backend (engine.cpp), so compute overlaps
// them; Work handles report completion, and a peer that fails or stays silent past the timeout
// fails the operation with a CommError naming the collective and the peer rank (health.cpp).
// After such a failure the backend is aborted: every later operation fails at once, naming the
// first failure.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "spmdx/comm.h"
#include "spmdx/plugin.h"
#include "spmdx/transport.h"

namespace spmdx::comm {

/// The engine's options, given in the backend's config spec next to the transport's
/// ("ucx:chunk_bytes=256K;tls=tcp,self"). Sizes as spmdx::parse_bytes reads them (262144,
/// 256K, 4MiB, 1MB).
struct P2POptions {
  /// The pipeline chunk of ring all_reduce / reduce_scatter steps, bytes (at least 64; default
  /// 1 MiB: 4 chunks in flight stay in the last-level cache; 256 KiB to 4 MiB measured alike
  /// on 2 and 4 ranks here).
  std::size_t chunk_bytes = std::size_t{1} << 20;
  /// all_reduce, reduce_scatter and all_gather of at most this many bytes on groups of at most
  /// 8 members go direct, every member to every other at once, instead of around the ring
  /// (default 4 MiB; 0: always the ring). On 3 and 4 ranks here direct had 1.3-2x the ring's
  /// busbw from 128 KiB to 4 MiB and the same above.
  std::size_t direct_max_bytes = std::size_t{4} << 20;
  /// On (default): all_reduce, reduce_scatter and all_gather of a group whose members share a
  /// host (same host name and boot id, with a store) go through shared memory; a group that
  /// cannot map it (full /dev/shm) warns and uses the transport. Measured here (64 MiB
  /// all_reduce busbw): 2 ranks 7.5 vs 3.2-3.6 GB/s, 4 ranks 3.2 vs 1.8-1.9 GB/s through UCX.
  bool shm = true;
  /// Bytes of each member's block per shared-memory round (64 to 64M, default 256 KiB). A
  /// group's segment, which every member maps, is 3 x members^2 x this (12 MiB for 4 members
  /// at the default), at most 256 MiB: larger groups get smaller rounds. Every rank must use
  /// the same shm and shm_chunk_bytes; a group whose members differ warns and uses the transport.
  std::size_t shm_chunk_bytes = std::size_t{256} << 10;

  /// "chunk_bytes=1048576, direct_max_bytes=4194304, shm=on, shm_chunk_bytes=262144".
  std::string str() const;
};

/// The engine's option keys: chunk_bytes, direct_max_bytes, shm, shm_chunk_bytes.
const std::vector<std::string>& p2p_option_keys();

/// The option keys a backend over a transport registered with `info` takes: the transport's,
/// then the engine's.
std::vector<std::string> transport_backend_options(const TransportInfo& info);

/// Removes the engine's keys from `options` (leaving the transport's) and returns their values.
/// Throws std::invalid_argument naming `backend`, the key and the accepted values for a bad value.
P2POptions take_p2p_options(const std::string& backend, Options& options);

/// A comm backend named `name` whose collectives run over `transport`, not yet initialised:
/// init() connects the transport and starts the communication thread.
std::unique_ptr<CommBackend> make_p2p_backend(std::string name, std::unique_ptr<Transport> transport, P2POptions options);

/// The comm backend factory the plugin registry offers for a transport registered as `name`:
/// it takes the engine's options, refuses any key that is neither the engine's nor in
/// info.options (std::invalid_argument listing the known keys), and calls info.factory with
/// the transport's own keys.
CommBackendFactory p2p_backend_factory(std::string name, TransportInfo info);

}  // namespace spmdx::comm
