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
