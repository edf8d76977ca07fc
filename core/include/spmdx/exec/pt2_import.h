// Importing a PyTorch program: a torch.export archive (`torch.export.save(ep, "model.pt2")`,
// torch >= 2.9) becomes a spmdx forward Model, trained like the built-in ones: weights from
// the archive, the program's ATen ops mapped onto the IR (core/src/exec/pt2_import.cpp).
//
// What is read: the PT2 archive (archive_format "pt2", little-endian, serialization schema
// major 8), its one program models/<name>.json, and data/weights/ (raw bytes per storage).
// What is refused, each with an ImportError naming the file, the entry or node and what to do:
// archives of torch <= 2.8 (pickled weights), AOTInductor packages, dynamic shapes, pickled
// tensor subclasses, custom objects, higher-order ops, mutated buffers, unknown fields or
// union kinds in the JSON, truncated payloads, and ATen ops the IR has no mapping for (named
// with the node and the source line from its stack trace). The implementation needs LibTorch
// (its zip reader and the ATen schemas of c10::Dispatcher; a library's op LibTorch does not
// know, transformers' grouped_mm_fallback, binds by the schema the library declares); this
// header does not.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "spmdx/models/model.h"

namespace spmdx::models {

/// A .pt2 file spmdx cannot train: the message starts with the file's path.
class ImportError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// What a .pt2 file holds, as `spmdx import` prints it.
struct Pt2Summary {
  struct Tensor {
    std::string name;
    std::vector<std::int64_t> shape;
    std::string dtype;  ///< "f32", ..., or "complex64"
    std::int64_t bytes = 0;
  };
  struct Unsupported {
    std::string op;      ///< "aten.cumsum.default"
    std::string node;    ///< the node's name in the program ("cumsum")
    std::string source;  ///< "model.py:42: y = x.cumsum(-1)" from its stack trace ("" when none)
    std::string why;     ///< what to do
  };
  std::string path;
  std::string torch_version;   ///< of the writer ("2.15.0+cu132")
  std::string schema_version;  ///< "8.20"
  std::string verifier;        ///< "ATEN" (run_decompositions) or "TRAINING" (export)
  std::vector<Tensor> parameters;                           ///< trainable, one per storage
  std::vector<std::pair<std::string, std::string>> tied;    ///< (alias, the parameter it shares storage with)
  std::vector<Tensor> buffers;                              ///< buffers and lifted constants (frozen)
  std::vector<Tensor> inputs;                               ///< the program's user inputs
  std::vector<Tensor> outputs;                              ///< its user outputs
  std::map<std::string, int> ops;                           ///< ATen op -> nodes
  std::vector<Unsupported> unsupported;                     ///< nodes spmdx cannot map, in program order
  std::int64_t parameter_count() const;
  std::int64_t parameter_bytes() const;
};

/// Reads and checks the archive at `path` (format, schema, weights) and lists what it holds,
/// including every node spmdx cannot map. Throws ImportError for a file that is not a
/// readable torch >= 2.9 export archive.
Pt2Summary summarize_pt2(const std::string& path);

/// The program as a forward Model: graph inputs "tokens" and "labels" (i64 [batch, seq], as
/// exported), the parameters (named by their FQN; tied ones once, under the first name),
/// frozen buffers and constants; output "loss" (the program's scalar, or mean cross entropy
/// appended to its logits, as args.loss says). Constant subgraphs (rotary tables built in
/// forward, position ids) are computed once here with ATen. args.vocab_size is set to the
/// logits' class count. Throws ImportError.
Model import_pt2(const ModelArgs& args);

}  // namespace spmdx::models
