// The versioned JSON form of a Graph, with an exact round trip:
//   {"format": "spmdx.graph", "version": 1, "inputs": [...], "nodes": [...], "outputs": [...]}
// Reading re-runs shape inference and checks it against the recorded metas.
#pragma once

#include <string>

#include "spmdx/ir/graph.h"

namespace spmdx::ir {

/// The current schema version; readers accept this version and older ones.
inline constexpr int kGraphJsonVersion = 1;

std::string to_json(const Graph& graph, int indent = 1);
/// Throws IrError naming `source` (a file name, or "<string>") and the reason: not JSON, not a
/// spmdx graph, a newer version than this build reads, an unknown op, a dangling value id, or
/// a recorded meta that shape inference disagrees with.
Graph from_json(const std::string& text, const std::string& source = "<string>");

}  // namespace spmdx::ir
