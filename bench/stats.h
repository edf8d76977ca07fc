// What the C++ bench programs share: the median of timed runs.
#pragma once

#include <algorithm>
#include <vector>

namespace spmdx::bench {

// The middle value of `v` (the upper of the two for an even count); v must not be empty.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace spmdx::bench
