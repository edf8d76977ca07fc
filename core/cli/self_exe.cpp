// This program's own path (self_exe.h).
#include "self_exe.h"

#include <unistd.h>

namespace spmdx::cli {

std::string self_exe() {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  return n > 0 ? std::string(self, static_cast<std::size_t>(n)) : "/proc/self/exe";
}

}  // namespace spmdx::cli
