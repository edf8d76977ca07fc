#include "spmdx/hooks/fr_trace.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>

#include "spmdx/files.h"
#include "spmdx/text.h"

namespace spmdx::hooks {
namespace {

using nlohmann::json;

struct Entry {
  std::string op, dtype, value, state, error;
  std::vector<std::int64_t> shape;
  std::int64_t bytes = 0, step = 0, index = -1;
  std::uint64_t seq = 0;
  std::string signature() const {
    std::string s = op + " " + dtype + "[";
    for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "] (" + human_bytes(static_cast<double>(bytes)) + ")";
  }
  std::string where() const { return "in step " + std::to_string(step) + (index >= 0 ? ", plan index " + std::to_string(index) : ""); }
  std::string describe() const { return signature() + " producing " + value + " " + where(); }
};

using Timeline = std::map<std::uint64_t, Entry>;  // one rank's collectives on one group, by seq

// What makes two ranks' entries the same collective: the step and the place in the plan (or,
// in dumps without it, the value produced), and the op.
std::string identity(const Entry& e, bool by_index) {
  return std::to_string(e.step) + (by_index ? "#" + std::to_string(e.index) : ":" + e.value) + " " + e.op;
}

// A group is its name and its ranks.
using GroupKey = std::pair<std::string, std::vector<int>>;  // name, ranks

// What a folder's dumps hold, merged across the ranks.
struct Dumps {
  std::map<GroupKey, std::map<int, Timeline>> groups;  // group key -> rank -> seq -> entry
  std::vector<int> dumped;
  int world_size = 0;
  std::map<int, std::string> reasons;
  std::map<int, std::vector<std::string>> by_world;  // world_size -> files
  std::map<std::string, std::vector<std::string>> by_run;  // the job's run id (its rank 0 drew it) -> files
  std::map<int, std::size_t> full_ring;  // ranks whose dump holds as many entries as their ring: older ones were lost
};

// A value as the dump holds it, cut after 200 characters (a group of 100,000 ranks printed whole).
std::string shown(const json& v) {
  const std::string text = v.dump();
  return text.size() <= 200 ? text : text.substr(0, 200) + "... (" + std::to_string(text.size()) + " characters)";
}

// Every field typed and in range, each error naming the entry and the key: a dump edited
// by hand, or of another build, must not make the analysis blame the wrong rank.
std::int64_t integer_field(const json& obj, const std::string& key, std::int64_t lo, std::int64_t hi, const std::string& where) {
  if (!obj.contains(key)) throw std::runtime_error(where + "'" + key + "' is missing");
  const json& v = obj.at(key);
  if (!v.is_number_integer() || (v.is_number_unsigned() ? v.get<std::uint64_t>() > static_cast<std::uint64_t>(hi)
                                                        : (v.get<std::int64_t>() < lo || v.get<std::int64_t>() > hi))) {
    throw std::runtime_error(where + "'" + key + "' must be a whole number from " + std::to_string(lo) + " to " + std::to_string(hi) + ", is " + shown(v));
  }
  return v.get<std::int64_t>();
}

std::string text_field(const json& obj, const std::string& key, const std::string& where) {
  if (!obj.contains(key) || !obj.at(key).is_string()) throw std::runtime_error(where + "'" + key + "' must be a string");
  return obj.at(key).get<std::string>();
}

// One entry of the dump of `rank` (of a world of `ws`), and the group it was issued on.
std::pair<GroupKey, Entry> read_entry(const json& e, const std::string& where, int ws, int rank) {
  if (!e.is_object()) throw std::runtime_error(where + "not an object");
  Entry x;
  x.op = text_field(e, "op", where);
  x.dtype = text_field(e, "dtype", where);
  x.value = text_field(e, "value", where);
  x.state = text_field(e, "state", where);
  if (x.state != "issued" && x.state != "completed" && x.state != "failed") throw std::runtime_error(where + "'state' is \"" + x.state + "\"");
  x.error = e.contains("error") && e["error"].is_string() ? e["error"].get<std::string>() : "";
  if (!e.contains("shape") || !e["shape"].is_array()) throw std::runtime_error(where + "'shape' must be a list");
  for (const auto& d : e["shape"]) {
    if (!d.is_number_integer() || d.get<std::int64_t>() < 0) throw std::runtime_error(where + "'shape' must hold whole numbers >= 0");
    x.shape.push_back(d.get<std::int64_t>());
  }
  x.bytes = integer_field(e, "bytes", 0, INT64_MAX, where);
  x.step = integer_field(e, "step", 0, INT64_MAX, where);
  x.index = e.contains("index") ? integer_field(e, "index", -1, INT64_MAX, where) : -1;  // dumps before ABI 2.1 have none
  x.seq = static_cast<std::uint64_t>(integer_field(e, "seq", 0, INT64_MAX, where));
  const std::string group = text_field(e, "group_name", where);
  if (!e.contains("group_ranks") || !e["group_ranks"].is_array() || e["group_ranks"].empty()) throw std::runtime_error(where + "'group_ranks' must be a list of ranks");
  std::vector<int> members;
  for (const auto& g : e["group_ranks"]) {
    if (!g.is_number_integer() || g.get<std::int64_t>() < 0 || g.get<std::int64_t>() >= ws || (!members.empty() && g.get<int>() <= members.back())) {
      throw std::runtime_error(where + "'group_ranks' must hold ascending ranks below world_size " + std::to_string(ws) + ", is " + shown(e["group_ranks"]));
    }
    members.push_back(g.get<int>());
  }
  if (!std::binary_search(members.begin(), members.end(), rank)) {
    throw std::runtime_error(where + "'group_ranks' " + shown(e["group_ranks"]) + " does not hold the rank that dumped it (" + std::to_string(rank) + ")");
  }
  return {{group, members}, x};
}

// Merges the dump rank<r>.json (named `name`) into `dumps`.
void read_dump(const std::filesystem::path& path, const std::string& name, Dumps& dumps) {
  const std::string text = read_file_bytes(path);
  check_json_nesting(text);
  json doc = json::parse(text);
  if (!doc.is_object() || doc.value("format", "") != "spmdx-flight-recorder-1") throw std::runtime_error("no format \"spmdx-flight-recorder-1\"");
  const int ws = static_cast<int>(integer_field(doc, "world_size", 1, 100'000'000, ""));
  const int rank = static_cast<int>(integer_field(doc, "rank", 0, ws - 1, ""));
  if (name != "rank" + std::to_string(rank) + ".json") {
    throw std::runtime_error("it holds rank " + std::to_string(rank) + "'s dump under another rank's name");
  }
  dumps.world_size = std::max(dumps.world_size, ws);
  dumps.by_world[ws].push_back(name);
  dumps.by_run[doc.contains("run") && doc["run"].is_string() ? doc["run"].get<std::string>() : std::string("(none)")].push_back(name);
  dumps.reasons[rank] = doc.value("reason", "");
  if (doc.contains("size") && doc["size"].is_number_unsigned() && doc.contains("entries") && doc["entries"].is_array() &&
      doc["entries"].size() >= doc["size"].get<std::size_t>()) {
    dumps.full_ring[rank] = doc["size"].get<std::size_t>();
  }
  dumps.dumped.push_back(rank);
  if (!doc.contains("entries") || !doc["entries"].is_array()) throw std::runtime_error("'entries' must be a list");
  std::size_t i = 0;
  for (const auto& e : doc["entries"]) {
    auto [key, x] = read_entry(e, "entry #" + std::to_string(i++) + ": ", ws, rank);
    // Pipeline stages' send and recv are point to point, each pair its own order: not a group's
    // collectives to match (a stage that stops still shows in its stage's collectives).
    if (x.op == "send" || x.op == "recv") continue;
    dumps.groups[key][rank][x.seq] = std::move(x);
  }
}

// Dumps of two runs (or two world sizes) side by side would be matched as one job's.
void refuse_mixed_runs(const std::filesystem::path& folder, const Dumps& dumps) {
  if (dumps.by_run.size() > 1) {
    std::string list;
    for (const auto& [run, files] : dumps.by_run) {
      list += (list.empty() ? "" : "; ") + std::string("run ") + run + ":";
      for (const auto& f : files) list += " " + f;
    }
    throw std::runtime_error(folder.string() + ": the dumps come from different runs (" + list + "); remove the old ones");
  }
  if (dumps.by_world.size() > 1) {
    std::string list;
    for (const auto& [ws, files] : dumps.by_world) {
      list += (list.empty() ? "" : "; ") + std::string("world_size ") + std::to_string(ws) + ":";
      for (const auto& f : files) list += " " + f;
    }
    throw std::runtime_error(folder.string() + ": the dumps come from different runs (" + list + "); remove the old ones");
  }
}

// Reads every rank*.json of `folder` (not the rank<R>.<N>.json of earlier runs); `dumped` comes
// back sorted.
Dumps read_dumps(const std::filesystem::path& folder) {
  Dumps dumps;
  for (const auto& file : std::filesystem::directory_iterator(folder)) {
    const std::string name = file.path().filename().string();
    if (name.rfind("rank", 0) != 0 || file.path().extension() != ".json") continue;
    if (name.find('.') != name.size() - 5) continue;  // rank<R>.<N>.json: an earlier run's dump, kept aside by the flight recorder
    try {
      read_dump(file.path(), name, dumps);
    } catch (const std::exception& e) {
      throw std::runtime_error(file.path().string() + ": not a valid flight recorder dump (" + e.what() +
                               "); the flight_recorder hook writes them: remove the file or re-run");
    }
  }
  refuse_mixed_runs(folder, dumps);
  if (dumps.dumped.empty()) throw std::runtime_error(folder.string() + ": no rank*.json dumps (ranks dump when a collective fails or times out, on SIGTERM/SIGINT, or on SIGUSR1)");
  std::sort(dumps.dumped.begin(), dumps.dumped.end());
  return dumps;
}

using Holders = std::map<std::string, std::vector<int>>;  // identity -> ranks that issued it as #s

// One group's timelines side by side, compared call by call (by sequence number) from the
// oldest one every member still holds, up to the first where the members part.
class GroupMatch {
 public:
  GroupMatch(const GroupKey& key, const std::map<int, Timeline>& by_rank, const Dumps& dumps) : by_rank_(by_rank), full_ring_(dumps.full_ring) {
    group_ = key.first + " [";
    for (std::size_t i = 0; i < key.second.size(); ++i) group_ += (i ? ", " : "") + std::to_string(key.second[i]);
    group_ += "]";
    // Members with a dump; a member that dumped but never used this group has no entries.
    for (int r : key.second) {
      if (std::binary_search(dumps.dumped.begin(), dumps.dumped.end(), r)) members_.push_back(r);
      else undumped_.push_back(r);
    }
    for (int r : members_) {
      auto it = by_rank_.find(r);
      if (it == by_rank_.end() || it->second.empty()) continue;
      lo_ = std::max(lo_, it->second.begin()->first);  // older entries fell out of some ring buffer
      for (const auto& [q, e] : it->second) {
        seqs_.insert(q);
        by_index_ = by_index_ && e.index >= 0;
      }
    }
    no_dump_ = undumped_.empty() ? "" : " " + rank_list(undumped_) + " of this group left no dump (it exited, died or was stopped before dumping): it may be the one missing.";
  }

  // The group's finding, if any: the first divergence, or else the first stall.
  std::optional<FrFinding> first_disagreement() const {
    // A collective every rank issued but some have not seen complete is a stall only when no
    // later one diverges: with overlap a rank may not have waited for it yet when a later
    // collective fails.
    std::optional<FrFinding> stall;
    for (auto sit = seqs_.lower_bound(lo_); sit != seqs_.end(); ++sit) {
      const std::uint64_t s = *sit;
      Holders holders;
      std::vector<int> absent;
      for (int r : members_) {
        if (const Entry* e = entry(r, s)) holders[identity(*e, by_index_)].push_back(r);
        else absent.push_back(r);
      }
      if (holders.empty()) continue;
      if (holders.size() == 1 && absent.empty()) {  // the same collective everywhere: did it complete?
        if (!stall) stall = stalled_finding(s);
        continue;
      }
      if (holders.size() == 1) return missing_finding(s, absent, holders.begin()->second);  // some ranks never issued #s
      if (const std::string first = first_in_plan(s, holders); !first.empty()) return skipped_finding(s, first, holders, absent);
      return different_finding(s, holders);
    }
    return stall;
  }

 private:
  const Timeline* timeline(int r) const {
    auto it = by_rank_.find(r);
    return it == by_rank_.end() ? nullptr : &it->second;
  }

  const Entry* entry(int r, std::uint64_t s) const {
    const Timeline* t = timeline(r);
    if (t == nullptr) return nullptr;
    auto e = t->find(s);
    return e == t->end() ? nullptr : &e->second;
  }

  // Whether rank r issued collective `id` after its call #s.
  bool issues_later(int r, std::uint64_t s, const std::string& id) const {
    const Timeline* t = timeline(r);
    if (t == nullptr) return false;
    for (auto it = t->upper_bound(s); it != t->end(); ++it) {
      if (identity(it->second, by_index_) == id) return true;
    }
    return false;
  }

  FrFinding finding(FrFinding::Kind kind, std::uint64_t s, std::vector<int> ranks, const Entry& subject, std::string message) const {
    // At the oldest collective every member still holds, with a ring that was full: what went
    // wrong may be older than the dumps reach.
    if (s == lo_) {
      for (int r : members_) {
        if (auto f = full_ring_.find(r); f != full_ring_.end()) {
          message += " (Rank " + std::to_string(r) + "'s dump holds only its last " + std::to_string(f->second) + " collectives, from #" +
                     std::to_string(lo_) + " on this group: the divergence may be older; raise hooks.flight_recorder.size to see it.)";
          break;
        }
      }
    }
    return {kind, group_, s, std::move(ranks), subject.step, subject.index, subject.value, std::move(message)};
  }

  // Collective #s, issued by every member: a stall where it did not complete on some.
  std::optional<FrFinding> stalled_finding(std::uint64_t s) const {
    std::vector<int> pending;
    std::string errors;
    for (int r : members_) {
      const Entry& e = *entry(r, s);
      if (e.state == "completed") continue;
      pending.push_back(r);
      if (!e.error.empty() && errors.empty()) errors = " (rank " + std::to_string(r) + ": " + e.error + ")";
    }
    if (pending.empty()) return std::nullopt;
    const Entry& ref = *entry(members_.front(), s);
    if (undumped_.empty()) {
      return FrFinding{FrFinding::Kind::stalled, group_, s, pending, ref.step, ref.index, ref.value,
                       "group " + group_ + ", collective #" + std::to_string(s) + " (" + ref.describe() +
                           "): every rank issued it, it did not complete on " + rank_list(pending) + errors + "."};
    }
    return FrFinding{FrFinding::Kind::stalled, group_, s, undumped_, ref.step, ref.index, ref.value,
                     "group " + group_ + ", collective #" + std::to_string(s) + " (" + ref.describe() + "): " + rank_list(members_) +
                         " issued it, it did not complete on " + rank_list(pending) + errors + "." + no_dump_};
  }

  FrFinding missing_finding(std::uint64_t s, const std::vector<int>& absent, const std::vector<int>& issued) const {
    const Entry& ref = *entry(issued.front(), s);
    std::ostringstream m;
    m << "group " << group_ << ", collective #" << s << ": " << rank_list(absent) << " never issued it; " << rank_list(issued) << " issued "
      << ref.describe() << " (state " << ref.state << ").";
    for (int r : absent) {
      const Timeline* t = timeline(r);
      if (t != nullptr && !t->empty()) {
        const Entry& last = t->rbegin()->second;
        m << " Rank " << r << "'s last collective on this group is #" << last.seq << " (" << last.describe() << ", " << last.state << ")"
          << (last.state == "completed" ? ": when it dumped it was computing, stuck outside collectives, or had skipped this one." : ".");
      } else {
        m << " Rank " << r << " recorded no collective on this group.";
      }
    }
    m << no_dump_;
    return finding(FrFinding::Kind::missing, s, absent, ref, m.str());
  }

  // The ranks issued different collectives as #s. The one that comes first in the plan is
  // the one the others skipped: by plan index, or else the only one that no other rank
  // issues later (the others' turn up later in its holders' timelines). "" when neither tells,
  // as when two ops stand at one place in the plan: nobody skipped, the ranks disagree on it.
  std::string first_in_plan(std::uint64_t s, const Holders& holders) const {
    std::string first;
    if (by_index_) {
      std::tuple<std::int64_t, std::int64_t> best{INT64_MAX, INT64_MAX};
      bool tied = false;
      for (const auto& [id, ranks] : holders) {
        const Entry& e = *entry(ranks.front(), s);
        const auto place = std::make_tuple(e.step, e.index);
        tied = place == best || (place > best && tied);
        if (place < best) best = place, first = id, tied = false;
      }
      if (tied) first.clear();
    } else {
      std::vector<std::string> earliest;
      for (const auto& [id, ranks] : holders) {
        bool later = false;  // some rank holding another collective issues this one afterwards
        for (const auto& [other, others] : holders) {
          for (int q : others) later = later || (other != id && issues_later(q, s, id));
        }
        if (!later) earliest.push_back(id);
      }
      if (earliest.size() == 1) first = earliest.front();
    }
    return first;
  }

  FrFinding skipped_finding(std::uint64_t s, const std::string& first, const Holders& holders, const std::vector<int>& absent) const {
    const std::vector<int>& in_order = holders.at(first);
    const Entry& ref = *entry(in_order.front(), s);
    std::vector<int> skipped;
    std::ostringstream m;
    m << "group " << group_ << ", collective #" << s << ": ";
    bool head = true;
    for (const auto& [id, ranks] : holders) {
      if (id == first) continue;
      skipped.insert(skipped.end(), ranks.begin(), ranks.end());
      const Entry& theirs = *entry(ranks.front(), s);
      // What they skipped: the holders' collectives from #s up to the one they issued.
      std::vector<const Entry*> missed;
      const Timeline& t = *timeline(in_order.front());
      for (auto it = t.find(s); it != t.end() && identity(it->second, by_index_) != id; ++it) missed.push_back(&it->second);
      m << (head ? "" : "; ") << rank_list(ranks) << " skipped the collective producing " << ref.value << " " << ref.where() << " (" << ref.signature()
        << ")";
      if (missed.size() > 1) {
        m << " and " << (missed.size() - 1) << " after it (";
        for (std::size_t i = 1; i < missed.size() && i < 5; ++i) m << (i > 1 ? ", " : "") << missed[i]->value;
        m << (missed.size() > 5 ? ", ..." : "") << ")";
      }
      m << ": " << rank_list(in_order) << " issued it as #" << s << ", " << rank_list(ranks) << " issued " << theirs.describe() << " there instead";
      head = false;
    }
    if (!absent.empty()) m << "; " << rank_list(absent) << " issued nothing as #" << s;
    m << ". Every rank of a group must issue the same collectives in the same order." << no_dump_;
    std::sort(skipped.begin(), skipped.end());
    return finding(FrFinding::Kind::skipped, s, skipped, ref, m.str());
  }

  // No order to go by: name the minority; with no majority (two ranks, one each), every side.
  FrFinding different_finding(std::uint64_t s, const Holders& holders) const {
    auto majority = std::max_element(holders.begin(), holders.end(), [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
    const bool no_majority = std::count_if(holders.begin(), holders.end(), [&](const auto& h) { return h.second.size() == majority->second.size(); }) > 1;
    const Entry& ref = *entry(majority->second.front(), s);
    std::vector<int> odd;
    if (no_majority) odd = majority->second;
    std::ostringstream m;
    m << "group " << group_ << ", collective #" << s << ": the ranks disagree on what it is" << (no_majority ? " (no majority tells which is wrong)" : "") << ": "
      << rank_list(majority->second) << " issued " << ref.describe();
    for (const auto& [id, ranks] : holders) {
      if (id == majority->first) continue;
      odd.insert(odd.end(), ranks.begin(), ranks.end());
      m << "; " << rank_list(ranks) << " issued " << entry(ranks.front(), s)->describe();
    }
    m << ". Every rank of a group must issue the same collectives in the same order." << no_dump_;
    std::sort(odd.begin(), odd.end());
    return finding(FrFinding::Kind::different, s, odd, ref, m.str());
  }

  const std::map<int, Timeline>& by_rank_;
  const std::map<int, std::size_t>& full_ring_;
  std::string group_;                  // "dp_shard [0, 1, 2, 3]"
  std::vector<int> members_, undumped_;
  std::uint64_t lo_ = 0;               // the oldest call every member still holds
  std::set<std::uint64_t> seqs_;
  bool by_index_ = true;  // every entry knows its place in the plan
  std::string no_dump_;                // said of every finding when a member left no dump
};

// Divergences before stalls (a collective not yet seen complete may only not have been
// waited for), the earliest in plan order first: a rank that skipped a collective makes
// later ones fail on other groups too.
void order_findings(std::vector<FrFinding>& findings) {
  std::stable_sort(findings.begin(), findings.end(), [](const FrFinding& a, const FrFinding& b) {
    const bool sa = a.kind == FrFinding::Kind::stalled, sb = b.kind == FrFinding::Kind::stalled;
    if (sa != sb) return sb;
    const bool ka = a.index >= 0, kb = b.index >= 0;
    if (ka != kb) return ka;
    if (ka && std::make_tuple(a.step, a.index) != std::make_tuple(b.step, b.index)) return std::make_tuple(a.step, a.index) < std::make_tuple(b.step, b.index);
    return a.kind < b.kind;
  });
}

std::string report(const std::filesystem::path& folder, const FrAnalysis& out, const std::map<int, std::string>& reasons) {
  std::ostringstream text;
  text << "flight recorder dumps in " << folder.string() << ": " << rank_list(out.dumped);
  if (!out.no_dump.empty()) text << "; no dump from " << rank_list(out.no_dump) << " (it died before dumping, or its disk is elsewhere)";
  text << "\n";
  bool on_request = !reasons.empty();
  for (const auto& [r, why] : reasons) {
    text << "  rank " << r << " dumped on: " << why << "\n";
    on_request = on_request && why.find("dump requested") != std::string::npos;
  }
  if (on_request && !out.findings.empty()) {
    text << "(every dump was taken on request while the job ran: each rank took its snapshot a moment apart from the others, so the "
            "newest collectives may differ without anything being wrong)\n";
  }
  if (out.findings.empty()) {
    text << "no mismatch: the ranks with dumps issued the same collectives in the same order, and the last ones completed\n";
  } else {
    if (out.findings.size() > 1) text << "findings, divergences first, the earliest in the plan first (later ones may follow from it):\n";
    for (const auto& f : out.findings) text << "- " << f.message << "\n";
  }
  return text.str();
}

}  // namespace

FrAnalysis analyze_flight_recorder(const std::filesystem::path& given) {
  namespace fs = std::filesystem;
  std::error_code ec;
  // The job's dump folder names the flight recorder's folder inside it.
  const fs::path folder = fs::is_directory(given / "hooks" / "flight_recorder", ec) ? given / "hooks" / "flight_recorder" : given;
  if (!fs::is_directory(folder, ec)) {
    throw std::runtime_error(folder.string() + (fs::exists(folder, ec) ? ": not a folder" : ": no such folder") +
                             " (the flight_recorder hook writes its dumps in <job.dump_folder>/hooks/flight_recorder)");
  }
  const Dumps dumps = read_dumps(folder);
  FrAnalysis out;
  out.dumped = dumps.dumped;
  for (int r = 0; r < dumps.world_size; ++r) {
    if (!std::binary_search(out.dumped.begin(), out.dumped.end(), r)) out.no_dump.push_back(r);
  }
  for (const auto& [key, by_rank] : dumps.groups) {
    if (auto finding = GroupMatch(key, by_rank, dumps).first_disagreement()) out.findings.push_back(std::move(*finding));
  }
  order_findings(out.findings);
  out.text = report(folder, out, dumps.reasons);
  return out;
}

}  // namespace spmdx::hooks
