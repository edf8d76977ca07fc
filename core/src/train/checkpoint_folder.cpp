#include "spmdx/train/checkpoint_folder.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "spmdx/files.h"

namespace spmdx::train {

namespace fs = std::filesystem;

std::optional<std::int64_t> checkpoint_step(const std::string& name) {
  if (name.rfind("step-", 0) != 0) return std::nullopt;
  const std::string digits = name.substr(5);
  if (digits.empty() || digits.size() > 10 || digits.front() == '0' || digits.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::stoll(digits);
}

std::string checkpoint_name(std::int64_t step) { return "step-" + std::to_string(step); }

std::string CheckpointFolder::broken_text() const {
  std::string out;
  for (const auto& [step, b] : broken) out += (out.empty() ? "" : "; ") + b.first.string() + " (" + b.second + ")";
  return out;
}

namespace {

// Why step folder `dir` is not a whole checkpoint, "" when its metadata.json can be read.
std::string incomplete(const fs::path& dir) {
  std::error_code ec;
  const auto link = fs::symlink_status(dir, ec);
  const auto st = fs::status(dir, ec);
  if (fs::is_symlink(link) && !fs::exists(st)) return "is a link to " + fs::read_symlink(dir, ec).string() + ", which does not exist";
  if (!fs::is_directory(st)) return "is not a folder";
  const fs::path m = dir / "metadata.json";
  const auto mlink = fs::symlink_status(m, ec);
  if (!fs::exists(mlink)) return "has no metadata.json: damaged after it was saved?";
  if (fs::is_symlink(mlink) && !fs::exists(fs::status(m, ec))) return "has a metadata.json that is a link to " + fs::read_symlink(m, ec).string() + ", which does not exist";
  if (const std::string why = unreadable_file(m); !why.empty()) return "has a metadata.json that cannot be read: " + why;
  return "";
}

}  // namespace

CheckpointFolder scan_checkpoints(const fs::path& folder) {
  CheckpointFolder out;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return out;
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) != 0) continue;
    const auto step = checkpoint_step(name);
    if (!step) {
      out.ignored.push_back(e.path());
      continue;
    }
    if (const std::string why = incomplete(e.path()); why.empty()) {
      out.complete[*step] = e.path();
    } else {
      out.broken[*step] = {e.path(), why};
    }
  }
  return out;
}

std::string resume_problem(const fs::path& folder, const CheckpointFolder& found, std::int64_t load_step) {
  if (load_step >= 0) {
    if (found.complete.count(load_step) != 0) return "";
    std::string complete;
    for (const auto& [step, path] : found.complete) complete += (complete.empty() ? "" : ", ") + std::to_string(step);
    const auto broken = found.broken.find(load_step);
    return "checkpoint.load_step " + std::to_string(load_step) + ": no complete checkpoint " + (folder / checkpoint_name(load_step)).string() +
           (broken != found.broken.end() ? " (" + broken->second.second + ")" : std::string(" (no such folder)")) + "; the complete ones there: " +
           (complete.empty() ? std::string("none") : "steps " + complete) + " (checkpoint.load_step -1 resumes from the newest)";
  }
  if (!found.complete.empty() || found.broken.empty()) return "";
  const bool one = found.broken.size() == 1;
  return "no checkpoint in " + folder.string() + " is complete, so there is nothing to resume: " + found.broken_text() + ". To start over at step 1, move " +
         (one ? "it" : "them") + " away; to resume from a good checkpoint, put it in " + folder.string() + " as step-<N> and set checkpoint.load_step <N>";
}

std::string newer_checkpoints_problem(const fs::path& folder, const CheckpointFolder& found, std::int64_t load_step) {
  std::vector<std::string> steps, paths;
  for (auto it = found.complete.upper_bound(load_step); it != found.complete.end(); ++it) {
    steps.push_back(std::to_string(it->first));
    paths.push_back(it->second.string());
  }
  if (steps.empty()) return "";
  std::string listed;  // "4", "4 and 6", "4, 6 and 8"
  for (std::size_t i = 0; i < steps.size(); ++i) listed += (i == 0 ? "" : i + 1 == steps.size() ? " and " : ", ") + steps[i];
  std::string where;
  for (const auto& p : paths) where += (where.empty() ? "" : ", ") + p;
  const bool one = steps.size() == 1;
  return "checkpoint.load_step " + std::to_string(load_step) + ": " + folder.string() + " also holds " + (one ? "a newer complete checkpoint, of step " : "newer complete checkpoints, of steps ") +
         listed + " (" + where + "), and this run, training on from step " + std::to_string(load_step) + " with checkpoint.enable, would save its own in " +
         (one ? "its" : "their") + " place. To train on from step " + std::to_string(load_step) + ", move " + (one ? "it" : "them") + " away first (out of " +
         folder.string() + "); to resume from the newest, step " + steps.back() + ", set checkpoint.load_step -1";
}

std::string unusable_checkpoint_folder(const fs::path& folder) {
  std::error_code ec;
  const auto link = fs::symlink_status(folder, ec);
  if (fs::exists(link)) {
    const auto st = fs::status(folder, ec);
    if (!fs::exists(st)) return "is a link to " + fs::read_symlink(folder, ec).string() + ", which does not exist";
    if (fs::is_regular_file(st)) return "is a file, not a folder";
    if (fs::is_fifo(st)) return "is a FIFO, not a folder";
    if (!fs::is_directory(st)) return "is not a folder (a device or socket)";
    if (::access(folder.c_str(), W_OK | X_OK) != 0) return std::string("is a folder this user cannot write: ") + std::strerror(errno);
    return "";
  }
  // Not there yet: the first save makes it, under its nearest existing parent.
  fs::path parent = folder.parent_path();
  while (!parent.empty() && !fs::exists(fs::symlink_status(parent, ec)) && parent != parent.parent_path()) parent = parent.parent_path();
  if (parent.empty()) parent = ".";
  if (!fs::is_directory(parent, ec)) return "cannot be made: " + parent.string() + " is not a folder";
  if (::access(parent.c_str(), W_OK | X_OK) != 0) return "cannot be made in " + parent.string() + ": " + std::strerror(errno);
  return "";
}

}  // namespace spmdx::train
