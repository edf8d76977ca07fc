// The job's Store over LibTorch's c10d::TCPStore, as a client: under torchrun, whose agent
// serves a c10d TCPStore at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True), the
// ranks rendezvous there instead of serving a store of their own. It lives beside the store it
// stands in for (store.h), but is built into the exec library because c10d is in LibTorch.
#pragma once

#include <memory>
#include <string>

#include "spmdx/comm.h"

namespace spmdx::comm {

/// Connects to the c10d TCPStore at host:port; every key gets `prefix` (so that several jobs
/// can share the agent's store). Throws CommError naming host:port when it cannot connect
/// within timeout_seconds.
std::unique_ptr<Store> connect_c10d_store(const std::string& host, int port, const std::string& prefix, double timeout_seconds);

}  // namespace spmdx::comm
