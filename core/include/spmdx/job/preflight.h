// The checks of a job before any rank starts: what `spmdx run` and `spmdx compile` find wrong
// in a config, each problem a line naming the key, where it was set and what to do.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "spmdx/config/config.h"
#include "spmdx/core/registry.h"
#include "spmdx/data/tokenizer.h"
#include "spmdx/job/spec.h"

namespace spmdx::job {

/// Checks what this build can run before any rank starts: training.device "cpu", data.paths
/// non-empty and every file present, and a swap schedule names what to swap to. Throws config::ConfigError naming the
/// key and what to do.
void check_runnable(const config::Config& cfg);

/// Reads and tokenizes the job's data as every rank will (so that a file without text, a JSON
/// Lines record without "text", or data shorter than seq_len + 1 tokens fails before any rank
/// starts), and checks that job.dump_folder can be made. Throws config::ConfigError or
/// std::runtime_error naming the file.
void check_data(const config::Config& cfg, const data::Tokenizer& tokenizer, const JobSpec& spec);

/// What a preflight is for: a run checks everything; a plan (`spmdx compile`) what planning
/// needs (no data files or comm backends; the hooks' options, but not their compile stages,
/// which compile runs itself).
enum class Preflight { run, plan };

/// Every check of a job that needs no rank, each problem collected (none stops the others that
/// do not depend on it): the tokenizer; job_spec; the plugins found; the strategies'
/// placements and rank 0's local shapes (what `spmdx compile` finds); and for a run also
/// check_runnable, the comm backends named by comm.backend and comm.swap_to when world_size > 1
/// (made, not initialised, so that each checks its options, and refused when none of their
/// capabilities moves the memory of training.device), and the hooks (every option of every
/// hook, then their compile stages, so that a validator's verdict comes before any rank
/// starts). Returns the messages, a line each, for Config::check; a hook option's names where
/// the config set it. `spec` and `tokenizer` are set when they could be made. Keys that already
/// have a problem in the config (Config::has_problem) are not checked again. `start_flag`: as
/// job_spec's.
std::vector<std::string> preflight(const config::Config& cfg, std::int64_t world_size, PluginRegistry& registry, std::unique_ptr<data::Tokenizer>* tokenizer,
                                   std::optional<JobSpec>* spec, Preflight what = Preflight::run, const std::string& start_flag = "");

/// "" when `spec_text` (comm.backend's form: "auto" or "name[:key=value;...]") names a comm
/// backend that can serve ranks in processes on `device` ("cpu" or "cuda"); else what is
/// wrong, worded to follow `key = "spec"`: not found (with the names found and a hint at
/// plugins.paths), an in-process-only plugin, options it refuses, malformed capabilities, memory
/// it does not move, or, for "auto", that none is found or that "auto" takes no options.
/// `made`/`choice`: when given and there is no problem, the backend made for the check (not
/// initialised) and what it is ("auto"'s choice, else spec_text), for the caller to join: a
/// rank makes each backend of its chain once. `parsed`: spec_text as JobSpec parsed it (made
/// from it, not parsed again), or nullptr.
std::string comm_backend_problem(PluginRegistry& registry, const std::string& spec_text, const std::string& device,
                                 std::unique_ptr<CommBackend>* made = nullptr, std::string* choice = nullptr, const PluginSpec* parsed = nullptr);

}  // namespace spmdx::job
