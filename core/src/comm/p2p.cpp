// The collective engine's public face (spmdx/comm/p2p.h): its options as a backend spec gives
// them, and a transport a comm plugin registers made into a comm backend that runs the engine
// over it. The engine itself is in p2p/ (engine.cpp makes it: make_p2p_backend).
#include "spmdx/comm/p2p.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "spmdx/core/registry.h"
#include "spmdx/text.h"

namespace spmdx::comm {
namespace {

// What the plugin registry makes of a transport (registry.h's TransportWrapper).
TransportBackend transport_backend(const std::string& name, TransportInfo info) {
  for (const auto& key : info.options) {
    const auto& engine = p2p_option_keys();
    if (std::find(engine.begin(), engine.end(), key) != engine.end()) {
      throw std::invalid_argument("transport '" + name + "' claims option '" + key + "', which is the collective engine's; rename it");
    }
  }
  std::vector<std::string> keys = transport_backend_options(info);
  return {p2p_backend_factory(name, std::move(info)), std::move(keys)};
}

// Hands the registry the wrapper when this library is loaded.
const bool registered = [] {
  set_transport_wrapper(transport_backend);
  return true;
}();

}  // namespace

std::string P2POptions::str() const {
  return "chunk_bytes=" + std::to_string(chunk_bytes) + ", direct_max_bytes=" + std::to_string(direct_max_bytes) +
         ", shm=" + (shm ? "on" : "off") + ", shm_chunk_bytes=" + std::to_string(shm_chunk_bytes);
}

const std::vector<std::string>& p2p_option_keys() {
  static const std::vector<std::string> keys{"chunk_bytes", "direct_max_bytes", "shm", "shm_chunk_bytes"};
  return keys;
}

std::vector<std::string> transport_backend_options(const TransportInfo& info) {
  std::vector<std::string> keys = info.options;
  keys.insert(keys.end(), p2p_option_keys().begin(), p2p_option_keys().end());
  return keys;
}

P2POptions take_p2p_options(const std::string& backend, Options& options) {
  P2POptions out;
  if (auto it = options.find("shm"); it != options.end()) {
    if (it->second != "on" && it->second != "off") throw std::invalid_argument(backend + ": option shm='" + it->second + "' must be on or off");
    out.shm = it->second == "on";
    options.erase(it);
  }
  for (const char* key : {"chunk_bytes", "direct_max_bytes", "shm_chunk_bytes"}) {
    auto it = options.find(key);
    if (it == options.end()) continue;
    const std::string& value = it->second;
    const std::string k = key;
    const std::uint64_t least = k == "direct_max_bytes" ? 0 : 64;
    const bool shm_chunk = k == "shm_chunk_bytes";
    std::uint64_t bytes = 0;
    bool ok = !value.empty() && value.find_first_of("-+ ") == std::string::npos;
    try {
      if (ok) bytes = spmdx::parse_bytes(value);
    } catch (const std::exception&) {
      ok = false;
    }
    if (!ok || bytes < least || bytes > (shm_chunk ? std::uint64_t{64} << 20 : std::uint64_t{1} << 40)) {
      throw std::invalid_argument(backend + ": option " + k + "='" + value + "' must be a size in bytes from " + std::to_string(least) +
                                  (shm_chunk ? " to 64M" : " to 1024G") + " (examples: 262144, 256K, 4M)");
    }
    (k == "chunk_bytes" ? out.chunk_bytes : k == "direct_max_bytes" ? out.direct_max_bytes : out.shm_chunk_bytes) = static_cast<std::size_t>(bytes);
    options.erase(it);
  }
  return out;
}

CommBackendFactory p2p_backend_factory(std::string name, TransportInfo info) {
  return [name = std::move(name), info = std::move(info)](const Options& given) -> std::unique_ptr<CommBackend> {
    Options options = given;
    const P2POptions p2p = take_p2p_options(name, options);
    for (const auto& [key, value] : options) {
      if (std::find(info.options.begin(), info.options.end(), key) != info.options.end()) continue;
      throw std::invalid_argument(name + ": unknown option '" + key + "' (known: " + join(transport_backend_options(info)) + ")");
    }
    std::unique_ptr<Transport> transport = info.factory(options);
    if (!transport) throw std::runtime_error(name + ": the plugin's transport factory returned no transport; fix the plugin");
    return make_p2p_backend(name, std::move(transport), p2p);
  };
}

}  // namespace spmdx::comm
