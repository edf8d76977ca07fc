#include "spmdx/job/fault_tolerance.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "spmdx/comm/store.h"
#include "spmdx/comm/then_work.h"
#include "spmdx/core/log.h"
#include "spmdx/exec/distributed.h"
#include "spmdx/job/comm_chain.h"
#include "spmdx/text.h"

namespace spmdx::job {
namespace ft = launch::ft;
using Clock = std::chrono::steady_clock;

namespace {

// Store generations of fault tolerance's joins: above comm.fallback's (2^36 + n), below
// "auto"'s members ((i + 1) 2^40 + generation).
constexpr std::int64_t kFtGeneration = std::int64_t{1} << 38;
// Added to a vote's count by the rank that closes it early (a group lost): votes after it
// see a count this large and know the vote closed without them.
constexpr std::int64_t kClosed = std::int64_t{1} << 32;
constexpr const char* kCommittedKey = "spmdx/ft/committed";  // the newest step committed (SPMDX_FAULT hold at=restart reads it)

std::string config_key(std::int64_t id) { return "spmdx/ft/config/" + std::to_string(id); }
// Counts SPMDX_FAULT's fault `id` acted out: once a job (act, unfired_faults).
std::string fired_key(int id) { return "spmdx/ft/fired/" + std::to_string(id); }

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::vector<int> groups_of(const std::vector<ft::GroupAttempt>& g) {
  std::vector<int> out;
  for (const auto& x : g) out.push_back(x.group);
  return out;
}

std::string group_list_text(const std::vector<int>& groups) {
  std::string out = groups.size() == 1 ? "replica group " : "replica groups ";
  for (std::size_t i = 0; i < groups.size(); ++i) out += (i == 0 ? "" : i + 1 == groups.size() ? " and " : ", ") + std::to_string(groups[i]);
  return out;
}

nlohmann::json progress_json(const FtProgress& p) {
  return {{"next_step", p.next_step}, {"optimizer_steps", p.optimizer_steps}, {"samples", p.samples}, {"loss_scale", p.loss_scale},
          {"growth_tracker", p.growth_tracker}};
}

// A sum over a shrunken replica slice, scaled by members / live members: `buf` once the call
// completes (floating dtypes; the counts of an integer buffer are left as they are).
void scale(const CommBuffer& buf, double by) {
  if (buf.dtype != CommDType::f32 && buf.dtype != CommDType::f64 && buf.dtype != CommDType::bf16 && buf.dtype != CommDType::f16) return;  // counts
  const at::ScalarType type = buf.dtype == CommDType::f64 ? at::kDouble : buf.dtype == CommDType::bf16 ? at::kBFloat16
                              : buf.dtype == CommDType::f16   ? at::kHalf   : at::kFloat;
  at::from_blob(buf.data, {static_cast<std::int64_t>(buf.count)}, at::TensorOptions().dtype(type)).mul_(by);
}

}  // namespace

// ---- FtConfig -------------------------------------------------------------------------------

std::string FtConfig::to_json() const {
  return nlohmann::json{{"id", id}, {"epoch", epoch}, {"groups", ft::members_text(groups)}, {"joiners", ft::members_text(joiners)},
                        {"progress", progress_json(progress)}}
      .dump();
}

FtConfig FtConfig::from_json(const std::string& text) {
  const auto j = nlohmann::json::parse(text);
  FtConfig c;
  c.id = j.at("id").get<std::int64_t>();
  c.epoch = j.at("epoch").get<std::int64_t>();
  c.groups = ft::parse_members(j.at("groups").get<std::string>());
  c.joiners = ft::parse_members(j.at("joiners").get<std::string>());
  const auto& p = j.at("progress");
  c.progress = {p.at("next_step").get<std::int64_t>(), p.at("optimizer_steps").get<std::int64_t>(), p.at("samples").get<std::uint64_t>(),
                p.at("loss_scale").get<double>(), p.at("growth_tracker").get<std::int64_t>()};
  return c;
}

bool FtConfig::has(int group) const {
  return std::any_of(groups.begin(), groups.end(), [&](const ft::GroupAttempt& g) { return g.group == group; });
}

// ---- LiveBackend ----------------------------------------------------------------------------

LiveBackend::LiveBackend(std::unique_ptr<CommBackend> inner, std::vector<int> live, int rank, std::string what, const std::vector<ProcessFault>* faults,
                         std::function<void(const ProcessFault&)> act)
    : inner_(std::move(inner)), live_(std::move(live)), rank_(rank), what_(std::move(what)), faults_(faults), act_(std::move(act)) {
  groups_[0] = GroupInfo{live_, {}, 1};  // the inner backend's own world
  for (std::size_t i = 0; i < live_.size(); ++i) groups_[0].live.push_back(static_cast<int>(i));
}

void LiveBackend::init(const CommInit&) { throw std::logic_error("LiveBackend: joined over the live ranks already (FaultTolerance::join)"); }

int LiveBackend::new_group(const std::vector<int>& ranks) {
  GroupInfo g;
  g.ranks = ranks;
  std::vector<int> inner_ranks;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const auto at = std::lower_bound(live_.begin(), live_.end(), ranks[i]);
    if (at == live_.end() || *at != ranks[i]) continue;
    g.live.push_back(static_cast<int>(i));
    inner_ranks.push_back(static_cast<int>(at - live_.begin()));
  }
  g.scale = static_cast<double>(ranks.size()) / static_cast<double>(std::max<std::size_t>(1, g.live.size()));
  const int id = inner_->new_group(inner_ranks);
  groups_[id] = std::move(g);
  return id;
}

const LiveBackend::GroupInfo& LiveBackend::info(int group, const char* op) const {
  const auto it = groups_.find(group);
  if (it == groups_.end()) throw std::invalid_argument(std::string(op) + ": unknown group " + std::to_string(group));
  return it->second;
}

void LiveBackend::tick() {
  if (faults_ == nullptr) return;
  if (const ProcessFault* f = due_fault(*faults_, rank_, step_, "collective", calls_); f != nullptr) act_(*f);
  ++calls_;
}

int LiveBackend::member(int peer_rank, const char* op) const {
  const auto at = std::lower_bound(live_.begin(), live_.end(), peer_rank);
  if (at == live_.end() || *at != peer_rank) {
    throw CommError(std::string(op) + ": rank " + std::to_string(peer_rank) + " is in a replica group that was lost", peer_rank);
  }
  return static_cast<int>(at - live_.begin());
}

std::unique_ptr<Work> LiveBackend::all_reduce(int group, CommBuffer buf, ReduceOp op) {
  tick();
  const GroupInfo& g = info(group, "all_reduce");
  auto work = inner_->all_reduce(group, buf, op);
  if (op == ReduceOp::sum && g.scale != 1) return std::make_unique<comm::ThenWork>(std::move(work), [buf, by = g.scale] { scale(buf, by); });
  return work;
}

std::unique_ptr<Work> LiveBackend::all_gather(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts) {
  tick();
  const GroupInfo& g = info(group, "all_gather");
  if (g.live.size() != g.ranks.size()) {
    throw std::invalid_argument("fault tolerance: an all_gather over the replica groups (ranks " + rank_list(g.ranks) + ") while some are lost: "
                                "the plan gathers over dp_replicate, which spmdx's fault tolerance does not support yet");
  }
  return inner_->all_gather(group, in, out, std::move(counts));
}

std::unique_ptr<Work> LiveBackend::reduce_scatter(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts, ReduceOp op) {
  tick();
  const GroupInfo& g = info(group, "reduce_scatter");
  if (g.live.size() != g.ranks.size()) {
    throw std::invalid_argument("fault tolerance: a reduce_scatter over the replica groups (ranks " + rank_list(g.ranks) + ") while some are lost "
                                "is not supported yet");
  }
  return inner_->reduce_scatter(group, in, out, std::move(counts), op);
}

std::unique_ptr<Work> LiveBackend::all_to_all(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts, std::vector<std::size_t> recv_counts) {
  tick();
  const GroupInfo& g = info(group, "all_to_all");
  if (g.live.size() != g.ranks.size()) {
    throw std::invalid_argument("fault tolerance: an all_to_all over the replica groups (ranks " + rank_list(g.ranks) + ") while some are lost is not supported yet");
  }
  return inner_->all_to_all(group, in, out, std::move(send_counts), std::move(recv_counts));
}

std::unique_ptr<Work> LiveBackend::broadcast(int group, CommBuffer buf, int root_member) {
  tick();
  const GroupInfo& g = info(group, "broadcast");
  const auto at = std::find(g.live.begin(), g.live.end(), root_member);
  if (at == g.live.end()) {
    throw std::invalid_argument("fault tolerance: a broadcast from rank " + std::to_string(g.ranks.at(static_cast<std::size_t>(root_member))) +
                                ", whose replica group is lost");
  }
  return inner_->broadcast(group, buf, static_cast<int>(at - g.live.begin()));
}

std::unique_ptr<Work> LiveBackend::send(CommBuffer buf, int peer_rank, int tag) {
  tick();
  return inner_->send(buf, member(peer_rank, "send"), tag);
}

std::unique_ptr<Work> LiveBackend::recv(CommBuffer buf, int peer_rank, int tag) {
  tick();
  return inner_->recv(buf, member(peer_rank, "recv"), tag);
}

std::unique_ptr<Work> LiveBackend::barrier(int group) {
  (void)info(group, "barrier");
  return inner_->barrier(group);
}

std::unique_ptr<Work> LiveBackend::all_to_all_v(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts, std::size_t* recv_counts) {
  tick();
  const GroupInfo& g = info(group, "all_to_all_v");
  auto* v = dynamic_cast<VariableAllToAll*>(inner_.get());
  if (v == nullptr) throw std::invalid_argument("all_to_all_v: comm backend " + inner_->describe() + " has no all_to_all_v (rebuild its plugin for ABI 4.1)");
  if (g.live.size() != g.ranks.size()) {
    throw std::invalid_argument("fault tolerance: an all_to_all_v over the replica groups (ranks " + rank_list(g.ranks) + ") while some are lost is not supported yet");
  }
  return v->all_to_all_v(group, in, out, std::move(send_counts), recv_counts);
}

// ---- FaultTolerance -------------------------------------------------------------------------

FaultTolerance::FaultTolerance(const JobSpec& spec, const launch::RankEnv& env, Store& store, PluginRegistry& registry, std::vector<ProcessFault> faults)
    : spec_(spec), env_(env), store_(store), registry_(registry), faults_(std::move(faults)) {
  const auto& f = spec.fault_tolerance;
  groups_ = static_cast<int>(f.groups);
  ranks_per_group_ = static_cast<int>(f.ranks_per_group);
  group_ = env.rank / ranks_per_group_;
  timeout_ = f.timeout_seconds;
  // Only SPMDX_FAULT's hold at=restart reads the newest committed step: no store round trips a
  // step otherwise (every rank has the same faults: restarted ones inherit SPMDX_FAULT).
  publish_committed_ = std::any_of(faults_.begin(), faults_.end(), [](const ProcessFault& p) { return p.kind == "hold" && p.at == "restart"; });
  if (const char* a = std::getenv(ft::kRestartEnv); a != nullptr && *a != '\0') attempt_ = std::atoi(a);
  if (env.source != "spmdx" || !env.store_hosted) {
    throw std::invalid_argument("fault_tolerance.enable = true needs spmdx run's launcher (spmdx run --nproc N, with --max-restarts for restarts): it "
                                "watches the replica groups and restarts a lost one; under " + env.source +
                                " a failed rank stops the job (torchrun restarts every rank); set fault_tolerance.enable = false there");
  }
  watch_store_ = std::make_unique<comm::TcpStore>(env.master_addr, env.master_port, env.token, std::max(30.0, timeout_), env.rank);
  thread_ = std::thread([this] { watcher(); });
}

FaultTolerance::~FaultTolerance() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

int FaultTolerance::lead() const { return config_.groups.front().group * ranks_per_group_; }

std::vector<int> FaultTolerance::live_ranks() const {
  std::vector<int> out;
  for (const auto& g : config_.groups) {
    for (int i = 0; i < ranks_per_group_; ++i) out.push_back(g.group * ranks_per_group_ + i);
  }
  return out;
}

bool FaultTolerance::lost_from(const ft::Membership& m) const {
  return std::any_of(config_.groups.begin(), config_.groups.end(),
                     [&](const ft::GroupAttempt& g) { return std::find(m.groups.begin(), m.groups.end(), g) == m.groups.end(); });
}

void FaultTolerance::watcher() {
  std::int64_t seen = -1;
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    cv_.wait_for(lock, std::chrono::milliseconds(100));
    if (stopping_) break;
    const auto guarded = guarded_;
    lock.unlock();
    bool lost = false;
    try {
      const std::int64_t epoch = watch_store_->add(ft::kEpochKey, 0);
      if (epoch != seen) {
        const auto now = ft::parse_members(watch_store_->get(ft::members_key(epoch), 5));
        lost = std::any_of(guarded.begin(), guarded.end(), [&](const ft::GroupAttempt& g) { return std::find(now.begin(), now.end(), g) == now.end(); });
        seen = epoch;
      }
    } catch (const std::exception&) {
      // the store is gone: the launcher ended, and this rank with it
    }
    lock.lock();
    // A group of this configuration is lost: fail the collectives in flight now, rather than
    // each waiting out its timeout on a dead peer (the step is dropped by the vote).
    if (lost && watched_ != nullptr) watched_->abort();
  }
}

void FaultTolerance::watch(CommBackend* backend) {
  std::lock_guard lock(mutex_);
  watched_ = backend;
  guarded_ = config_.groups;
}

std::optional<FtConfig> FaultTolerance::start(const FtProgress& progress) {
  if (!restarted()) {
    config_ = {};
    for (int g = 0; g < groups_; ++g) config_.groups.push_back({g, 0});
    config_.progress = progress;
    return config_;
  }
  const ft::GroupAttempt me{group_, attempt_};
  store_.add(ft::ready_key(me), 1);
  const auto t0 = Clock::now();
  double said = 0;
  for (;;) {
    try {
      adopt(std::stoll(store_.get(ft::adopted_key(me), 0.5)));
      return config_;
    } catch (const CommError&) {
    }
    if (store_.add(ft::kFinishedKey, 0) > 0) return std::nullopt;
    if (store_.add(ft::kStopKey, 0) > 0) throw std::runtime_error("fault tolerance: the job stops: " + store_.get(ft::kStopWhyKey, 30));
    if (const double waited = seconds_since(t0); waited - said >= 30) {
      said = waited;
      std::printf("%s (restart %d) is ready and waits for the live groups to take it in at their next step (%.0f s so far)\n",
                  ft::group_text(group_, ranks_per_group_).c_str(), attempt_, waited);
      std::fflush(stdout);
    }
  }
}

void FaultTolerance::adopt(std::int64_t id) {
  FtConfig c = FtConfig::from_json(store_.get(config_key(id), std::max(30.0, timeout_)));
  const ft::GroupAttempt me{group_, attempt_};
  if (std::find(c.groups.begin(), c.groups.end(), me) == c.groups.end()) {
    throw std::runtime_error("fault tolerance: " + ft::group_text(group_, ranks_per_group_) + " was dropped from the job (configuration " +
                             std::to_string(id) + " holds " + ft::members_text(c.groups) + "): the launcher restarts it if --max-restarts allows");
  }
  config_ = std::move(c);
}

std::unique_ptr<LiveBackend> FaultTolerance::join() {
  const std::vector<int> live = live_ranks();
  launch::RankEnv env = env_;
  env.rank = static_cast<int>(std::find(live.begin(), live.end(), env_.rank) - live.begin());
  env.world_size = static_cast<int>(live.size());
  CommSpec comm = spec_.comm;
  comm.timeout_seconds = timeout_;
  auto inner = join_backend(registry_, comm.backend, comm, env, store_, kFtGeneration + config_.id);
  const std::string what = all_live() ? "all " + std::to_string(groups_) + " replica groups live"
                                      : std::to_string(config_.groups.size()) + " of " + std::to_string(groups_) + " replica groups live (" +
                                            ft::members_text(config_.groups) + ")";
  // The first ranks count themselves in: once all have, a rank that dies costs its group only.
  if (config_.id == 0) store_.add(ft::kStartedKey, 1);
  return std::make_unique<LiveBackend>(std::move(inner), live, env_.rank, what, &faults_, [this](const ProcessFault& f) { act(f); });
}

void FaultTolerance::transfer(CommBackend& backend, exec::TensorMap& state, const std::vector<std::string>& names, std::int64_t after_step) {
  if (config_.joiners.empty()) return;
  const auto joining = [&](int g) {
    return std::any_of(config_.joiners.begin(), config_.joiners.end(), [&](const ft::GroupAttempt& j) { return j.group == g; });
  };
  int source = -1;
  for (const auto& g : config_.groups) {
    if (!joining(g.group)) {
      source = g.group;
      break;
    }
  }
  if (source < 0) throw std::runtime_error("fault tolerance: configuration " + std::to_string(config_.id) + " has no group to give the state");
  const int coordinate = env_.rank % ranks_per_group_;
  std::vector<int> members{source * ranks_per_group_ + coordinate};
  for (const auto& j : config_.joiners) members.push_back(j.group * ranks_per_group_ + coordinate);
  std::sort(members.begin(), members.end());
  if (std::find(members.begin(), members.end(), env_.rank) == members.end()) return;  // another live group: it has the state
  const int root = static_cast<int>(std::find(members.begin(), members.end(), source * ranks_per_group_ + coordinate) - members.begin());
  const int id = backend.new_group(members);
  std::vector<std::unique_ptr<Work>> works;
  double bytes = 0;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (const ProcessFault* f = due_fault(faults_, env_.rank, after_step, "recovery", static_cast<std::int64_t>(i)); f != nullptr) {
      for (auto& w : works) w->wait(timeout_);  // what was sent so far arrives
      act(*f);
    }
    at::Tensor& t = state.at(names[i]);
    if (!t.is_contiguous()) t = t.contiguous();
    bytes += static_cast<double>(t.nbytes());
    works.push_back(backend.broadcast(id, CommBuffer{t.data_ptr(), static_cast<std::size_t>(t.numel()), exec::comm_dtype(t.scalar_type())}, root));
  }
  const double limit = timeout_ + bytes / 1e8;  // at least 100 MB/s
  for (std::size_t i = 0; i < works.size(); ++i) {
    if (!works[i]->wait(limit)) {
      backend.abort();
      throw CommError("fault tolerance: the state transfer to " + group_list_text(groups_of(config_.joiners)) + " did not finish '" + names[i] +
                          "' within " + seconds_text(limit) + " s (fault_tolerance.process_group_timeout_ms, plus the bytes at 100 MB/s)",
                      -1);
    }
  }
}

FtDecision FaultTolerance::vote_step(std::int64_t step, bool last, const std::string& why_not, const FtProgress& committed, const FtProgress& aborted) {
  return vote("spmdx/ft/c" + std::to_string(config_.id) + "/s" + std::to_string(step), false, last, why_not, committed, aborted);
}

FtDecision FaultTolerance::vote_join(const std::string& why_not) {
  return vote("spmdx/ft/c" + std::to_string(config_.id) + "/join", true, false, why_not, config_.progress, config_.progress);
}

FtDecision FaultTolerance::vote(const std::string& key, bool join, bool last, const std::string& why_not, const FtProgress& committed, const FtProgress& aborted) {
  const std::vector<int> live = live_ranks();
  const auto n = static_cast<std::int64_t>(live.size());
  if (!why_not.empty() && store_.add(key + "/no", 1) == 1) store_.set(key + "/why", "rank " + std::to_string(env_.rank) + ": " + why_not);
  store_.add(key + "/r" + std::to_string(env_.rank), 1);  // who voted, to name who did not
  const std::int64_t counted = store_.add(key + "/count", 1);
  if (counted == n && store_.add(key + "/decider", 1) == 1) decide(key, join, n, last, committed, aborted);
  const auto t0 = Clock::now();
  bool suspected = false;
  for (;;) {
    try {
      const auto j = nlohmann::json::parse(store_.get(key + "/all", 0.2));
      return FtDecision{j.at("commit").get<bool>(), j.at("stop").get<bool>(), j.at("config").get<std::int64_t>(), j.at("why").get<std::string>()};
    } catch (const CommError&) {
    }
    // A group of this configuration is lost: close the vote; the votes counted so far decide.
    if (lost_from(ft::read_membership(store_, std::max(30.0, timeout_)))) {
      const std::int64_t closed = store_.add(key + "/count", kClosed);
      if (closed < 2 * kClosed && store_.add(key + "/decider", 1) == 1) decide(key, join, closed - kClosed, last, committed, aborted);
      continue;
    }
    const double waited = seconds_since(t0);
    if (!suspected && waited > 2 * timeout_) {
      // Ranks neither voting nor gone: hung (stopped, or stuck past every timeout). The
      // launcher stops them, and their group is lost.
      std::vector<int> silent;
      for (int r : live) {
        if (store_.add(key + "/r" + std::to_string(r), 0) == 0) silent.push_back(r);
      }
      if (!silent.empty()) {
        std::string list;
        for (int r : silent) list += (list.empty() ? "" : ",") + std::to_string(r);
        store_.set(ft::kSuspectKey, list);
        store_.add(ft::kSuspectCountKey, 1);
        SPMDX_WARN(rank_list(silent) << " did not vote on '" << key << "' within " << seconds_text(waited)
                                     << " s (2 x fault_tolerance.process_group_timeout_ms): asking the launcher to stop " << (silent.size() == 1 ? "it" : "them"));
      }
      suspected = true;
    }
    if (waited > 6 * timeout_ + 60) {
      throw CommError("fault tolerance: the vote '" + key + "' did not complete within " + seconds_text(waited) +
                          " s, though the launcher was asked to stop the ranks that did not vote; stopping",
                      -1);
    }
  }
}

FtDecision FaultTolerance::decide(const std::string& key, bool join, std::int64_t voted, bool last, const FtProgress& committed, const FtProgress& aborted) {
  const std::int64_t n = static_cast<std::int64_t>(config_.groups.size()) * ranks_per_group_;
  const std::int64_t no = store_.add(key + "/no", 0);
  const ft::Membership m = ft::read_membership(store_, std::max(30.0, timeout_));
  FtDecision d;
  d.commit = voted >= n && no == 0;
  d.config = config_.id;
  std::vector<int> lost;
  for (const auto& g : config_.groups) {
    if (std::find(m.groups.begin(), m.groups.end(), g) == m.groups.end()) lost.push_back(g.group);
  }
  if (d.commit && !join && publish_committed_) {  // the newest step committed (a counter: add the difference)
    const std::int64_t step = committed.next_step - 1;
    store_.add(kCommittedKey, step - store_.add(kCommittedKey, 0));
  }
  if (no > 0) d.why = store_.get(key + "/why", 30);
  else if (!d.commit) d.why = group_list_text(lost) + " lost before " + std::to_string(n - voted) + " of its ranks voted";
  if (last && d.commit) {
    store_.set(ft::kFinishedKey, "1");  // a group still restarting has nothing to join
  } else if (!d.commit || m.groups != config_.groups) {
    if (static_cast<std::int64_t>(m.groups.size()) < spec_.fault_tolerance.min_replicas) {
      d.stop = true;
      std::vector<int> missing;
      for (int g = 0; g < groups_; ++g) {
        if (std::none_of(m.groups.begin(), m.groups.end(), [&](const ft::GroupAttempt& x) { return x.group == g; })) missing.push_back(g);
      }
      d.why = "only " + std::to_string(m.groups.size()) + " of " + std::to_string(groups_) + " replica groups are live (" + group_list_text(missing) +
              " lost), fewer than fault_tolerance.min_replica_size = " + std::to_string(spec_.fault_tolerance.min_replicas);
      stop_job(d.why);
    } else {
      FtConfig next;
      next.id = store_.add("spmdx/ft/configs", 1);
      next.epoch = m.epoch;
      next.groups = m.groups;
      // Joining: the groups new to the membership, and after a move that failed, those it was
      // moving the state to (what they hold is not the live groups' state).
      for (const auto& g : m.groups) {
        const bool had = std::find(config_.groups.begin(), config_.groups.end(), g) != config_.groups.end();
        const bool was_joining = std::find(config_.joiners.begin(), config_.joiners.end(), g) != config_.joiners.end();
        if (!had || (join && !d.commit && was_joining)) next.joiners.push_back(g);
      }
      next.progress = d.commit ? committed : aborted;
      if (next.joiners.size() == next.groups.size()) {  // nobody left who holds the state
        d.stop = true;
        d.why = "every live replica group is one being given the state (" + ft::members_text(next.groups) +
                "): the groups that held it were lost during the move, and no checkpoint is read";
        stop_job(d.why);
        store_.set(key + "/all", nlohmann::json{{"commit", false}, {"stop", true}, {"config", config_.id}, {"why", d.why}}.dump());
        return d;
      }
      store_.set(config_key(next.id), next.to_json());
      for (const auto& j : next.joiners) store_.set(ft::adopted_key(j), std::to_string(next.id));
      d.config = next.id;
    }
  }
  store_.set(key + "/all", nlohmann::json{{"commit", d.commit}, {"stop", d.stop}, {"config", d.config}, {"why", d.why}}.dump());
  return d;
}

void FaultTolerance::hold_until_all_live(double max_seconds) {
  const auto t0 = Clock::now();
  while (static_cast<int>(ft::read_membership(store_, std::max(30.0, timeout_)).groups.size()) < groups_) {
    if (store_.add(ft::kLostForGoodKey, 0) > 0) {
      SPMDX_WARN("SPMDX_FAULT hold: a replica group is lost with no restart left (--max-restarts): not every group will be live again; going on");
      return;
    }
    if (seconds_since(t0) > max_seconds) {
      throw std::runtime_error("SPMDX_FAULT hold: the replica groups were not all live again within " + seconds_text(max_seconds) + " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

void FaultTolerance::act(const ProcessFault& fault) {
  // Once a job: a restarted rank, which inherits SPMDX_FAULT, may reach the same step again.
  if (store_.add(fired_key(fault.id), 1) != 1) return;
  if (fault.kind != "hold") return fire(fault);
  if (fault.at == "restart") {
    std::fprintf(stderr, "SPMDX_FAULT: rank %d, restarted, holds until the live groups have committed step %lld\n", fault.rank,
                 static_cast<long long>(fault.step));
    const auto t0 = Clock::now();
    while (store_.add(kCommittedKey, 0) < fault.step && store_.add(ft::kFinishedKey, 0) == 0) {
      if (seconds_since(t0) > 600) throw std::runtime_error("SPMDX_FAULT hold at=restart: step " + std::to_string(fault.step) + " was not committed within 600 s");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return;
  }
  std::fprintf(stderr, "SPMDX_FAULT: rank %d holds at %s of step %lld until every replica group is live\n", fault.rank, fault.at.c_str(),
               static_cast<long long>(fault.step));
  hold_until_all_live(600);
}

std::string FaultTolerance::digest(const exec::TensorMap& state, const std::vector<std::string>& names) {
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& name : names) {
    const at::Tensor t = state.at(name).to(at::kCPU).contiguous();
    const auto* p = static_cast<const unsigned char*>(t.data_ptr());
    for (std::size_t i = 0, e = static_cast<std::size_t>(t.nbytes()); i < e; ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

void FaultTolerance::stop_job(const std::string& why) {
  store_.set(ft::kStopWhyKey, why);
  store_.add(ft::kStopKey, 1);
}

std::string FaultTolerance::unfired_faults() {
  std::string out;
  for (const auto& f : faults_) {
    if (f.factor > 0 || store_.add(fired_key(f.id), 0) != 0) continue;  // a slow factor is not fired once
    const std::string where = f.at == "collective" ? "backend call " + std::to_string(f.index) + " of step " + std::to_string(f.step)
                              : f.at == "recovery"  ? "tensor " + std::to_string(f.index) + " of a state transfer after step " + std::to_string(f.step)
                              : f.at == "restart"   ? std::string("a restart of its group")
                                                    : f.at + " of step " + std::to_string(f.step);
    const std::string why = f.at == "collective" ? "a step's backend calls count from 0, and a step has few"
                            : f.at == "recovery" ? "a transfer happens only when a group rejoins, after the step it rejoins at: hold the giver "
                                                   "there (hold:rank=G,step=S,at=commit) and the joiner until then (hold:rank=R,step=S-1,at=restart)"
                            : f.at == "restart"  ? "its group was never restarted"
                                                 : "the rank never ran that step";
    out += (out.empty() ? "" : "\n") + std::string("SPMDX_FAULT: ") + f.kind + " of rank " + std::to_string(f.rank) + " at " + where +
           " never fired: that point never came on that rank (" + why + ")";
  }
  return out;
}

std::string FaultTolerance::check_replicas_equal(const std::string& my_digest, std::int64_t step) {
  const std::string prefix = "spmdx/ft/digest/c" + std::to_string(config_.id) + "/s" + std::to_string(step) + "/";
  store_.set(prefix + std::to_string(env_.rank), my_digest);
  if (env_.rank != lead()) return "";
  std::vector<std::string> mismatches;
  for (int c = 0; c < ranks_per_group_; ++c) {
    const int first = config_.groups.front().group * ranks_per_group_ + c;
    const std::string want = store_.get(prefix + std::to_string(first), std::max(30.0, timeout_));
    for (const auto& g : config_.groups) {
      const int r = g.group * ranks_per_group_ + c;
      if (const std::string got = store_.get(prefix + std::to_string(r), std::max(30.0, timeout_)); got != want) {
        mismatches.push_back("rank " + std::to_string(r) + " has " + got + ", rank " + std::to_string(first) + " " + want);
      }
    }
  }
  if (!mismatches.empty()) {
    throw std::runtime_error("fault tolerance: the replica groups' states differ after step " + std::to_string(step) + ": " + spmdx::join(mismatches) +
                             " (a bug: please report it with the run's output)");
  }
  const std::string digest = "state digest of rank " + std::to_string(lead()) + ": " + store_.get(prefix + std::to_string(lead()), 30);
  if (config_.groups.size() == 1) return "fault tolerance: one replica group is live after step " + std::to_string(step) + ", none to compare it with (" + digest + ")";
  return "fault tolerance: the " + std::to_string(config_.groups.size()) + " live replica groups hold bitwise-equal states after step " +
         std::to_string(step) + " (" + digest + ")";
}

}  // namespace spmdx::job
