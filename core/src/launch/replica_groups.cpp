#include "spmdx/launch/replica_groups.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace spmdx::launch::ft {

std::string members_text(const std::vector<GroupAttempt>& groups) {
  std::string out;
  for (const auto& g : groups) out += (out.empty() ? "" : ",") + g.str();
  return out;
}

std::vector<GroupAttempt> parse_members(const std::string& text) {
  std::vector<GroupAttempt> out;
  std::stringstream list(text);
  std::string item;
  while (std::getline(list, item, ',')) {
    const auto colon = item.find(':');
    std::size_t a = 0, b = 0;
    GroupAttempt g;
    try {
      if (colon == std::string::npos) throw std::invalid_argument(item);
      g.group = std::stoi(item.substr(0, colon), &a);
      g.attempt = std::stoi(item.substr(colon + 1), &b);
    } catch (const std::logic_error&) {
      a = 0;
    }
    if (a != colon || b != item.size() - colon - 1 || g.group < 0 || g.attempt < 0) {
      throw std::invalid_argument("replica group membership '" + text + "' is not \"group:attempt,...\"");
    }
    out.push_back(g);
  }
  std::sort(out.begin(), out.end());
  return out;
}

Membership read_membership(Store& store, double timeout_seconds) {
  Membership m;
  m.epoch = store.add(kEpochKey, 0);
  m.groups = parse_members(store.get(members_key(m.epoch), timeout_seconds));
  return m;
}

void publish_membership(Store& store, std::int64_t epoch, const std::vector<GroupAttempt>& groups) {
  store.set(members_key(epoch), members_text(groups));  // the record before the counter that points at it
  if (epoch > 0) store.add(kEpochKey, epoch - store.add(kEpochKey, 0));
}

std::string group_text(int group, int ranks_per_group) {
  const int first = group * ranks_per_group, last = first + ranks_per_group - 1;
  return "replica group " + std::to_string(group) + " (rank" + (first == last ? " " + std::to_string(first) : "s " + std::to_string(first) + "-" + std::to_string(last)) + ")";
}

}  // namespace spmdx::launch::ft
