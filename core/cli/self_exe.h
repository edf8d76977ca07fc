// This program's own path: `spmdx run --nproc` and `spmdx bench comm` start their ranks as
// copies of it.
#pragma once

#include <string>

namespace spmdx::cli {

// /proc/self/exe resolved, or "/proc/self/exe" itself when it cannot be read.
std::string self_exe();

}  // namespace spmdx::cli
