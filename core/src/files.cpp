#include "spmdx/files.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>

namespace spmdx {

void fsync_path(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

std::string unreadable_file(const std::filesystem::path& path) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(st)) return ec && ec != std::errc::no_such_file_or_directory ? ec.message() : "no such file";
  if (!std::filesystem::is_regular_file(st)) return "not a regular file (a folder, FIFO or device)";
  if (::access(path.c_str(), R_OK) != 0) return std::strerror(errno);
  return "";
}

std::string read_file_bytes(const std::filesystem::path& path) {
  if (std::string why = unreadable_file(path); !why.empty()) throw std::runtime_error(why);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(std::strerror(errno));
  std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  if (in.bad()) throw std::runtime_error(std::string("reading failed: ") + std::strerror(errno));
  return bytes;
}

std::filesystem::path move_aside(const std::filesystem::path& file) {
  for (int n = 1;; ++n) {
    const std::filesystem::path to = file.parent_path() / (file.stem().string() + "." + std::to_string(n) + file.extension().string());
    if (::renameat2(AT_FDCWD, file.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return to;
    if (errno == EEXIST) continue;
    if (errno == EINVAL || errno == ENOSYS) {  // a file system without RENAME_NOREPLACE: a hard link never replaces either
      if (::link(file.c_str(), to.c_str()) == 0) {
        ::unlink(file.c_str());
        return to;
      }
      if (errno == EEXIST) continue;
    }
    throw std::runtime_error("cannot keep " + file.string() + " as " + to.string() + ": " + std::strerror(errno) + "; nothing was changed");
  }
}

void write_file_atomic(const std::filesystem::path& path, const std::string& bytes) {
  std::filesystem::path tmp = path;
  tmp += ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) throw std::runtime_error("cannot write " + tmp.string() + ": " + std::strerror(errno));
  }
  fsync_path(tmp);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    const std::string why = ec.message();
    std::filesystem::remove(tmp, ec);
    throw std::runtime_error("cannot rename " + tmp.string() + " to " + path.string() + ": " + why);
  }
  fsync_path(path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path());
}

}  // namespace spmdx
