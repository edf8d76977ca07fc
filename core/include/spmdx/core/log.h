// Logging facade for all spmdx library code, over spdlog (stderr, one line per message).
//
//   SPMDX_INFO("loaded " << path << " in " << seconds << " s");
//
// The message is built with operator<< only when its level is enabled. This header includes
// no spdlog or fmt headers on purpose: LibTorch ships its own fmt, and the two must never
// meet in one translation unit through a widely included header.
// Level: set_level(), or the environment variable SPMDX_LOG_LEVEL
// (trace|debug|info|warn|error|off; default info).
//
// A line is the program's output like any other, in one form for every process: "[rank R] "
// when set_rank named one (a rank whose output no spmdx launcher relays: the launcher prefixes
// the ranks it started itself, once), then the level as compilers say it ("warning: ",
// "error: ", "debug: ", "trace: "; nothing for info), then the message. No timestamps: the
// step lines and the rest of a run's output have none either (metrics.jsonl keeps the timings).
#pragma once

#include <optional>
#include <sstream>
#include <string>
#include <string_view>

namespace spmdx::log {

enum class Level { trace, debug, info, warn, error, off };

void set_level(Level level);
Level level() noexcept;
bool enabled(Level level) noexcept;
/// Prefix every line with "[rank R]"; a negative rank removes the prefix.
void set_rank(int rank);
/// "[rank 3] warning: peer 2 is slow": one line as write() prints it (rank < 0: no prefix).
std::string format(Level level, int rank, const std::string& message);

/// While one lives, this thread's records below `level` are dropped (other threads' are not):
/// for a check that repeats work whose lines are said where the work is done for real (the
/// launcher's preflight runs the hooks' compile stages for their verdict; rank 0 runs and
/// reports them as part of the job).
class ThreadLevel {
 public:
  explicit ThreadLevel(Level level);
  ~ThreadLevel();
  ThreadLevel(const ThreadLevel&) = delete;
  ThreadLevel& operator=(const ThreadLevel&) = delete;

 private:
  int previous_;
};
/// Writes one message at `level` (thread-safe).
void write(Level level, const std::string& message);
/// "trace", "debug", "info", "warn" (or "warning"), "error", "off"; nullopt otherwise.
std::optional<Level> parse_level(std::string_view text);

}  // namespace spmdx::log

#define SPMDX_LOG(LEVEL, EXPR)                        \
  do {                                                \
    if (::spmdx::log::enabled(LEVEL)) {               \
      std::ostringstream spmdx_log_stream_;           \
      spmdx_log_stream_ << EXPR;                      \
      ::spmdx::log::write(LEVEL, spmdx_log_stream_.str()); \
    }                                                 \
  } while (false)

#define SPMDX_TRACE(EXPR) SPMDX_LOG(::spmdx::log::Level::trace, EXPR)
#define SPMDX_DEBUG(EXPR) SPMDX_LOG(::spmdx::log::Level::debug, EXPR)
#define SPMDX_INFO(EXPR) SPMDX_LOG(::spmdx::log::Level::info, EXPR)
#define SPMDX_WARN(EXPR) SPMDX_LOG(::spmdx::log::Level::warn, EXPR)
#define SPMDX_ERROR(EXPR) SPMDX_LOG(::spmdx::log::Level::error, EXPR)
