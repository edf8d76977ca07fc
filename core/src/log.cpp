#include "spmdx/core/log.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>

namespace spmdx::log {
namespace {

std::atomic<int> g_level{-1};  // -1: not yet read from the environment
std::atomic<int> g_rank{-1};
thread_local int t_floor = 0;  // this thread's lowest level written (ThreadLevel)

spdlog::level::level_enum to_spdlog(Level level) {
  switch (level) {
    case Level::trace: return spdlog::level::trace;
    case Level::debug: return spdlog::level::debug;
    case Level::info: return spdlog::level::info;
    case Level::warn: return spdlog::level::warn;
    case Level::error: return spdlog::level::err;
    case Level::off: return spdlog::level::off;
  }
  return spdlog::level::info;
}

spdlog::logger& logger() {
  // Not registered in spdlog's global registry: a plugin or user program that uses spdlog
  // for itself keeps its own default logger.
  static auto instance = [] {
    auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
    auto l = std::make_shared<spdlog::logger>("spmdx", sink);
    l->set_pattern("%v");  // format() writes the line
    l->set_level(spdlog::level::trace);  // filtering happens in enabled()
    return l;
  }();
  return *instance;
}

}  // namespace

std::optional<Level> parse_level(std::string_view text) {
  if (text == "trace") return Level::trace;
  if (text == "debug") return Level::debug;
  if (text == "info") return Level::info;
  if (text == "warn" || text == "warning") return Level::warn;
  if (text == "error") return Level::error;
  if (text == "off") return Level::off;
  return std::nullopt;
}

void set_level(Level level) { g_level.store(static_cast<int>(level)); }

Level level() noexcept {
  int current = g_level.load(std::memory_order_relaxed);
  if (current < 0) {
    Level from_env = Level::info;
    const char* env = std::getenv("SPMDX_LOG_LEVEL");
    const auto parsed = env ? parse_level(env) : std::nullopt;
    if (parsed) from_env = *parsed;
    int expected = -1;
    if (g_level.compare_exchange_strong(expected, static_cast<int>(from_env)) && env && !parsed) {
      logger().warn("SPMDX_LOG_LEVEL='{}' is not one of trace, debug, info, warn, error, off; using info", env);
    }
    current = g_level.load();
  }
  return static_cast<Level>(current);
}

bool enabled(Level l) noexcept {
  return l != Level::off && static_cast<int>(l) >= static_cast<int>(level()) && static_cast<int>(l) >= t_floor;
}

void set_rank(int rank) { g_rank.store(rank); }

std::string format(Level l, int rank, const std::string& message) {
  std::string line = rank >= 0 ? "[rank " + std::to_string(rank) + "] " : std::string();
  switch (l) {
    case Level::trace: line += "trace: "; break;
    case Level::debug: line += "debug: "; break;
    case Level::warn: line += "warning: "; break;
    case Level::error: line += "error: "; break;
    case Level::info:
    case Level::off: break;
  }
  return line + message;
}

void write(Level l, const std::string& message) { logger().log(to_spdlog(l), "{}", format(l, g_rank.load(std::memory_order_relaxed), message)); }

ThreadLevel::ThreadLevel(Level level) : previous_(t_floor) { t_floor = std::max(t_floor, static_cast<int>(level)); }
ThreadLevel::~ThreadLevel() { t_floor = previous_; }

}  // namespace spmdx::log
