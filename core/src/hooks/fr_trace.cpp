#include "spmdx/hooks/fr_trace.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "spmdx/core/text.h"

namespace spmdx::hooks {
namespace {

using nlohmann::json;

struct Entry {
  std::string op, dtype, value, state, error;
  std::vector<std::int64_t> shape;
  std::int64_t bytes = 0, step = 0;
  std::uint64_t seq = 0;
  std::string signature() const {
    std::string s = op + " " + dtype + "[";
    for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "] (" + human_bytes(static_cast<double>(bytes)) + ")";
  }
  std::string describe() const { return signature() + " producing " + value + " in step " + std::to_string(step); }
};

}  // namespace

FrAnalysis analyze_flight_recorder(const std::filesystem::path& folder) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) throw std::runtime_error(folder.string() + ": no such folder (the flight_recorder hook writes <job.dump_folder>/hooks/flight_recorder)");
  // group key -> rank -> seq -> entry
  using Key = std::pair<std::string, std::vector<int>>;  // name, ranks
  std::map<Key, std::map<int, std::map<std::uint64_t, Entry>>> groups;
  FrAnalysis out;
  int world_size = 0;
  std::map<int, std::string> reasons;
  std::map<int, std::string> file_of;  // rank -> its dump
  std::map<int, std::vector<std::string>> by_world;  // world_size -> files
  for (const auto& file : fs::directory_iterator(folder)) {
    const std::string name = file.path().filename().string();
    if (name.rfind("rank", 0) != 0 || file.path().extension() != ".json") continue;
    json doc;
    try {
      std::ifstream in(file.path());
      doc = json::parse(in);
      if (!doc.is_object() || doc.value("format", "") != "spmdx-flight-recorder-1") throw std::runtime_error("no format \"spmdx-flight-recorder-1\"");
      const int rank = doc.at("rank").get<int>();
      const int ws = doc.at("world_size").get<int>();
      if (rank < 0 || ws < 1 || rank >= ws) throw std::runtime_error("rank " + std::to_string(rank) + " of world_size " + std::to_string(ws));
      if (auto [it, fresh] = file_of.emplace(rank, file.path().string()); !fresh) {
        throw std::runtime_error("rank " + std::to_string(rank) + " also dumped " + it->second + "; keep one dump per rank");
      }
      world_size = std::max(world_size, ws);
      by_world[ws].push_back(name);
      reasons[rank] = doc.value("reason", "");
      out.dumped.push_back(rank);
      for (const auto& e : doc.at("entries")) {
        Entry x;
        x.op = e.at("op");
        x.dtype = e.at("dtype");
        x.value = e.at("value");
        x.state = e.at("state");
        x.error = e.value("error", "");
        x.shape = e.at("shape").get<std::vector<std::int64_t>>();
        x.bytes = e.at("bytes");
        x.step = e.at("step");
        x.seq = e.at("seq");
        groups[{e.at("group_name").get<std::string>(), e.at("group_ranks").get<std::vector<int>>()}][rank][x.seq] = x;
      }
    } catch (const std::exception& e) {
      throw std::runtime_error(file.path().string() + ": not a valid flight recorder dump (" + e.what() +
                               "); the flight_recorder hook writes them: remove the file or re-run");
    }
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
  std::vector<FrFinding> mismatches, stalls;
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
    for (int r : members) {
      auto it = by_rank.find(r);
      if (it == by_rank.end() || it->second.empty()) continue;
      lo = std::max(lo, it->second.begin()->first);  // older entries fell out of some ring buffer
      for (const auto& [q, e] : it->second) seqs.insert(q);
    }
    const std::string no_dump = undumped.empty() ? "" : " " + rank_list(undumped) + " of this group left no dump (it exited, died or was stopped before dumping): it may be the one missing.";
    auto entry = [&](int r, std::uint64_t s) -> const Entry* {
      auto it = by_rank.find(r);
      if (it == by_rank.end()) return nullptr;
      auto e = it->second.find(s);
      return e == it->second.end() ? nullptr : &e->second;
    };
    bool found = false;
    for (auto sit = seqs.lower_bound(lo); sit != seqs.end() && !found; ++sit) {
      const std::uint64_t s = *sit;
      std::map<std::string, std::vector<int>> by_sig;
      std::vector<int> absent;
      for (int r : members) {
        if (const Entry* e = entry(r, s)) by_sig[e->signature()].push_back(r);
        else absent.push_back(r);
      }
      if (by_sig.empty()) continue;
      auto majority = std::max_element(by_sig.begin(), by_sig.end(), [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
      const Entry& ref = *entry(majority->second.front(), s);
      if (!absent.empty()) {
        std::ostringstream m;
        m << "group " << group << ", collective #" << s << ": " << rank_list(absent) << " never issued it; " << rank_list(majority->second) << " issued "
          << ref.describe() << " (state " << ref.state << ").";
        for (int r : absent) {
          auto it = by_rank.find(r);
          if (it != by_rank.end() && !it->second.empty()) {
            const Entry& last = it->second.rbegin()->second;
            m << " Rank " << r << "'s last collective on this group is #" << last.seq << " (" << last.describe() << ", " << last.state << ")"
              << (last.state == "completed" ? ": when it dumped it was computing, stuck outside collectives, or had skipped this one." : ".");
          } else {
            m << " Rank " << r << " recorded no collective on this group.";
          }
        }
        m << no_dump;
        mismatches.push_back({group, s, absent, m.str()});
        found = true;
      } else if (by_sig.size() > 1) {
        std::vector<int> odd;
        std::ostringstream m;
        m << "group " << group << ", collective #" << s << ": the ranks disagree on what it is: " << rank_list(majority->second) << " issued " << ref.describe();
        for (const auto& [sig, ranks] : by_sig) {
          if (sig == majority->first) continue;
          odd.insert(odd.end(), ranks.begin(), ranks.end());
          const Entry& e = *entry(ranks.front(), s);
          m << "; " << rank_list(ranks) << " issued " << e.describe();
          // A skipped collective: the odd rank never produced the value the others' #s produces
          // (a value's name is the same on every rank: all rank graphs have the same nodes).
          bool issued_elsewhere = false;
          for (const auto& [q, other] : by_rank.at(ranks.front())) issued_elsewhere |= other.value == ref.value && other.step == ref.step;
          if (!issued_elsewhere && e.value != ref.value) {
            m << ": " << rank_list(ranks) << " skipped the collective producing " << ref.value << " in step " << ref.step << " and went on to the next one";
          }
        }
        m << ". Every rank of a group must issue the same collectives in the same order.";
        mismatches.push_back({group, s, odd, m.str()});
        found = true;
      } else {
        std::vector<int> pending;
        std::string errors;
        for (int r : members) {
          const Entry& e = *entry(r, s);
          if (e.state == "completed") continue;
          pending.push_back(r);
          if (!e.error.empty() && errors.empty()) errors = " (rank " + std::to_string(r) + ": " + e.error + ")";
        }
        if (!pending.empty()) {
          if (undumped.empty()) {
            stalls.push_back({group, s, pending,
                              "group " + group + ", collective #" + std::to_string(s) + " (" + ref.describe() + "): every rank issued it, it did not complete on " +
                                  rank_list(pending) + errors + "."});
          } else {
            stalls.push_back({group, s, undumped,
                              "group " + group + ", collective #" + std::to_string(s) + " (" + ref.describe() + "): " + rank_list(members) +
                                  " issued it, it did not complete on " + rank_list(pending) + errors + "." + no_dump});
          }
          found = true;
        }
      }
    }
  }
  out.findings = mismatches;
  out.findings.insert(out.findings.end(), stalls.begin(), stalls.end());
  std::ostringstream text;
  text << "flight recorder dumps in " << folder.string() << ": " << rank_list(out.dumped);
  if (!out.no_dump.empty()) text << "; no dump from " << rank_list(out.no_dump) << " (it died before dumping, or its disk is elsewhere)";
  text << "\n";
  for (const auto& [r, why] : reasons) text << "  rank " << r << " dumped on: " << why << "\n";
  if (out.findings.empty()) {
    text << "no mismatch: the ranks with dumps issued the same collectives in the same order, and the last ones completed\n";
  } else {
    for (const auto& f : out.findings) text << "- " << f.message << "\n";
  }
  out.text = text.str();
  return out;
}

}  // namespace spmdx::hooks
