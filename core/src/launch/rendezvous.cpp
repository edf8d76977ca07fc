#include "spmdx/launch/rendezvous.h"

#include <algorithm>
#include <cstdio>
#include <chrono>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "spmdx/comm/store.h"
#include "spmdx/core/log.h"
#include "spmdx/text.h"

namespace spmdx::launch {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string key(const std::string& what, int rank = -1) { return "spmdx/rdzv/" + what + (rank >= 0 ? "/" + std::to_string(rank) : ""); }

std::string settings_text(const std::map<std::string, std::string>& settings) {
  std::string out;
  for (const auto& [k, v] : settings) out += k + " = " + v + "\n";
  return out;
}

std::map<std::string, std::string> parse_settings(const std::string& text) {
  std::map<std::string, std::string> out;
  for (const auto& line : split_lines(text)) {
    const auto eq = line.find(" = ");
    if (eq != std::string::npos) out[line.substr(0, eq)] = line.substr(eq + 3);
  }
  return out;
}

// The value at `k`, or nullopt when it is not set within `wait` seconds (a store that is
// gone throws).
std::optional<std::string> try_get(Store& store, const std::string& k, double wait) {
  try {
    return store.get(k, wait);
  } catch (const CommError& e) {
    if (e.peer() != -1) throw;
    return std::nullopt;
  }
}

// "rank 1 has X, ranks 0, 2 have Y" for ranks grouped by what they have; the largest group last.
std::string who_has(std::map<std::string, std::vector<int>> by_value, const std::string& prefix) {
  std::vector<std::pair<std::string, std::vector<int>>> groups(by_value.begin(), by_value.end());
  // The fewest ranks first (the odd ones out); between groups of one size, the higher ranks
  // first, so that two ranks read "rank 1 has X, rank 0 has Y" for every key.
  std::stable_sort(groups.begin(), groups.end(), [](const auto& a, const auto& b) {
    return a.second.size() != b.second.size() ? a.second.size() < b.second.size() : a.second.front() > b.second.front();
  });
  std::string out;
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const auto& [value, ranks] = groups[i];
    out += (i == 0 ? "" : ", ") + rank_list(ranks) + (ranks.size() == 1 ? " has " : " have ") + (i == 0 ? prefix : "") + value;
  }
  return out;
}

// Rank 0's comparison of the identities of the ranks that joined so far (rank -> info); ""
// when they agree.
std::string compare(Store& store, const std::map<int, json>& infos) {
  std::vector<std::string> problems;
  auto group = [&](auto field) {
    std::map<std::string, std::vector<int>> by;
    for (const auto& [r, info] : infos) by[field(info)].push_back(r);
    return by;
  };
  if (auto by = group([](const json& i) { return i.at("world_size_from").get<std::string>() + "=" + std::to_string(i.at("world_size").get<int>()); });
      by.size() > 1) {
    problems.push_back("the world size differs: " + who_has(by, "") + " (every rank must be started with the same world size)");
  }
  if (auto by = group([](const json& i) { return i.at("token").get<std::string>(); }); by.size() > 1) {
    std::map<std::string, std::vector<int>> named;
    int n = 0;
    for (const auto& [hash, ranks] : by) named[hash.empty() ? "no SPMDX_JOB_TOKEN" : "SPMDX_JOB_TOKEN #" + std::to_string(++n)] = ranks;
    problems.push_back("the job token differs: " + who_has(named, ""));
  }
  if (auto by = group([](const json& i) { return i.at("version").get<std::string>(); }); by.size() > 1) {
    problems.push_back("the spmdx build differs: " + who_has(by, "") + " (run the same spmdx everywhere)");
  }
  if (auto by = group([](const json& i) { return i.at("settings").get<std::string>(); }); by.size() > 1) {
    // Key by key, from one rank of each distinct config.
    std::vector<std::pair<std::vector<int>, std::map<std::string, std::string>>> configs;
    for (const auto& [hash, ranks] : by) configs.emplace_back(ranks, parse_settings(store.get(key("settings", ranks.front()), 10)));
    std::set<std::string> keys;
    for (const auto& [ranks, s] : configs) {
      for (const auto& [k, v] : s) keys.insert(k);
    }
    std::vector<std::string> differ;
    for (const auto& k : keys) {
      std::map<std::string, std::vector<int>> values;
      for (const auto& [ranks, s] : configs) {
        auto it = s.find(k);
        auto& into = values[it == s.end() ? "(not set)" : it->second];
        into.insert(into.end(), ranks.begin(), ranks.end());
      }
      if (values.size() < 2) continue;
      for (auto& [v, ranks] : values) std::sort(ranks.begin(), ranks.end());
      differ.push_back(who_has(values, k + " = "));
    }
    std::string list;
    for (std::size_t i = 0; i < differ.size() && i < 8; ++i) list += (i ? "; " : "") + differ[i];
    if (differ.size() > 8) list += "; and " + std::to_string(differ.size() - 8) + " more";
    problems.push_back("the ranks were started with different configs: " + list +
                       " (start every rank with the same config file and command-line overrides)");
  }
  std::string out;
  for (const auto& p : problems) out += (out.empty() ? "" : "; ") + p;
  return out;
}

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// A second process with this rank's RANK fails the job at once.
void claim_rank(Store& store, const RankIdentity& me, const std::string& at) {
  if (store.add(key("claim", me.rank), 1) > 1) {
    // Said to rank 0 too, which fails the job with it rather than waiting for a missing rank.
    const std::string why = "two processes joined this job as rank " + std::to_string(me.rank) + " (the second on " + me.host +
                            "): every rank needs its own RANK";
    try {
      store.set(key("problem", static_cast<int>(store.add(key("problems"), 1))), why);
    } catch (const std::exception&) {
    }
    throw CommError(at + why, -1);
  }
}

// This rank's settings and identity (secrets hashed), for rank 0 to compare.
void publish_identity(Store& store, const RankIdentity& me) {
  const std::string text = settings_text(me.settings);
  store.set(key("settings", me.rank), text);
  store.set(key("info", me.rank), json{{"rank", me.rank},
                                       {"world_size", me.world_size},
                                       {"world_size_from", me.world_size_from},
                                       {"host", me.host},
                                       {"local_rank", me.local_rank},
                                       {"local_world_size", me.local_world_size},
                                       {"version", me.version},
                                       {"token", me.token.empty() ? std::string() : fnv1a_hex(me.token)},
                                       {"settings", fnv1a_hex(text)}}
                                      .dump());
  store.add(key("present", me.rank), 1);
  store.add(key("joined"), 1);
}

// A rank other than 0: waits for rank 0's verdict and throws what it says is wrong.
void await_verdict(Store& store, const RankIdentity& me, double timeout_seconds, const std::string& where, const std::string& at, Clock::time_point start) {
  const int w = me.world_size;
  // Rank 0 may wait its whole timeout for a missing rank before it answers: wait longer, in
  // slices of 5 s, saying what for.
  const double limit = timeout_seconds + 10;
  double next_log = 5;
  std::optional<std::string> verdict;
  while (!(verdict = try_get(store, key("verdict"), std::max(0.01, std::min(5.0, limit - seconds_since(start)))))) {
    if (seconds_since(start) >= limit) {
      throw CommError(at + "rank " + std::to_string(me.rank) + " waited " + seconds_text(limit) +
                          " s for rank 0 to check every rank's world size, job token and config: is rank 0 running, started with the same "
                          "MASTER_ADDR and MASTER_PORT?",
                      0);
    }
    if (seconds_since(start) >= next_log) {
      SPMDX_INFO("rank " << me.rank << ": waiting at " << where << " for rank 0 to check every rank's world size, job token and config ("
                         << seconds_text(seconds_since(start)) << " s of " << seconds_text(limit) << " s)");
      next_log += 10;
    }
  }
  try {
    store.add(key("verdict_read"), 1);  // rank 0, which may serve the store, waits for this before it leaves
  } catch (const std::exception&) {
  }
  const json v = json::parse(*verdict);
  if (!v.at("ok").get<bool>()) throw CommError(v.at("error").get<std::string>(), -1);
  if (v.at("world_size").get<int>() != w) {
    throw CommError(at + "rank 0 runs a job of " + std::to_string(v.at("world_size").get<int>()) + " ranks, rank " + std::to_string(me.rank) +
                        " was started with " + me.world_size_from + "=" + std::to_string(w) + " (every rank must be started with the same world size)",
                    -1);
  }
}

// Rank 0: waits for every rank, naming those it waits for, compares their identities, and
// posts the verdict the others wait for.
class Referee {
 public:
  Referee(Store& store, const RankIdentity& me, double timeout_seconds, const std::string& where, const std::string& at, double linger_seconds,
          Clock::time_point start)
      : store_(store), me_(me), w_(me.world_size), timeout_seconds_(timeout_seconds), where_(where), at_(at), linger_seconds_(linger_seconds), start_(start) {}

  void judge() {
    check_hosts(gather());
    store_.set(key("verdict"), json{{"ok", true}, {"error", ""}, {"world_size", w_}}.dump());
  }

 private:
  double elapsed() const { return seconds_since(start_); }
  bool present(int r) const { return store_.add(key("present", r), 0) > 0; }

  std::vector<int> missing() const {
    std::vector<int> out;
    for (int r = 0; r < w_; ++r) {
      if (!present(r)) out.push_back(r);
    }
    return out;
  }

  [[noreturn]] void fail(const std::string& why) const {
    store_.set(key("verdict"), json{{"ok", false}, {"error", at_ + why}, {"world_size", w_}}.dump());
    // Rank 0 may serve the store (ranks started by hand, srun, mpirun): the ranks that joined
    // read the verdict before it leaves, for a few seconds at most; and when it serves the
    // store (linger_seconds > 0), so do ranks that have not joined yet, for that long.
    int joined = 0;
    for (int r = 1; r < w_; ++r) joined += present(r);
    const int readers = linger_seconds_ > 0 ? w_ - 1 : joined;
    if (linger_seconds_ > 0 && joined < w_ - 1) {
      std::fprintf(stderr, "%s%s\nrank 0 serves the store: keeping it up %g s for the ranks that have not joined yet, to tell them\n", at_.c_str(),
                   why.c_str(), linger_seconds_);
    }
    const auto until = Clock::now() + std::chrono::duration<double>(std::max(5.0, linger_seconds_));
    while (store_.add(key("verdict_read"), 0) < readers && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    throw CommError(at_ + why, -1);
  }

  // What the store says went wrong before any identity is compared: a rank refused for its
  // token, or two processes with one rank.
  void fail_on_reported_problems() const {
    if (store_.add(comm::kRejectedCountKey, 0) > 0) {
      const std::string refused = store_.get(comm::kRejectedKey, 10);
      std::string first = refused.substr(0, refused.find('\n'));
      const auto colon = first.rfind(": ");
      fail((colon == std::string::npos ? first : first.substr(0, colon)) + " could not join: the store refused its job token " +
           "(SPMDX_JOB_TOKEN must be the same on every rank and launcher)");
    }
    if (store_.add(key("problems"), 0) > 0) fail(store_.get(key("problem", 1), 10));
  }

  // Every rank's identity (rank -> info).
  std::map<int, json> gather() const {
    // Identities are read as ranks join and compared at once: a rank with another world size or
    // config fails the job when it arrives, not when the last rank does (or never does).
    std::map<int, json> infos;
    infos[0] = json::parse(store_.get(key("info", 0), 10));
    double next_log = 5, next_scan = 0;
    while (true) {
      fail_on_reported_problems();
      const bool all_joined = store_.add(key("joined"), 0) >= w_;
      if (all_joined || elapsed() >= next_scan) {
        next_scan = elapsed() + 0.1;
        bool arrived = false;
        for (int r = 1; r < w_; ++r) {
          if (infos.count(r) || !present(r)) continue;
          infos[r] = json::parse(store_.get(key("info", r), 10));
          arrived = true;
        }
        if (arrived) {
          if (const std::string why = compare(store_, infos); !why.empty()) fail(why);
        }
        if (static_cast<int>(infos.size()) == w_) return infos;
      }
      if (elapsed() >= timeout_seconds_) {
        const auto absent = missing();
        fail("rank 0 waited " + seconds_text(timeout_seconds_) + " s (comm.timeout_seconds) for " + rank_list(absent) + " of " + std::to_string(w_) +
             " to join: start " + (absent.size() == 1 ? "it" : "them") + ", or check " + (absent.size() == 1 ? "its" : "their") +
             " RANK, world size (" + me_.world_size_from + "=" + std::to_string(w_) + " here), MASTER_ADDR and MASTER_PORT");
      }
      if (elapsed() >= next_log) {
        SPMDX_INFO("rank 0: waiting at " << where_ << " for " << rank_list(missing()) << " of " << w_ << " to join (" << seconds_text(elapsed()) << " s of "
                                         << seconds_text(timeout_seconds_) << " s)");
        next_log += 10;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  // Every rank is here: each host holds as many ranks as their LOCAL_WORLD_SIZE says, with
  // LOCAL_RANKs 0 .. n-1 (they decide shared memory and each rank's share of the cores).
  void check_hosts(const std::map<int, json>& infos) const {
    std::map<std::string, std::vector<int>> by_host;
    for (const auto& [r, info] : infos) by_host[info.value("host", std::string())].push_back(r);
    for (const auto& [host, ranks] : by_host) {
      std::set<int> locals;
      for (int r : ranks) {
        const json& info = infos.at(r);
        const int lws = info.value("local_world_size", 1), lr = info.value("local_rank", 0);
        if (lws != static_cast<int>(ranks.size())) {
          fail(rank_list(ranks) + " run on host " + host + ", but rank " + std::to_string(r) + " has LOCAL_WORLD_SIZE=" + std::to_string(lws) +
               ": set it to the number of ranks on each host");
        }
        if (!locals.insert(lr).second) fail(rank_list(ranks) + " run on host " + host + " and two of them have LOCAL_RANK=" + std::to_string(lr) + ": give each its own");
      }
    }
  }

  Store& store_;
  const RankIdentity& me_;
  const int w_;
  const double timeout_seconds_;
  const std::string& where_;
  const std::string& at_;
  const double linger_seconds_;
  const Clock::time_point start_;
};

}  // namespace

void rendezvous(Store& store, const RankIdentity& me, double timeout_seconds, const std::string& where, double linger_seconds) {
  const auto start = Clock::now();
  const std::string at = "rendezvous at " + where + ": ";
  claim_rank(store, me, at);
  publish_identity(store, me);
  // Rank 0 polls counters (add 0) rather than keys with short timeouts: torchrun's c10d store
  // logs every timed-out wait.
  if (me.rank != 0) {
    await_verdict(store, me, timeout_seconds, where, at, start);
    return;
  }
  Referee(store, me, timeout_seconds, where, at, linger_seconds, start).judge();
}

}  // namespace spmdx::launch
