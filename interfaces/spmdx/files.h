// Writing files so that a crash never leaves a half-written one under the final name.
// A host service of the plugin ABI (plugin.h): declared here, defined in libspmdx_core,
// versioned with SPMDX_ABI_MAJOR.
#pragma once

#include <filesystem>
#include <string>

namespace spmdx {

/// fsync(2) of a file or folder; errors are ignored (best effort, as after a rename).
void fsync_path(const std::filesystem::path& path);

/// Writes `bytes` to `path` atomically: a temporary file next to it, fsync, rename over
/// `path`, fsync of the folder. Throws std::runtime_error naming the file and errno's text.
void write_file_atomic(const std::filesystem::path& path, const std::string& bytes);

}  // namespace spmdx
