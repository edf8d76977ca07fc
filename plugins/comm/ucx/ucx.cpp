// ucx: a transport over UCX's UCP tag-matching API (Shamis et al. 2015), host memory; the
// host's collective engine (ring, all-pairs, tree and shared-memory collectives) runs on top.
// Each rank makes one UCP worker, publishes its address in the store, and connects an endpoint
// to every other rank. Transports come from UCX_TLS, or the plugin option "tls"; with neither,
// ranks that all share one host use shared memory ("shm,self": plain posix alone is slow here),
// others UCX's default (TCP across hosts). The engine's options (chunk_bytes, direct_max_bytes,
// shm, shm_chunk_bytes) are given the same way; see `spmdx plugins ucx`.
#include <spmdx/core/log.h>
#include <spmdx/plugin.h>
#include <spmdx/transport.h>
#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>
#include <unordered_map>

namespace {

using spmdx::CommError;

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// Whether UCX on this machine can make a context with UCX_TLS=tls: local only (no peer, no
// store), quiet (UCX would log its refusal as an error).
bool tls_usable(const std::string& tls) {
  char level[64] = "";
  const bool saved = ucs_global_opts_get_value("LOG_LEVEL", level, sizeof level) == UCS_OK;
  ucs_global_opts_set_value("LOG_LEVEL", "fatal");
  ucp_config_t* config = nullptr;
  bool ok = ucp_config_read(nullptr, nullptr, &config) == UCS_OK && ucp_config_modify(config, "TLS", tls.c_str()) == UCS_OK;
  if (ok) {
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_TAG;
    ucp_context_h context = nullptr;
    ok = ucp_init(&params, config, &context) == UCS_OK;
    if (ok) ucp_cleanup(context);
  }
  if (config != nullptr) ucp_config_release(config);
  if (saved) ucs_global_opts_set_value("LOG_LEVEL", level);
  return ok;
}

// The "tls" option, checked without joining any job: every transport it names must exist
// here (UCX alone would only warn about a missing one next to others, or fail at init).
void check_tls(const std::string& tls) {
  // "^a,b" excludes: what is left is every transport here but those (shm also names posix, sysv).
  const bool excluding = tls.rfind('^', 0) == 0;
  std::vector<std::string> listed, missing;
  std::stringstream names(excluding ? tls.substr(1) : tls);
  for (std::string name; std::getline(names, name, ',');) listed.push_back(name);
  for (const auto& name : listed) {
    if (!name.empty() && name != "all" && !tls_usable(name)) missing.push_back(name);
  }
  // The ranks are processes: at least one transport between processes (shared memory on a
  // host, a network across hosts). self (within a process) and cma (a zero-copy helper that
  // needs another transport to set up) are not.
  if (missing.empty()) {
    auto between_processes = [](const std::string& t) {
      return t != "self" && t != "cma" && t != "knem" && t != "xpmem" && t.rfind("cuda", 0) != 0 && t.rfind("rocm", 0) != 0 && t != "gdr_copy";
    };
    std::vector<std::string> left;
    if (excluding) {
      auto excluded = [&](const std::string& t) {
        for (const auto& x : listed) {
          if (x == t || x == "all" || (x == "shm" && (t == "posix" || t == "sysv" || t == "cma")) || (x == "sm" && (t == "posix" || t == "sysv"))) return true;
        }
        return false;
      };
      for (const char* t : {"tcp", "shm", "posix", "sysv", "rc", "ud", "dc", "self", "cma"}) {
        if (!excluded(t) && tls_usable(t)) left.push_back(t);
      }
    } else {
      left = listed;
    }
    if (std::none_of(left.begin(), left.end(), [&](const std::string& t) { return t == "all" || between_processes(t); })) {
      throw std::invalid_argument("ucx: tls=" + tls + " names no transport between rank processes: add shm for ranks on one host, tcp across hosts "
                                  "(e.g. tls=shm,self or tls=tcp,self)");
    }
  }
  if (missing.empty() && tls_usable(tls)) return;
  std::string have, list;
  for (const char* t : {"self", "tcp", "shm", "posix", "sysv", "cma", "knem", "xpmem", "rc", "ud", "dc", "cuda_copy", "cuda_ipc", "gdr_copy", "rocm_copy"}) {
    if (tls_usable(t)) have += (have.empty() ? "" : ", ") + std::string(t);
  }
  for (const auto& m : missing) list += (list.empty() ? "" : ", ") + m;
  throw std::invalid_argument("ucx: tls=" + tls + ": " + (missing.empty() ? std::string("UCX finds no usable transport in it") : "UCX here has no transport " + list) +
                              " (it has: " + have + ")");
}

class UcxTransport final : public spmdx::Transport {
 public:
  explicit UcxTransport(const spmdx::Options& options) {
    if (auto it = options.find("tls"); it != options.end()) {
      check_tls(it->second);
      tls_ = it->second;
    }
  }

  void connect(const spmdx::CommInit& init) override {
    if (init.store == nullptr) throw std::invalid_argument("ucx: init needs a store");
    rank_ = init.rank;
    std::string tls = tls_;
    if (tls.empty() && std::getenv("UCX_TLS") == nullptr) {
      const std::string local = env_or("LOCAL_WORLD_SIZE", std::to_string(init.world_size));
      if (local == std::to_string(init.world_size)) tls = "shm,self";  // every rank on this host
    }
    tls_used_ = tls.empty() ? env_or("UCX_TLS", "ucx default") : tls;
    ucp_config_t* config = nullptr;
    check(ucp_config_read(nullptr, nullptr, &config), "read config");
    if (!tls.empty()) check(ucp_config_modify(config, "TLS", tls.c_str()), "set TLS=" + tls);
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_TAG;
    const ucs_status_t st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    check(st, "init");
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the backend's communication thread uses it
    check(ucp_worker_create(context_, &wp, &worker_), "create worker");

    ucp_address_t* address = nullptr;
    std::size_t length = 0;
    check(ucp_worker_get_address(worker_, &address, &length), "get worker address");
    const std::string prefix = "spmdx/ucx/g" + std::to_string(init.generation) + "/addr/";
    init.store->set(prefix + std::to_string(init.rank), std::string(reinterpret_cast<const char*>(address), length));
    ucp_worker_release_address(worker_, address);

    eps_.assign(static_cast<std::size_t>(init.world_size), nullptr);
    for (int peer = 0; peer < init.world_size; ++peer) {
      std::string remote;
      try {
        remote = init.store->get(prefix + std::to_string(peer), init.timeout_seconds);
      } catch (const CommError& e) {
        if (e.peer() != -1) throw;  // the store itself is gone
        throw CommError("ucx: rank " + std::to_string(peer) + " did not publish its UCX address within " + std::to_string(static_cast<int>(init.timeout_seconds)) +
                            " s: it stopped or died after the rendezvous (or is stuck before its comm backend starts)",
                        peer);
      }
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
      ep.address = reinterpret_cast<const ucp_address_t*>(remote.data());
      ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;  // PEER: UCX 1.13 has no shared-memory transport with peer failure handling
      const ucs_status_t s = ucp_ep_create(worker_, &ep, &eps_[static_cast<std::size_t>(peer)]);
      if (s != UCS_OK) throw CommError("ucx: rank " + std::to_string(rank_) + " cannot reach rank " + std::to_string(peer) + ": " + ucs_status_string(s), peer);
    }
    SPMDX_DEBUG("ucx: rank " << init.rank << "/" << init.world_size << " up, UCX_TLS=" << tls_used_);
  }

  std::string describe() const override {
    if (!tls_used_.empty()) return "UCX_TLS=" + tls_used_;
    return "UCX_TLS=" + (tls_.empty() ? env_or("UCX_TLS", "chosen at connect") : tls_);
  }

  std::vector<spmdx::CommCapability> capabilities() const override {
    return {{"*", spmdx::MemoryType::host, 0, static_cast<std::size_t>(-1), 10}};
  }

  ~UcxTransport() override {
    for (auto* ep : eps_) {
      if (ep == nullptr) continue;
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;  // peers may already be gone; do not wait for them
      void* r = ucp_ep_close_nbx(ep, &p);
      if (UCS_PTR_IS_PTR(r)) {
        while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(worker_);
        ucp_request_free(r);
      }
    }
    if (worker_) ucp_worker_destroy(worker_);
    if (context_) ucp_cleanup(context_);
  }

  std::uint64_t isend(int peer, const void* data, std::size_t bytes, std::uint64_t tag) override {
    ucp_request_param_t p{};
    return track(ucp_tag_send_nbx(eps_.at(static_cast<std::size_t>(peer)), data, bytes, tag, &p), peer, "send");
  }

  std::uint64_t irecv(int peer, void* data, std::size_t bytes, std::uint64_t tag) override {
    ucp_request_param_t p{};
    return track(ucp_tag_recv_nbx(worker_, data, bytes, tag, ~std::uint64_t{0}, &p), peer, "receive");
  }

  bool test(std::uint64_t id) override {
    ucp_worker_progress(worker_);
    auto it = requests_.find(id);
    if (it == requests_.end()) return true;  // completed when posted
    const ucs_status_t s = ucp_request_check_status(it->second.request);
    if (s == UCS_INPROGRESS) return false;
    ucp_request_free(it->second.request);
    const int peer = it->second.peer;
    requests_.erase(it);
    if (s != UCS_OK) throw CommError(std::string("ucx: ") + ucs_status_string(s), peer);
    return true;
  }

 private:
  struct Pending {
    void* request;
    int peer;
  };

  std::uint64_t track(void* r, int peer, const char* what) {
    if (r == nullptr) return 0;  // done at once
    if (UCS_PTR_IS_ERR(r)) {
      throw CommError(std::string("ucx: ") + what + " with rank " + std::to_string(peer) + " failed: " +
                          ucs_status_string(UCS_PTR_STATUS(r)), peer);
    }
    const std::uint64_t id = ++next_;
    requests_[id] = {r, peer};
    return id;
  }

  void check(ucs_status_t s, const std::string& what) {
    if (s != UCS_OK) throw CommError("ucx (rank " + std::to_string(rank_) + "): cannot " + what + ": " + ucs_status_string(s), -1);
  }

  std::string tls_;       // the option, or "" (UCX_TLS or chosen at connect)
  std::string tls_used_;  // what connect() gave UCX
  int rank_ = 0;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<ucp_ep_h> eps_;
  std::unordered_map<std::uint64_t, Pending> requests_;
  std::uint64_t next_ = 0;
};

void register_ucx(spmdx::Registrar& r) {
  r.add_transport("ucx", {{"tls"}, [](const spmdx::Options& options) { return std::make_unique<UcxTransport>(options); }});
}

}  // namespace

SPMDX_PLUGIN("ucx", comm, "0.2.0", "UCX (UCP tag matching) under the host's ring, all-pairs, tree and shared-memory collectives; host memory, shm or TCP", register_ucx)
