// Choosing comm backends by score (UCC's score map, ucc_team_build_score_map): every backend
// says in capabilities() which operations, memory types and sizes it serves and how well; the
// host picks, per call, the covering capability with the highest score. The config's
// [comm] backend = "auto" (the default) lets the host choose among every comm backend found
// here; a name ("ucx", "ucx:tls=tcp,self") pins one.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "spmdx/comm.h"

namespace spmdx {
class PluginRegistry;
struct PluginSpec;
}

namespace spmdx::comm {

/// The memory types a job on `device` ("cpu" or "cuda", training.device) moves: host for a CPU
/// job; CUDA first, then host, for a GPU job.
std::vector<MemoryType> job_memory(const std::string& device);

/// The operations a capability may name (besides "*"), in comm.h's order.
const std::vector<std::string>& comm_operations();

/// What is wrong with a backend's capability table, or "": none at all; an operation that is
/// neither "*" nor one of comm_operations() (with the nearest name); min_bytes above
/// max_bytes; a negative score. The host refuses such a backend (`spmdx plugins` exits 1,
/// spmdx run and "auto" say why), since a typo would otherwise silently never be chosen.
std::string capability_problem(const std::vector<CommCapability>& capabilities);

/// The index of the backend whose capability covers `op` on `memory` for `bytes` with the
/// highest score (the first listed of equal ones), or -1 when none covers it.
int choose_backend(const std::vector<std::vector<CommCapability>>& capabilities, const std::string& op, MemoryType memory, std::size_t bytes);

/// One CommBackend over several, each call going to choose_backend's pick. Sizes that
/// differ across ranks are not used to choose (every rank must pick the same backend):
/// all_gather picks by its output's bytes, reduce_scatter by its input's, all_to_all,
/// all_to_all_v and barrier by operation and memory alone (as if 0 bytes). Each member joins the job with its
/// own store generation ((index + 1) x 2^40 + generation), so their keys never meet each
/// other's nor those of a plain backend a hot-swap alternates with (generations 0, 1, 2, ...). Throws
/// std::invalid_argument from a call no member covers, naming the operation, memory and size.
std::unique_ptr<CommBackend> make_scored_backend(std::vector<std::pair<std::string, std::unique_ptr<CommBackend>>> members);

/// The capability tables of `backend`'s members, as choose_backend takes them: a scored
/// backend's, one per member in its order; any other backend's own, as one member.
std::vector<std::vector<CommCapability>> member_capabilities(const CommBackend& backend);

/// A backend found for "auto", or why it was left out.
struct Candidate {
  std::string name;
  std::unique_ptr<CommBackend> backend;  ///< null when left out
  std::string why_not;                   ///< "" when kept
};

/// What "auto" considers, in the order of their names (so equal scores go to the name first in
/// that order, wherever the plugins were found): every comm backend of the discovered plugins,
/// made with default options; left out are those whose factory throws (nccl without a CUDA
/// device), those whose capabilities are malformed (capability_problem), those of
/// in-process-only plugins when `processes` (ranks are processes), those that move none of
/// `memory`, and those that win no (operation, memory, size) against the others.
std::vector<Candidate> auto_candidates(PluginRegistry& registry, const std::vector<MemoryType>& memory, bool processes);

/// The backend of a job's comm.backend (or comm.swap_to) `spec`: "auto" as above (the one kept
/// itself when only one is, a scored backend over all kept ones otherwise), or the pinned
/// "name[:key=value;...]". Throws std::invalid_argument when "auto" keeps none, listing each
/// backend found and why it was left out, when a candidate's capabilities are malformed
/// (naming it), or when "auto" is given options ("auto:..."). With
/// `choice`, says what was made: the pinned spec, or "auto: ucx, nccl" (the backends kept), which
/// every rank of a job must agree on.
std::unique_ptr<CommBackend> make_job_backend(PluginRegistry& registry, const std::string& spec, const std::vector<MemoryType>& memory,
                                              bool processes, std::string* choice = nullptr);
/// The same for a spec already parsed (a job's CommSpec::parsed, made once by job_spec): `text`
/// is the spec as written, for messages and `choice`.
std::unique_ptr<CommBackend> make_job_backend(PluginRegistry& registry, const PluginSpec& parsed, const std::string& text, const std::vector<MemoryType>& memory,
                                              bool processes, std::string* choice = nullptr);

}  // namespace spmdx::comm
