// Wall-clock time as the hook interface reports it.
#pragma once

#include <chrono>

namespace spmdx {

/// Seconds since the Unix epoch (std::chrono::system_clock), the time base of spans and
/// collective events, so that traces of the ranks of one host line up.
inline double wall_seconds() noexcept {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace spmdx
