#include "spmdx/metrics/tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <boost/crc.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <system_error>

#include "event.pb.h"
#include "spmdx/core/log.h"

namespace spmdx::metrics {
namespace {

namespace fs = std::filesystem;

// TensorFlow's events_writer.cc: the version every event file starts with.
constexpr const char* kFileVersion = "brain.Event:2";
// Buffered records are written once they pass this, flush() or not.
constexpr std::size_t kFlushBytes = std::size_t{1} << 20;

void put_le(std::string& out, std::uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

std::string errno_text(int err) { return std::strerror(err); }

std::string hostname() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

// Files this process opened, for the last part of their names (torch.utils.tensorboard's
// global_uid).
std::atomic<unsigned> g_files{0};

}  // namespace

// CRC-32C from Boost.CRC (header-only, in libboost-dev which spmdx already needs): Debian 12 has
// no C/C++ CRC-32C library package (libcrc32c-dev is not in bookworm; abseil's crc32c came in a
// later release). Castagnoli's polynomial 0x1EDC6F41 (0x82F63B78 reflected), reflected input and
// output, initial value and final XOR 0xFFFFFFFF: CRC-32C as RFC 3720 defines it.
std::uint32_t crc32c(std::string_view data) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;
  crc.process_bytes(data.data(), data.size());
  return crc.checksum();
}

std::uint32_t masked_crc32c(std::string_view data) {
  const std::uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  put_le(out, data.size(), 8);
  put_le(out, masked_crc32c(out), 4);
  out.append(data);
  put_le(out, masked_crc32c(data), 4);
  return out;
}

double unix_time_s() {
  const auto since_epoch = std::chrono::system_clock::now().time_since_epoch();
  return std::chrono::duration<double>(since_epoch).count();
}

struct EventWriter::Impl {
  fs::path file;
  int fd = -1;
  std::string buffer;  // framed records not yet written

  void append(const tf::Event& event) {
    std::string bytes;
    if (!event.SerializeToString(&bytes)) throw std::runtime_error(file.string() + ": cannot serialize an Event");
    buffer += tfrecord(bytes);
  }

  void write_buffer() {
    std::size_t done = 0;
    while (done < buffer.size()) {
      const ssize_t n = ::write(fd, buffer.data() + done, buffer.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = n < 0 ? errno : EIO;
        buffer.erase(0, done);  // what went out stays out: a retry writes only the rest
        throw std::runtime_error("cannot write the TensorBoard event file " + file.string() + ": " + errno_text(err));
      }
      done += static_cast<std::size_t>(n);
    }
    buffer.clear();
  }

  ~Impl() {
    if (fd < 0) return;
    try {
      write_buffer();
    } catch (const std::exception& e) {
      SPMDX_WARN(e.what() << " (" << buffer.size() << " bytes of scalars lost)");
    }
    if (::close(fd) != 0) SPMDX_WARN("closing the TensorBoard event file " << file.string() << ": " << errno_text(errno));
  }
};

EventWriter::EventWriter(const fs::path& folder) : impl_(std::make_unique<Impl>()) {
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec) throw std::runtime_error("cannot create the TensorBoard folder " + folder.string() + ": " + ec.message());
  const double now = unix_time_s();
  const std::string stem = "events.out.tfevents." + std::to_string(static_cast<long long>(now)) + "." + hostname() +
                           "." + std::to_string(::getpid()) + ".";
  // O_EXCL: never append to another writer's file (two writers in one second, one host and one
  // pid can only be this process's, which g_files tells apart; a stale file of a reused pid
  // makes us take the next number).
  for (int attempt = 0; impl_->fd < 0; ++attempt) {
    impl_->file = folder / (stem + std::to_string(g_files.fetch_add(1)));
    impl_->fd = ::open(impl_->file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (impl_->fd < 0 && (errno != EEXIST || attempt >= 100)) {
      throw std::runtime_error("cannot create the TensorBoard event file " + impl_->file.string() + ": " +
                               errno_text(errno));
    }
  }
  tf::Event event;
  event.set_wall_time(now);
  event.set_step(0);
  event.set_file_version(kFileVersion);
  impl_->append(event);
  flush();
}

EventWriter::~EventWriter() = default;
EventWriter::EventWriter(EventWriter&&) noexcept = default;
EventWriter& EventWriter::operator=(EventWriter&&) noexcept = default;

void EventWriter::add_scalar(const std::string& tag, double value, std::int64_t step, double wall_time_s) {
  if (tag.empty()) throw std::invalid_argument("TensorBoard scalar with an empty tag (step " + std::to_string(step) + ")");
  tf::Event event;
  event.set_wall_time(wall_time_s);
  event.set_step(step);
  tf::Summary::Value* v = event.mutable_summary()->add_value();
  v->set_tag(tag);
  // float32 is what TensorBoard keeps; a cast of a finite double past its range would be
  // undefined behaviour, so those become inf explicitly.
  constexpr double kMax = std::numeric_limits<float>::max();
  float f = static_cast<float>(std::isfinite(value) && std::fabs(value) > kMax
                                   ? std::copysign(std::numeric_limits<double>::infinity(), value)
                                   : value);
  v->set_simple_value(f);
  impl_->append(event);
  if (impl_->buffer.size() >= kFlushBytes) flush();
}

void EventWriter::flush() { impl_->write_buffer(); }

const fs::path& EventWriter::file() const { return impl_->file; }

}  // namespace spmdx::metrics
