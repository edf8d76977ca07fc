// Writing files so that a crash never leaves a half-written one under the final name, and
// asking whether a path can be read as one.
// A host service of the plugin ABI (plugin.h): declared here, defined in libspmdx_host,
// versioned with SPMDX_ABI_MAJOR.
#pragma once

#include <filesystem>
#include <string>

namespace spmdx {

/// fsync(2) of a file or folder; errors are ignored (best effort, as after a rename).
void fsync_path(const std::filesystem::path& path);

/// Why `path` cannot be read as a file, "" when it can: "no such file", "not a regular file (a
/// folder, FIFO or device)", or the system's reason (e.g. "Permission denied"); the caller names
/// the file. Ask before opening: an std::ifstream on a FIFO blocks until a writer comes, maybe
/// forever (a FIFO named rank0.json hung spmdx fr-trace).
std::string unreadable_file(const std::filesystem::path& path);

/// The whole content of the file at `path`, as bytes. Throws std::runtime_error whose what() is
/// the reason alone, unreadable_file's or the system's, for the caller to name the file and say
/// what to do; a FIFO, folder or device is refused before it is opened.
std::string read_file_bytes(const std::filesystem::path& path);

/// Keeps `file` whole under the first free name beside it, <stem>.<N><ext> for N = 1, 2, ...
/// (metrics.jsonl -> metrics.1.jsonl, rank0.json -> rank0.1.json), never over another file
/// (renameat2's RENAME_NOREPLACE, or a hard link where the file system lacks it), and returns
/// where. Used before a file that holds an earlier run's record is replaced or cut, so that
/// nothing it held is lost; the caller says where it went. Throws std::runtime_error naming
/// both paths and the system's reason, the file left where it was. ABI 3.4.
std::filesystem::path move_aside(const std::filesystem::path& file);

/// Writes `bytes` to `path` atomically: a temporary file next to it, fsync, rename over
/// `path`, fsync of the folder. Throws std::runtime_error naming the file and errno's text.
void write_file_atomic(const std::filesystem::path& path, const std::string& bytes);

}  // namespace spmdx
