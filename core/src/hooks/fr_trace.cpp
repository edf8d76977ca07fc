#include "spmdx/hooks/fr_trace.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>

#include "spmdx/core/text.h"

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

}  // namespace

FrAnalysis analyze_flight_recorder(const std::filesystem::path& given) {
  namespace fs = std::filesystem;
  std::error_code ec;
  // The job's dump folder names the flight recorder's folder inside it.
  const fs::path folder = fs::is_directory(given / "hooks" / "flight_recorder", ec) ? given / "hooks" / "flight_recorder" : given;
  if (!fs::is_directory(folder, ec)) throw std::runtime_error(folder.string() + ": no such folder (the flight_recorder hook writes <job.dump_folder>/hooks/flight_recorder)");
  // group key -> rank -> seq -> entry
  using Key = std::pair<std::string, std::vector<int>>;  // name, ranks
  std::map<Key, std::map<int, Timeline>> groups;
  FrAnalysis out;
  int world_size = 0;
  std::map<int, std::string> reasons;
  std::map<int, std::vector<std::string>> by_world;  // world_size -> files
  std::map<std::string, std::vector<std::string>> by_run;  // the job's run id (its rank 0 drew it) -> files
  std::map<int, std::size_t> full_ring;  // ranks whose dump holds as many entries as their ring: older ones were lost
  for (const auto& file : fs::directory_iterator(folder)) {
    const std::string name = file.path().filename().string();
    if (name.rfind("rank", 0) != 0 || file.path().extension() != ".json") continue;
    json doc;
    try {
      std::ifstream in(file.path());
      doc = json::parse(in);
      if (!doc.is_object() || doc.value("format", "") != "spmdx-flight-recorder-1") throw std::runtime_error("no format \"spmdx-flight-recorder-1\"");
      // Every field typed and in range, each error naming the entry and the key: a dump edited
      // by hand, or of another build, must not make the analysis blame the wrong rank.
      auto integer = [](const json& obj, const std::string& key, std::int64_t lo, std::int64_t hi, const std::string& where) {
        if (!obj.contains(key)) throw std::runtime_error(where + "'" + key + "' is missing");
        const json& v = obj.at(key);
        if (!v.is_number_integer() || (v.is_number_unsigned() ? v.get<std::uint64_t>() > static_cast<std::uint64_t>(hi)
                                                              : (v.get<std::int64_t>() < lo || v.get<std::int64_t>() > hi))) {
          throw std::runtime_error(where + "'" + key + "' must be a whole number from " + std::to_string(lo) + " to " + std::to_string(hi) + ", is " + v.dump());
        }
        return v.get<std::int64_t>();
      };
      auto text = [](const json& obj, const std::string& key, const std::string& where) {
        if (!obj.contains(key) || !obj.at(key).is_string()) throw std::runtime_error(where + "'" + key + "' must be a string");
        return obj.at(key).get<std::string>();
      };
      const int ws = static_cast<int>(integer(doc, "world_size", 1, 100'000'000, ""));
      const int rank = static_cast<int>(integer(doc, "rank", 0, ws - 1, ""));
      if (name != "rank" + std::to_string(rank) + ".json") {
        throw std::runtime_error("it holds rank " + std::to_string(rank) + "'s dump under another rank's name");
      }
      world_size = std::max(world_size, ws);
      by_world[ws].push_back(name);
      by_run[doc.contains("run") && doc["run"].is_string() ? doc["run"].get<std::string>() : std::string("(none)")].push_back(name);
      reasons[rank] = doc.value("reason", "");
      if (doc.contains("size") && doc["size"].is_number_unsigned() && doc.contains("entries") && doc["entries"].is_array() &&
          doc["entries"].size() >= doc["size"].get<std::size_t>()) {
        full_ring[rank] = doc["size"].get<std::size_t>();
      }
      out.dumped.push_back(rank);
      if (!doc.contains("entries") || !doc["entries"].is_array()) throw std::runtime_error("'entries' must be a list");
      std::size_t i = 0;
      for (const auto& e : doc["entries"]) {
        const std::string where = "entry #" + std::to_string(i++) + ": ";
        if (!e.is_object()) throw std::runtime_error(where + "not an object");
        Entry x;
        x.op = text(e, "op", where);
        x.dtype = text(e, "dtype", where);
        x.value = text(e, "value", where);
        x.state = text(e, "state", where);
        if (x.state != "issued" && x.state != "completed" && x.state != "failed") throw std::runtime_error(where + "'state' is \"" + x.state + "\"");
        x.error = e.contains("error") && e["error"].is_string() ? e["error"].get<std::string>() : "";
        if (!e.contains("shape") || !e["shape"].is_array()) throw std::runtime_error(where + "'shape' must be a list");
        for (const auto& d : e["shape"]) {
          if (!d.is_number_integer() || d.get<std::int64_t>() < 0) throw std::runtime_error(where + "'shape' must hold whole numbers >= 0");
          x.shape.push_back(d.get<std::int64_t>());
        }
        x.bytes = integer(e, "bytes", 0, INT64_MAX, where);
        x.step = integer(e, "step", 0, INT64_MAX, where);
        x.index = e.contains("index") ? integer(e, "index", -1, INT64_MAX, where) : -1;  // dumps before ABI 2.1 have none
        x.seq = static_cast<std::uint64_t>(integer(e, "seq", 0, INT64_MAX, where));
        const std::string group = text(e, "group_name", where);
        if (!e.contains("group_ranks") || !e["group_ranks"].is_array() || e["group_ranks"].empty()) throw std::runtime_error(where + "'group_ranks' must be a list of ranks");
        std::vector<int> members;
        for (const auto& g : e["group_ranks"]) {
          if (!g.is_number_integer() || g.get<std::int64_t>() < 0 || g.get<std::int64_t>() >= ws || (!members.empty() && g.get<int>() <= members.back())) {
            throw std::runtime_error(where + "'group_ranks' must hold ascending ranks below world_size " + std::to_string(ws) + ", is " + e["group_ranks"].dump());
          }
          members.push_back(g.get<int>());
        }
        if (!std::binary_search(members.begin(), members.end(), rank)) {
          throw std::runtime_error(where + "'group_ranks' " + e["group_ranks"].dump() + " does not hold the rank that dumped it (" + std::to_string(rank) + ")");
        }
        groups[{group, members}][rank][x.seq] = x;
      }
    } catch (const std::exception& e) {
      throw std::runtime_error(file.path().string() + ": not a valid flight recorder dump (" + e.what() +
                               "); the flight_recorder hook writes them: remove the file or re-run");
    }
  }
  if (by_run.size() > 1) {
    std::string list;
    for (const auto& [run, files] : by_run) {
      list += (list.empty() ? "" : "; ") + std::string("run ") + run + ":";
      for (const auto& f : files) list += " " + f;
    }
    throw std::runtime_error(folder.string() + ": the dumps come from different runs (" + list + "); remove the old ones");
  }
  if (by_world.size() > 1) {
    std::string list;
    for (const auto& [ws, files] : by_world) {
      list += (list.empty() ? "" : "; ") + std::string("world_size ") + std::to_string(ws) + ":";
      for (const auto& f : files) list += " " + f;
    }
    throw std::runtime_error(folder.string() + ": the dumps come from different runs (" + list + "); remove the old ones");
  }
  if (out.dumped.empty()) throw std::runtime_error(folder.string() + ": no rank*.json dumps (ranks dump when a collective fails or times out, on SIGTERM/SIGINT, or on SIGUSR1)");
  std::sort(out.dumped.begin(), out.dumped.end());
  for (int r = 0; r < world_size; ++r) {
    if (!std::binary_search(out.dumped.begin(), out.dumped.end(), r)) out.no_dump.push_back(r);
  }
  for (const auto& [key, by_rank] : groups) {
    std::string group = key.first + " [";
    for (std::size_t i = 0; i < key.second.size(); ++i) group += (i ? ", " : "") + std::to_string(key.second[i]);
    group += "]";
    // Members with a dump; a member that dumped but never used this group has no entries.
    std::vector<int> members, undumped;
    for (int r : key.second) {
      if (std::binary_search(out.dumped.begin(), out.dumped.end(), r)) members.push_back(r);
      else undumped.push_back(r);
    }
    std::uint64_t lo = 0;
    std::set<std::uint64_t> seqs;
    bool by_index = true;  // every entry knows its place in the plan
    for (int r : members) {
      auto it = by_rank.find(r);
      if (it == by_rank.end() || it->second.empty()) continue;
      lo = std::max(lo, it->second.begin()->first);  // older entries fell out of some ring buffer
      for (const auto& [q, e] : it->second) {
        seqs.insert(q);
        by_index = by_index && e.index >= 0;
      }
    }
    const std::string no_dump = undumped.empty() ? "" : " " + rank_list(undumped) + " of this group left no dump (it exited, died or was stopped before dumping): it may be the one missing.";
    auto timeline = [&](int r) -> const Timeline* {
      auto it = by_rank.find(r);
      return it == by_rank.end() ? nullptr : &it->second;
    };
    auto entry = [&](int r, std::uint64_t s) -> const Entry* {
      const Timeline* t = timeline(r);
      if (t == nullptr) return nullptr;
      auto e = t->find(s);
      return e == t->end() ? nullptr : &e->second;
    };
    // Whether rank r issued collective `id` after its call #s.
    auto issues_later = [&](int r, std::uint64_t s, const std::string& id) {
      const Timeline* t = timeline(r);
      if (t == nullptr) return false;
      for (auto it = t->upper_bound(s); it != t->end(); ++it) {
        if (identity(it->second, by_index) == id) return true;
      }
      return false;
    };
    auto finding = [&](FrFinding::Kind kind, std::uint64_t s, std::vector<int> ranks, const Entry& subject, std::string message) {
      // At the oldest collective every member still holds, with a ring that was full: what went
      // wrong may be older than the dumps reach.
      if (s == lo) {
        for (int r : members) {
          if (auto f = full_ring.find(r); f != full_ring.end()) {
            message += " (Rank " + std::to_string(r) + "'s dump holds only its last " + std::to_string(f->second) + " collectives, from #" +
                       std::to_string(lo) + " on this group: the divergence may be older; raise hooks.flight_recorder.size to see it.)";
            break;
          }
        }
      }
      out.findings.push_back({kind, group, s, std::move(ranks), subject.step, subject.index, subject.value, std::move(message)});
    };
    // A collective every rank issued but some have not seen complete is a stall only when no
    // later one diverges: with overlap a rank may not have waited for it yet when a later
    // collective fails.
    std::optional<FrFinding> stall;
    bool diverged = false;
    for (auto sit = seqs.lower_bound(lo); sit != seqs.end() && !diverged; ++sit) {
      const std::uint64_t s = *sit;
      std::map<std::string, std::vector<int>> holders;  // identity -> ranks that issued it as #s
      std::vector<int> absent;
      for (int r : members) {
        if (const Entry* e = entry(r, s)) holders[identity(*e, by_index)].push_back(r);
        else absent.push_back(r);
      }
      if (holders.empty()) continue;
      if (holders.size() == 1 && absent.empty()) {  // the same collective everywhere: did it complete?
        std::vector<int> pending;
        std::string errors;
        for (int r : members) {
          const Entry& e = *entry(r, s);
          if (e.state == "completed") continue;
          pending.push_back(r);
          if (!e.error.empty() && errors.empty()) errors = " (rank " + std::to_string(r) + ": " + e.error + ")";
        }
        if (pending.empty() || stall) continue;
        const Entry& ref = *entry(members.front(), s);
        if (undumped.empty()) {
          stall = FrFinding{FrFinding::Kind::stalled, group, s, pending, ref.step, ref.index, ref.value,
                            "group " + group + ", collective #" + std::to_string(s) + " (" + ref.describe() +
                                "): every rank issued it, it did not complete on " + rank_list(pending) + errors + "."};
        } else {
          stall = FrFinding{FrFinding::Kind::stalled, group, s, undumped, ref.step, ref.index, ref.value,
                            "group " + group + ", collective #" + std::to_string(s) + " (" + ref.describe() + "): " + rank_list(members) +
                                " issued it, it did not complete on " + rank_list(pending) + errors + "." + no_dump};
        }
        continue;
      }
      diverged = true;
      if (holders.size() == 1) {  // some ranks never issued #s
        const std::vector<int>& issued = holders.begin()->second;
        const Entry& ref = *entry(issued.front(), s);
        std::ostringstream m;
        m << "group " << group << ", collective #" << s << ": " << rank_list(absent) << " never issued it; " << rank_list(issued) << " issued "
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
        m << no_dump;
        finding(FrFinding::Kind::missing, s, absent, ref, m.str());
        continue;
      }
      // The ranks issued different collectives as #s. The one that comes first in the plan is
      // the one the others skipped: by plan index, or else the only one that no other rank
      // issues later (the others' turn up later in its holders' timelines).
      std::string first;
      if (by_index) {
        std::tuple<std::int64_t, std::int64_t> best{INT64_MAX, INT64_MAX};
        for (const auto& [id, ranks] : holders) {
          const Entry& e = *entry(ranks.front(), s);
          if (std::make_tuple(e.step, e.index) < best) best = {e.step, e.index}, first = id;
        }
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
      if (!first.empty()) {
        const std::vector<int>& in_order = holders.at(first);
        const Entry& ref = *entry(in_order.front(), s);
        std::vector<int> skipped;
        std::ostringstream m;
        m << "group " << group << ", collective #" << s << ": ";
        bool head = true;
        for (const auto& [id, ranks] : holders) {
          if (id == first) continue;
          skipped.insert(skipped.end(), ranks.begin(), ranks.end());
          const Entry& theirs = *entry(ranks.front(), s);
          // What they skipped: the holders' collectives from #s up to the one they issued.
          std::vector<const Entry*> missed;
          const Timeline& t = *timeline(in_order.front());
          for (auto it = t.find(s); it != t.end() && identity(it->second, by_index) != id; ++it) missed.push_back(&it->second);
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
        m << ". Every rank of a group must issue the same collectives in the same order." << no_dump;
        std::sort(skipped.begin(), skipped.end());
        finding(FrFinding::Kind::skipped, s, skipped, ref, m.str());
        continue;
      }
      // No order to go by: name the minority.
      auto majority = std::max_element(holders.begin(), holders.end(), [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
      const Entry& ref = *entry(majority->second.front(), s);
      std::vector<int> odd;
      std::ostringstream m;
      m << "group " << group << ", collective #" << s << ": the ranks disagree on what it is: " << rank_list(majority->second) << " issued " << ref.describe();
      for (const auto& [id, ranks] : holders) {
        if (id == majority->first) continue;
        odd.insert(odd.end(), ranks.begin(), ranks.end());
        m << "; " << rank_list(ranks) << " issued " << entry(ranks.front(), s)->describe();
      }
      m << ". Every rank of a group must issue the same collectives in the same order." << no_dump;
      std::sort(odd.begin(), odd.end());
      finding(FrFinding::Kind::different, s, odd, ref, m.str());
    }
    if (!diverged && stall) out.findings.push_back(*stall);
  }
  // Divergences before stalls (a collective not yet seen complete may only not have been
  // waited for), the earliest in plan order first: a rank that skipped a collective makes
  // later ones fail on other groups too.
  std::stable_sort(out.findings.begin(), out.findings.end(), [](const FrFinding& a, const FrFinding& b) {
    const bool sa = a.kind == FrFinding::Kind::stalled, sb = b.kind == FrFinding::Kind::stalled;
    if (sa != sb) return sb;
    const bool ka = a.index >= 0, kb = b.index >= 0;
    if (ka != kb) return ka;
    if (ka && std::make_tuple(a.step, a.index) != std::make_tuple(b.step, b.index)) return std::make_tuple(a.step, a.index) < std::make_tuple(b.step, b.index);
    return a.kind < b.kind;
  });
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
  out.text = text.str();
  return out;
}

}  // namespace spmdx::hooks
