// Point-to-point transports (ucx, local): what a comm plugin implements when the host's
// collective engine should run its collectives (as gloo's transport/ under its algorithms, and
// UCC's TLs under its CLs).
//
// A transport moves bytes between two ranks under a 64-bit tag, with MPI's matching rule: a
// receive from `peer` under `tag` takes that peer's sends under that tag in the order they were
// posted. The host's engine (core/src/comm/p2p/: ring, direct, tree and shared-memory
// collectives, reductions, heartbeat and blame) holds one transport per backend and calls it
// from its communication thread only, so a transport need not be thread-safe.
//
// Registering one:
//     r.add_transport("my_net", {{"device"}, [](const spmdx::Options& o) { return std::make_unique<MyNet>(o); }});
// The host then offers a comm backend "my_net" whose options are the engine's (chunk_bytes,
// direct_max_bytes, shm, shm_chunk_bytes; docs/comm.md, "Comm backends") plus the keys named in
// TransportInfo::options, which alone reach the factory; any other key is refused by the host,
// listing both (`spmdx plugins` prints them as "options of my_net").
//
// Lifetimes. The factory runs whenever spmdx needs the backend's description or capabilities,
// not only to run one: in `spmdx plugins`, in spmdx run's check of the config before any rank
// starts, for every candidate of comm.backend = "auto", and once per rank at job start and at
// each hot-swap. So it must be cheap and open nothing (sockets, devices, files): check the
// options there and throw std::invalid_argument for a bad one (naming the key and what is
// accepted), and acquire resources in connect(). describe() and capabilities() are called on
// transports that are never connected. connect() runs once, before any isend/irecv; the
// destructor after the engine stopped (no request is then in flight that the engine still
// waits on; a transport forgets requests it never completed). Buffers passed to isend/irecv
// stay valid until test() returned true for that request (or the transport is destroyed).
//
// Progress. The engine posts several requests at once (a ring step's send and receive, a
// pipeline's chunks to and from several peers) and then calls test() on one at a time, in any
// order: every call to test() must move all outstanding requests forward, not only the one
// tested, or two ranks each waiting on a receive whose peer's send is not progressing deadlock.
// Messages of 0 bytes occur (empty blocks of uneven collectives) and must match like others.
//
// Scores. capabilities() is what comm.backend = "auto" scores (CommCapability in comm.h): the
// highest score covering a call wins; equal scores go to the backend whose name sorts first.
// Built in: ucx 10 and local 1 on host memory, nccl 100 on CUDA memory. Give a transport that
// should replace ucx on host memory more than 10, one for some sizes only a capability with
// min_bytes/max_bytes. Plain C++20: part of the plugin ABI (interfaces/spmdx/plugin.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "spmdx/comm.h"

namespace spmdx {

class Transport {
 public:
  virtual ~Transport() = default;

  /// Joins the job: publishes this rank's address in init.store (under keys that include
  /// init.generation, so a hot-swapped transport never reads a retired one's) and connects to
  /// every other rank. Throws CommError naming the rank that could not be reached (peer()
  /// set), std::invalid_argument for a job this transport cannot serve (ranks in other
  /// processes for an in-process transport), saying what to use instead.
  virtual void connect(const CommInit& init) = 0;
  /// What follows the backend's name in logs: "UCX_TLS=shm,self", "threads of one process".
  virtual std::string describe() const = 0;
  /// The memory types, operations and sizes this transport serves, with UCC-style scores
  /// (higher wins). "*" for every operation. The engine reports them as its backend's.
  virtual std::vector<CommCapability> capabilities() const = 0;

  /// Posts a send of `bytes` bytes at `data` to global rank `peer` under `tag`; returns a
  /// request id (0: already complete, the buffer may be reused at once). Throws CommError
  /// naming the peer when the send cannot be posted.
  virtual std::uint64_t isend(int peer, const void* data, std::size_t bytes, std::uint64_t tag) = 0;
  /// Posts a receive of exactly `bytes` bytes from `peer` under `tag` into `data`; returns a
  /// request id (0: already complete). A message of another size is a CommError (the ranks run
  /// different collectives).
  virtual std::uint64_t irecv(int peer, void* data, std::size_t bytes, std::uint64_t tag) = 0;
  /// Makes progress; true once the request completed (its id is then forgotten; an unknown id
  /// is complete). Throws CommError naming the peer when the request failed. Never blocks.
  virtual bool test(std::uint64_t request) = 0;
};

/// Plugin options, as in plugin.h: the keys of the plugin's config table.
using Options = std::map<std::string, std::string>;
using TransportFactory = std::function<std::unique_ptr<Transport>(const Options&)>;

/// A transport's registration: the option keys it reads (the host refuses others, naming
/// these and the engine's) and its factory. The factory validates the values and throws
/// std::invalid_argument naming the plugin, the key and what is accepted.
struct TransportInfo {
  std::vector<std::string> options;
  TransportFactory factory;
};

}  // namespace spmdx
