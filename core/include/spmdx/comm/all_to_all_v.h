// The host's entry to all_to_all_v (interfaces/spmdx/comm.h, VariableAllToAll, ABI 4.1): the
// all-to-all whose split sizes only the senders know at run time. A backend offers it through
// an interface of its own, so that plugins built for ABI 4.0 still load; this is where a
// backend without it is refused, by name.
#pragma once

#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "spmdx/comm.h"

namespace spmdx::comm {

/// backend's all_to_all_v: `in`, `out`, `send_counts` and `recv_counts` as VariableAllToAll
/// states them (counts in elements; out.count the capacity; recv_counts one entry per group
/// member, written before the Work completes). Throws std::invalid_argument naming the backend
/// when it does not implement VariableAllToAll (a plugin built for ABI 4.0).
inline std::unique_ptr<Work> all_to_all_v(CommBackend& backend, int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                          std::size_t* recv_counts) {
  auto* v = dynamic_cast<VariableAllToAll*>(&backend);
  if (v == nullptr) {
    throw std::invalid_argument("comm backend " + backend.describe() +
                                " has no all_to_all_v (VariableAllToAll, plugin ABI 4.1): its plugin was built for ABI 4.0 or does not "
                                "implement it; rebuild the plugin against this spmdx, or use ucx or nccl");
  }
  return v->all_to_all_v(group, in, out, std::move(send_counts), recv_counts);
}

}  // namespace spmdx::comm
