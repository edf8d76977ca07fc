// What a checkpoint folder (<job.dump_folder>/<checkpoint.folder>) holds, read from names and
// file types alone (no LibTorch: the launcher's checks use it before any rank starts; the
// checkpoints themselves are read by exec/checkpoint.h). spmdx writes each checkpoint as
// step-<N>/ (metadata.json last, renamed into place whole), so only those exact names count:
// torchtitan's re.search(r"step-(\d+)") would read "step-7junk" as step 7 and "step-02" as 2.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace spmdx::train {

/// The step of a folder name spmdx writes for a checkpoint: "step-<N>", N >= 1 in canonical
/// decimal (no sign, leading zero, space or suffix; at most 10 digits). nullopt for any other
/// name ("step-7junk", "step- 9", "step-02", "step-0").
std::optional<std::int64_t> checkpoint_step(const std::string& name);

/// The folder name of checkpoint `step`: "step-<step>".
std::string checkpoint_name(std::int64_t step);

/// The step folders found in a checkpoint folder.
struct CheckpointFolder {
  /// By step: the step-N folders whose metadata.json is a readable regular file.
  std::map<std::int64_t, std::filesystem::path> complete;
  /// By step: the step-N entries that are not (a folder without metadata.json, a dangling link,
  /// metadata.json a device or unreadable, step-N a file), each with why, a predicate: "has no metadata.json: damaged after it was saved?".
  std::map<std::int64_t, std::pair<std::filesystem::path, std::string>> broken;
  /// Names that start with "step-" but are not a name spmdx writes (see checkpoint_step).
  std::vector<std::filesystem::path> ignored;

  bool empty() const { return complete.empty() && broken.empty(); }
  /// The broken ones, each "<path> (<why>)", joined with "; ".
  std::string broken_text() const;
};

/// The step folders in `folder` (none when it is missing or not a folder). Never throws.
CheckpointFolder scan_checkpoints(const std::filesystem::path& folder);

/// What stops a resume from `found` (scanned in `folder`), "" when nothing does: load_step >= 0
/// names no complete checkpoint, or (load_step -1) step folders are there but none is complete.
/// Says which and what to do.
std::string resume_problem(const std::filesystem::path& folder, const CheckpointFolder& found, std::int64_t load_step);

/// What stops a resume from checkpoint `load_step` (>= 0) of `found` (scanned in `folder`) in a
/// run that saves checkpoints, "" when nothing does: complete checkpoints of later steps, which
/// that run's saves would replace (save_checkpoint refuses to, after training up to them). Names
/// them, and says to move them away or resume from the newest.
std::string newer_checkpoints_problem(const std::filesystem::path& folder, const CheckpointFolder& found, std::int64_t load_step);

/// Why checkpoints cannot be written in `folder`, "" when they can: it exists and is not a folder
/// (a file, FIFO, device or dangling link), or it cannot be made (a file on its path) or written.
std::string unusable_checkpoint_folder(const std::filesystem::path& folder);

}  // namespace spmdx::train
