// What `spmdx compile --dump` writes and `spmdx diff` compares: a compiled job as documents.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "spmdx/sharding/rewriter.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/preflight.h"
#include "spmdx/job/spec.h"

namespace spmdx::cli {

// The documents of a compiled job, as (file name, text): the logical graph (logical.json), the
// sharding plan (plan.json, with the pipeline stages and context parallelism when the job has
// them) and, for ranks 0 .. ranks-1, the rank graph (rankR.json) and its RuntimePlan
// (rankR.plan.json); with `everything`, the text forms (logical.txt, plan.txt, rankR.txt,
// rankR.plan.txt), the memory plans (rankR.memory.txt) and pipeline schedules too (`spmdx
// diff` reads only the JSON ones).
std::vector<std::pair<std::string, std::string>> dump_documents(const spmdx::job::PlacedJob& job, const spmdx::sharding::DistributedPlan& plan,
                                                                const spmdx::job::JobSpec& spec, std::int64_t ranks, bool everything);

}  // namespace spmdx::cli
