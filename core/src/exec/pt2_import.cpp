// The .pt2 importer (spmdx/exec/pt2_import.h). Three parts:
//   1. Archive: the zip (LibTorch's PyTorchStreamReader, which strips the archive's top
//      folder), its JSON read strictly (every object's fields and every union's kind checked
//      against torch/_export/serde/schema.py, major 8; every value read through JsonAt, which
//      names the JSON pointer of one of the wrong type), and the weights rebuilt from raw
//      bytes with their sizes, strides and storage offset. Cached per file for the process.
//   2. Binding: each node's arguments bound by name to the op's ATen schema from
//      c10::Dispatcher, which also gives the defaults the file leaves out.
//   3. Mapping: node by node onto the IR. Nodes whose tensor inputs are all frozen (buffers,
//      constants, their products) run once here, boxed through the dispatcher (constant
//      folding); torchtitan's complex rotary pattern becomes rotary_embedding; the rest map
//      op by op (the table in map_node).
#include "spmdx/exec/pt2_import.h"
#include "spmdx/text.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/frontend/function_schema_parser.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>

#include "spmdx/exec/dtype.h"
#include "spmdx/exec/kernels.h"
#include "../json_at.h"

namespace spmdx::models {
namespace {

using json = nlohmann::json;
using Shape = std::vector<std::int64_t>;

// ---------------------------------------------------------------------------------------------
// 1. The archive

struct Fail {
  std::string path;
  [[noreturn]] void operator()(const std::string& what) const { throw ImportError(path + ": " + what); }
};

// The object's fields must be among `known` (schema.py's dataclass fields): a newer writer's
// field is an error, not a silent default.
void only_fields(const Fail& fail, const JsonAt& j, std::initializer_list<const char*> known, const std::string& what) {
  if (!j.is_object()) fail(what + " (" + j.where() + ") is not a JSON object");
  for (const auto& [key, value] : j.raw().items()) {
    bool ok = false;
    for (const char* k : known) ok = ok || key == k;
    if (!ok) fail("unknown field '" + key + "' in " + what + " (written by a newer torch than spmdx reads?)");
  }
}

JsonAt field(const Fail& fail, const JsonAt& j, const char* key, const std::string& what) {
  if (!j.has(key)) fail(what + " (" + j.where() + ") has no field '" + key + "'");
  return j[key];
}

// The elements of optional array member `key`; none when it is absent or null.
std::vector<JsonAt> optional_list(const JsonAt& j, const char* key) {
  const auto v = j.find(key);
  return v ? v->elements() : std::vector<JsonAt>{};
}

// A one-key union object: its kind, checked against `kinds`.
std::string union_kind(const Fail& fail, const JsonAt& j, std::initializer_list<const char*> kinds, const std::string& what) {
  if (!j.is_object() || j.size() != 1) fail(what + " (" + j.where() + ") must be an object with exactly one key, not " + j.shown());
  const std::string kind = j.raw().begin().key();
  for (const char* k : kinds) {
    if (kind == k) return kind;
  }
  fail("unknown kind '" + kind + "' of " + what);
}

// schema.py's ScalarType codes.
std::optional<at::ScalarType> scalar_type(std::int64_t code) {
  switch (code) {
    case 1: return at::kByte;
    case 2: return at::kChar;
    case 3: return at::kShort;
    case 4: return at::kInt;
    case 5: return at::kLong;
    case 6: return at::kHalf;
    case 7: return at::kFloat;
    case 8: return at::kDouble;
    case 9: return at::kComplexHalf;
    case 10: return at::kComplexFloat;
    case 11: return at::kComplexDouble;
    case 12: return at::kBool;
    case 13: return at::kBFloat16;
    default: return std::nullopt;
  }
}

struct Meta {
  at::ScalarType dtype = at::kFloat;
  Shape sizes, strides;
  std::int64_t storage_offset = 0;
  bool requires_grad = false;
};

// A whole number in int64's range: nlohmann's get<int64_t> of 1e30 is undefined (it read as a
// negative size), of 2.5 truncates.
std::int64_t whole(const Fail& fail, const JsonAt& v, const std::string& what) {
  if (!v.is_whole()) fail(what + " is " + v.shown() + ", not a whole number: the file is damaged");
  return v.whole();
}

std::int64_t sym_int(const Fail& fail, const JsonAt& j, const std::string& what) {
  const std::string kind = union_kind(fail, j, {"as_int", "as_expr"}, what);
  if (kind == "as_expr") {
    fail(what + " is symbolic (" + j["as_expr"].str_or("expr_str", "?") +
         "): the program was exported with dynamic shapes; spmdx trains static ones: export without dynamic_shapes");
  }
  return whole(fail, j["as_int"], what);
}

Meta tensor_meta(const Fail& fail, const JsonAt& j, const std::string& what) {
  only_fields(fail, j, {"dtype", "sizes", "requires_grad", "device", "strides", "storage_offset", "layout"}, what);
  Meta m;
  const auto code = whole(fail, field(fail, j, "dtype", what), what + " dtype");
  auto t = scalar_type(code);
  if (!t) fail(what + " has dtype code " + std::to_string(code) + ", which spmdx does not read");
  m.dtype = *t;
  for (const auto& s : field(fail, j, "sizes", what).elements()) m.sizes.push_back(sym_int(fail, s, what + " sizes"));
  for (const auto& s : field(fail, j, "strides", what).elements()) m.strides.push_back(sym_int(fail, s, what + " strides"));
  m.storage_offset = sym_int(fail, field(fail, j, "storage_offset", what), what + " storage_offset");
  if (m.sizes.size() != m.strides.size()) fail(what + " has " + std::to_string(m.sizes.size()) + " sizes but " + std::to_string(m.strides.size()) + " strides: the file is damaged");
  double numel = 1;
  for (auto d : m.sizes) {
    if (d < 0) fail(what + " has a negative size " + ir::shape_str(m.sizes) + ": the file is damaged");
    numel *= static_cast<double>(d);
  }
  if (numel > 9e15 || m.storage_offset < 0) fail(what + " has sizes " + ir::shape_str(m.sizes) + " and offset " + std::to_string(m.storage_offset) + " no tensor can have: the file is damaged");
  m.requires_grad = j.bool_or("requires_grad", false);
  if (j.whole_or("layout", 7) != 7) fail(what + " is not a strided (dense) tensor; spmdx reads dense tensors only");
  return m;
}

struct Archive {
  std::string path;
  std::string model;  // the program's name in the archive ("model")
  json program;
  std::map<std::string, at::Tensor> tensors;   // fqn -> the tensor, contiguous
  std::map<std::string, std::string> storage;  // fqn -> its payload ("weights/weight_0")
  std::map<std::string, bool> is_param;
  std::map<std::string, Meta> meta;  // fqn -> its tensor_meta in the payload config
  std::uintmax_t file_bytes = 0;
};

std::string record_text(caffe2::serialize::PyTorchStreamReader& reader, const std::string& name) {
  auto [data, size] = reader.getRecord(name);
  return std::string(static_cast<const char*>(data.get()), size);
}

// One payload folder (weights or constants) of the archive.
void read_payloads(const Fail& fail, caffe2::serialize::PyTorchStreamReader& reader, Archive& a, const std::string& folder) {
  const std::string config_name = "data/" + folder + "/" + a.model + "_" + folder + "_config.json";
  if (!reader.hasRecord(config_name)) {
    if (folder == "weights" && reader.hasRecord("data/weights/" + a.model + ".pt")) {
      fail("its weights are pickled (data/weights/" + a.model + ".pt): it was written by torch 2.8 or older; load and save it again with torch >= 2.9");
    }
    if (folder == "constants") return;  // a program without constants may have none
    fail("it has no " + config_name + "; is it a torch.export archive?");
  }
  json config;
  const std::string config_text = record_text(reader, config_name);
  try {
    check_json_nesting(config_text);
    config = json::parse(config_text);
  } catch (const std::exception& e) {
    fail(config_name + " is not valid JSON: " + e.what());
  }
  const JsonAt root(config, config_name);
  only_fields(fail, root, {"config"}, config_name);
  std::map<std::string, at::Tensor> storages;
  for (const auto& [fqn, payload] : field(fail, root, "config", config_name).members()) {
    const std::string what = config_name + " entry '" + fqn + "'";
    only_fields(fail, payload, {"path_name", "is_param", "use_pickle", "tensor_meta"}, what);
    if (payload.bool_or("use_pickle", false)) {
      fail("'" + fqn + "' is stored pickled (a tensor subclass or a custom object, e.g. a DTensor); spmdx reads plain tensors: export the model with plain parameters");
    }
    const std::string path_name = field(fail, payload, "path_name", what).str();
    const JsonAt tm = field(fail, payload, "tensor_meta", what);
    if (tm.is_null()) fail(what + " has no tensor_meta");
    const Meta m = tensor_meta(fail, tm, what + " tensor_meta");
    const std::string record = "data/" + folder + "/" + path_name;
    auto it = storages.find(path_name);
    if (it == storages.end()) {
      if (!reader.hasRecord(record)) fail("'" + fqn + "' names payload " + record + ", which the archive lacks");
      const std::size_t size = reader.getRecordSize(record);
      if (size > a.file_bytes) {
        fail("payload " + record + " unpacks to " + std::to_string(size) + " bytes, more than the whole file's " + std::to_string(a.file_bytes) +
             ": it is compressed, which torch.export.save never does; save the program again with torch.export.save");
      }
      const auto elem = static_cast<std::size_t>(c10::elementSize(m.dtype));
      if (size % elem != 0) fail("payload " + record + " of '" + fqn + "' has " + std::to_string(size) + " bytes, not a whole number of " + c10::toString(m.dtype) + " elements (truncated?)");
      at::Tensor storage = at::empty({static_cast<std::int64_t>(size / elem)}, at::TensorOptions().dtype(m.dtype));
      if (size > 0) reader.getRecord(record, storage.data_ptr(), size);  // straight into the tensor: the file's bytes are held once
      it = storages.emplace(path_name, storage).first;
    }
    const at::Tensor& storage = it->second;
    if (storage.scalar_type() != m.dtype) fail("'" + fqn + "' reads payload " + record + " as " + c10::toString(m.dtype) + ", another tensor as " + c10::toString(storage.scalar_type()));
    std::int64_t extent = m.storage_offset + 1;  // one past the last element used
    bool empty = false;
    for (std::size_t d = 0; d < m.sizes.size(); ++d) {
      if (m.sizes[d] == 0) empty = true;
      extent += (m.sizes[d] - 1) * m.strides.at(d);
    }
    if (!empty && extent > storage.numel()) {
      fail("payload " + record + " holds " + std::to_string(storage.numel()) + " elements but '" + fqn + "' " + ir::shape_str(m.sizes) +
           " needs " + std::to_string(extent) + ": the file is truncated or damaged; save it again");
    }
    at::Tensor view = storage.as_strided(m.sizes, m.strides, m.storage_offset);
    // The whole storage in order (the usual case) is used as is; a view of part of it is copied.
    a.tensors[fqn] = view.is_contiguous() && m.storage_offset == 0 && view.numel() == storage.numel() ? view : view.clone(at::MemoryFormat::Contiguous);
    a.storage[fqn] = folder + "/" + path_name;
    a.meta[fqn] = m;
    a.is_param[fqn] = payload.bool_or("is_param", false);
  }
}

std::shared_ptr<const Archive> read_archive(const std::string& path) {
  const Fail fail{path};
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) fail("no such file (give the path of a .pt2 file that torch.export.save wrote)");
  if (!std::filesystem::is_regular_file(path, ec)) fail("not a regular file (give the path of a .pt2 file that torch.export.save wrote)");
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
  try {
    reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
  } catch (const c10::Error& e) {
    const std::string why = e.what_without_backtrace();
    // torch <= 2.7 wrote a plain zip without the archive's top folder.
    for (const char* old : {"serialized_exported_program.json", "serialized_state_dict.pt", "serialized_constants.pt", "serialized_example_inputs.pt"}) {
      if (why.find(std::string("not in a subdirectory: ") + old) != std::string::npos) {
        fail("it was written by torch 2.7 or older (" + std::string(old) + " at the top of a plain zip); load and save it again with torch >= 2.9");
      }
    }
    fail("not a readable PT2 archive (a zip file from torch.export.save): " + why);
  }
  auto a = std::make_shared<Archive>();
  a->path = path;
  a->file_bytes = std::filesystem::file_size(path, ec);
  try {
    if (reader->hasRecord("serialized_exported_program.json")) {
      fail("it was written by torch 2.7 or older (serialized_exported_program.json); load and save it again with torch >= 2.9");
    }
    if (!reader->hasRecord("archive_format")) fail("it has no archive_format record: not a PT2 archive from torch.export.save");
    if (const std::string f = record_text(*reader, "archive_format"); f != "pt2") fail("archive_format is " + json(f).dump() + ", not \"pt2\"");
    if (reader->hasRecord("byteorder")) {
      if (const std::string b = record_text(*reader, "byteorder"); b != "little") fail("byteorder is " + json(b).dump() + "; spmdx reads little-endian archives");
    }
    std::vector<std::string> programs;
    for (const auto& r : reader->getAllRecords()) {
      if (r.rfind("data/aotinductor/", 0) == 0) {
        fail("it is an AOTInductor package (compiled for inference, data/aotinductor/); spmdx trains torch.export programs: save with torch.export.save(ep, path)");
      }
      if (r.rfind("models/", 0) == 0 && r.size() > 12 && r.compare(r.size() - 5, 5, ".json") == 0) programs.push_back(r);
    }
    if (programs.empty()) fail("it holds no program (models/*.json)");
    if (programs.size() > 1) fail("it holds " + std::to_string(programs.size()) + " programs (" + programs[0] + ", " + programs[1] + ", ...); spmdx trains one: save one ExportedProgram per file");
    a->model = programs[0].substr(7, programs[0].size() - 12);
    const std::string program_text = record_text(*reader, programs[0]);
    try {
      check_json_nesting(program_text);
      a->program = json::parse(program_text);
    } catch (const std::exception& e) {
      fail(programs[0] + " is not valid JSON: " + e.what());
    }
    read_payloads(fail, *reader, *a, "weights");
    read_payloads(fail, *reader, *a, "constants");
  } catch (const c10::Error& e) {
    fail(std::string("reading the archive failed (corrupt or truncated?): ") + e.what_without_backtrace());
  }
  return a;
}

std::mutex cache_mu;
std::map<std::string, std::pair<std::string, std::shared_ptr<const Archive>>> cache;  // path -> (size@mtime, archive)

std::shared_ptr<const Archive> archive(const std::string& path) {
  auto& mu = cache_mu;
  std::error_code ec;
  const auto stamp = std::to_string(std::filesystem::file_size(path, ec)) + "@" +
                     std::to_string(std::filesystem::last_write_time(path, ec).time_since_epoch().count());
  std::lock_guard<std::mutex> lock(mu);
  auto& entry = cache[path];
  if (entry.second == nullptr || entry.first != stamp) entry = {stamp, read_archive(path)};
  return entry.second;
}

// ---------------------------------------------------------------------------------------------
// The program's JSON, checked

struct Program {
  JsonAt graph;
  std::map<std::string, Meta> values;  // tensor_values
  struct Input {
    std::string kind;  // parameter, buffer, tensor_constant, user_input
    std::string arg;   // the graph's name for it
    std::string fqn;   // parameter_name / buffer_name / tensor_constant_name
  };
  std::vector<Input> inputs;
  std::vector<std::string> outputs;  // user outputs' value names
  std::string torch_version, schema_version, verifier;
};

void check_argument(const Fail& fail, const JsonAt& arg, const std::string& what);

Program read_program(const Archive& a) {
  const Fail fail{a.path};
  const std::string file = "models/" + a.model + ".json";
  const JsonAt ep(a.program, file);
  only_fields(fail, ep, {"graph_module", "opset_version", "range_constraints", "schema_version", "verifiers", "torch_version", "guards_code"}, file);
  Program p;
  const JsonAt sv = field(fail, ep, "schema_version", file);
  only_fields(fail, sv, {"major", "minor"}, file + " schema_version");
  const auto major = sv.has("major") ? whole(fail, sv["major"], file + " schema_version major") : 0;
  p.schema_version = std::to_string(major) + "." + std::to_string(sv.has("minor") ? whole(fail, sv["minor"], file + " schema_version minor") : 0);
  p.torch_version = ep.str_or("torch_version", "?");
  if (major != 8) {
    fail("serialization schema " + p.schema_version + " (torch " + p.torch_version + "); spmdx reads schema 8 (torch 2.9 and later): save it again with torch >= 2.9");
  }
  for (const auto& v : optional_list(ep, "verifiers")) {
    const std::string& name = v.str();
    if (name != "ATEN" && name != "TRAINING") fail("verifier \"" + name + "\": spmdx reads ATen programs (torch.export.export, optionally .run_decompositions())");
    p.verifier = name;
  }
  // range_constraints alone do not make a program dynamic (an example input that is a view
  // leaves some behind); a symbolic size or value does, and is refused where it is read.
  const JsonAt gm = field(fail, ep, "graph_module", file);
  only_fields(fail, gm, {"graph", "signature", "module_call_graph", "metadata", "treespec_namedtuple_fields"}, file + " graph_module");
  const JsonAt g = field(fail, gm, "graph", file + " graph_module");
  only_fields(fail, g, {"inputs", "outputs", "nodes", "tensor_values", "sym_int_values", "sym_bool_values", "is_single_tensor_return", "custom_obj_values", "sym_float_values"},
              file + " graph");
  for (const char* k : {"sym_int_values", "sym_bool_values", "sym_float_values"}) {
    if (const auto v = g.find(k); v && v->object().size() > 0) fail("the program has symbolic values (" + std::string(k) + "): it was exported with dynamic shapes; export without dynamic_shapes");
  }
  if (const auto v = g.find("custom_obj_values"); v && v->object().size() > 0) fail("the program holds custom objects (torchbind); spmdx trains programs of ATen ops on tensors");
  p.graph = g;
  for (const auto& [name, meta] : field(fail, g, "tensor_values", file + " graph").members()) p.values[name] = tensor_meta(fail, meta, "tensor_values['" + name + "']");
  const JsonAt sig = field(fail, gm, "signature", file + " graph_module");
  only_fields(fail, sig, {"input_specs", "output_specs"}, file + " signature");
  for (const auto& spec : field(fail, sig, "input_specs", file + " signature").elements()) {
    const std::string kind = union_kind(fail, spec, {"user_input", "parameter", "buffer", "tensor_constant", "custom_obj", "token", "constant_input"}, "input spec");
    const JsonAt s = spec[kind];
    Program::Input in{kind, "", ""};
    if (kind == "user_input") {
      only_fields(fail, s, {"arg"}, "user_input spec");
      const JsonAt arg = field(fail, s, "arg", "user_input spec");
      if (union_kind(fail, arg, {"as_tensor", "as_none", "as_int", "as_float", "as_bool", "as_string", "as_sym_int", "as_ints"}, "user input") != "as_tensor") {
        fail("user input " + arg.shown() + " is not a tensor; spmdx feeds tokens and labels: export a forward(tokens[, labels]) of tensors only");
      }
      in.arg = arg["as_tensor"]["name"].str();
    } else if (kind == "parameter") {
      only_fields(fail, s, {"arg", "parameter_name"}, "parameter spec");
      in.arg = field(fail, s, "arg", "parameter spec")["name"].str();
      in.fqn = field(fail, s, "parameter_name", "parameter spec").str();
    } else if (kind == "buffer") {
      only_fields(fail, s, {"arg", "buffer_name", "persistent"}, "buffer spec");
      in.arg = field(fail, s, "arg", "buffer spec")["name"].str();
      in.fqn = field(fail, s, "buffer_name", "buffer spec").str();
    } else if (kind == "tensor_constant") {
      only_fields(fail, s, {"arg", "tensor_constant_name"}, "tensor_constant spec");
      in.arg = field(fail, s, "arg", "tensor_constant spec")["name"].str();
      in.fqn = field(fail, s, "tensor_constant_name", "tensor_constant spec").str();
    } else if (kind == "constant_input") {
      fail("the program takes a non-tensor input ('" + s.str_or("name", "?") + "'); export a forward(tokens[, labels]) of tensors only");
    } else {
      fail("the program takes a " + kind + " input; spmdx trains programs of ATen ops on tensors (export without custom objects or effect tokens)");
    }
    p.inputs.push_back(in);
  }
  for (const auto& spec : field(fail, sig, "output_specs", file + " signature").elements()) {
    const std::string kind = union_kind(fail, spec, {"user_output", "loss_output", "buffer_mutation", "gradient_to_parameter", "gradient_to_user_input",
                                                     "user_input_mutation", "token", "parameter_mutation"},
                                        "output spec");
    if (kind != "user_output" && kind != "loss_output") {
      fail("the program has a " + kind + " output (it changes a buffer, parameter or input in place, as BatchNorm's running stats do); spmdx trains programs without mutation");
    }
    const JsonAt arg = field(fail, spec[kind], "arg", kind + " spec");
    if (kind == "loss_output") {
      p.outputs.push_back(arg["name"].str());
    } else if (union_kind(fail, arg, {"as_tensor", "as_none", "as_int", "as_float", "as_bool", "as_string", "as_sym_int", "as_ints", "as_tensors"}, "user output") == "as_tensor") {
      p.outputs.push_back(arg["as_tensor"]["name"].str());
    } else {
      fail("the program returns " + arg.shown() + "; return the loss or the logits, one tensor");
    }
  }
  for (const auto& node : field(fail, g, "nodes", file + " graph").elements()) {
    const std::string what = "node '" + node.str_or("name", "?") + "'";
    only_fields(fail, node, {"target", "inputs", "outputs", "metadata", "is_hop_single_tensor_return", "name"}, what);
    field(fail, node, "target", what).str();
    for (const auto& in : field(fail, node, "inputs", what).elements()) {
      only_fields(fail, in, {"name", "arg", "kind"}, what + " input");
      const std::string name = field(fail, in, "name", what + " input").str();
      if (const auto kind = in.find("kind")) {
        const auto k = kind->whole();
        if (k != 1 && k != 2) fail(what + " input '" + name + "' has argument kind " + std::to_string(k) + " (1 positional, 2 keyword)");
      }
      check_argument(fail, field(fail, in, "arg", what + " input"), what + " input '" + name + "'");
    }
    for (const auto& out : field(fail, node, "outputs", what).elements()) check_argument(fail, out, what + " output");
  }
  return p;
}

const std::initializer_list<const char*> kArgumentKinds = {
    "as_none", "as_tensor", "as_tensors", "as_int", "as_ints", "as_float", "as_floats", "as_string", "as_strings", "as_sym_int", "as_sym_ints",
    "as_scalar_type", "as_memory_format", "as_layout", "as_device", "as_bool", "as_bools", "as_sym_bool", "as_sym_bools", "as_graph",
    "as_optional_tensors", "as_custom_obj", "as_operator", "as_sym_float", "as_sym_floats", "as_optional_tensor", "as_complex",
    "as_nested_tensors", "as_int_lists", "as_string_to_argument", "as_float_lists"};

void check_argument(const Fail& fail, const JsonAt& arg, const std::string& what) { union_kind(fail, arg, kArgumentKinds, what); }

// "model.py:42: y = x.cumsum(-1)" from a node's stack trace: its last frame.
std::string source_line(const JsonAt& node) {
  const auto md = node.is_object() ? node.find("metadata") : std::nullopt;
  if (!md || !md->is_object() || !md->has("stack_trace") || !(*md)["stack_trace"].is_string()) return "";  // for messages: a damaged trace is not one
  const std::string& trace = (*md)["stack_trace"].str();
  // The innermost frame of the user's code: frames in torch itself (nn.Dropout's forward) say less.
  auto at = trace.rfind("File \"");
  for (auto f = at; f != std::string::npos && f > 0; f = trace.rfind("File \"", f - 1)) {
    const auto end = trace.find('"', f + 6);
    const std::string file = trace.substr(f + 6, end - f - 6);
    if (file.find("/site-packages/torch/") == std::string::npos && file.find("/dist-packages/torch/") == std::string::npos) {
      at = f;
      break;
    }
  }
  if (at == std::string::npos) return "";
  const auto end_file = trace.find('"', at + 6);
  const auto line_at = trace.find("line ", end_file);
  if (end_file == std::string::npos || line_at == std::string::npos) return "";
  const std::string file = std::filesystem::path(trace.substr(at + 6, end_file - at - 6)).filename().string();
  const std::string line = trace.substr(line_at + 5, trace.find_first_not_of("0123456789", line_at + 5) - line_at - 5);
  std::string code;
  if (const auto nl = trace.find('\n', line_at); nl != std::string::npos) {
    code = trace.substr(nl + 1, trace.find('\n', nl + 1) - nl - 1);
    code.erase(0, code.find_first_not_of(' '));
    if (code.size() > 160) code = code.substr(0, 157) + "...";
  }
  return file + ":" + line + (code.empty() ? "" : ": " + code);
}

// "torch.ops.aten.add.Tensor" -> ("aten::add", "Tensor"); "default" is the unnamed overload.
std::pair<std::string, std::string> op_name(const std::string& target) {
  std::string t = target.rfind("torch.ops.", 0) == 0 ? target.substr(10) : target;
  const auto dot1 = t.find('.');
  const auto dot2 = t.rfind('.');
  if (dot1 == std::string::npos || dot1 == dot2) return {t, ""};
  const std::string overload = t.substr(dot2 + 1);
  return {t.substr(0, dot1) + "::" + t.substr(dot1 + 1, dot2 - dot1 - 1), overload == "default" ? "" : overload};
}

// "aten.add.Tensor" for messages and the op table.
std::string short_target(const std::string& target) { return target.rfind("torch.ops.", 0) == 0 ? target.substr(10) : target; }

// The program's inputs by role, with the checks every reader of the file makes: no input
// twice, each payload the value the graph expects, tied parameters the same view of one storage.
struct InputRoles {
  struct Input {
    std::string arg;  // the graph's name for it
    std::string fqn;  // the module's
    at::Tensor value;
  };
  std::vector<Input> parameters;                      // trainable, one per storage, under its first name
  std::vector<std::pair<Input, std::string>> tied;    // an alias, and the parameter it shares storage with
  std::vector<Input> frozen;                          // buffers, constants, parameters exported with requires_grad=False
  std::vector<std::string> user;                      // the user inputs' graph names
};

InputRoles classify_inputs(const Archive& a, const Program& p) {
  const Fail fail{a.path};
  InputRoles roles;
  std::map<std::string, std::string> first_of_storage;  // storage -> the parameter that owns it
  std::set<std::string> names, args;
  for (const auto& in : p.inputs) {
    if (!args.insert(in.arg).second) fail("the program's input '" + in.arg + "' appears twice in its signature: the file is damaged");
    if (in.kind == "user_input") {
      if (!p.values.count(in.arg)) fail("the program's user input '" + in.arg + "' has no entry in tensor_values: the file is damaged");
      roles.user.push_back(in.arg);
      continue;
    }
    if (!names.insert(in.fqn).second) fail("two of the program's inputs are named '" + in.fqn + "': the file is damaged");
    auto t = a.tensors.find(in.fqn);
    if (t == a.tensors.end()) {
      // A non-persistent buffer or a lifted constant lives with the constants; none at all is an error.
      fail("the program's " + in.kind + " '" + in.fqn + "' has no payload in the archive");
    }
    // The payload as the weights config describes it must be the value the graph expects.
    auto declared = p.values.find(in.arg);
    if (declared == p.values.end()) fail("the program's " + in.kind + " '" + in.fqn + "' (graph input '" + in.arg + "') has no entry in tensor_values: the file is damaged");
    if (declared->second.sizes != t->second.sizes().vec() || declared->second.dtype != t->second.scalar_type()) {
      fail(in.kind + " '" + in.fqn + "' is " + c10::toString(t->second.scalar_type()) + ir::shape_str(t->second.sizes().vec()) + " in the weights but " +
           c10::toString(declared->second.dtype) + ir::shape_str(declared->second.sizes) + " in the program: the file is damaged");
    }
    const InputRoles::Input input{in.arg, in.fqn, t->second};
    // A parameter exported with requires_grad=False trains no more than a buffer (AdamW skips it in PyTorch too).
    if (in.kind != "parameter" || !a.meta.at(in.fqn).requires_grad) {
      roles.frozen.push_back(input);
      continue;
    }
    const std::string& storage = a.storage.at(in.fqn);
    auto [it, first] = first_of_storage.emplace(storage, in.fqn);
    if (first) {
      roles.parameters.push_back(input);
      continue;
    }
    const Meta& m1 = a.meta.at(it->second);
    const Meta& m2 = a.meta.at(in.fqn);
    if (m1.sizes != m2.sizes || m1.strides != m2.strides || m1.storage_offset != m2.storage_offset || m1.dtype != m2.dtype) {
      fail("parameters '" + it->second + "' and '" + in.fqn + "' share storage " + storage + " but are different views of it; spmdx ties whole tensors only");
    }
    roles.tied.emplace_back(input, it->second);
  }
  return roles;
}

// ---------------------------------------------------------------------------------------------
// 2. Binding arguments to the ATen schema

// An argument bound to its schema slot: a value from the file or the schema's default.
struct Bound {
  std::string name;
  c10::IValue value;                 // non-tensor values (and None)
  std::vector<std::string> tensors;  // as_tensor / as_tensors / as_optional_tensor(s) names ("" for a None in a list)
  bool is_tensor = false, is_list = false;
};

c10::IValue to_ivalue(const Fail& fail, const JsonAt& arg, const std::string& what, Bound& b) {
  const std::string kind = arg.raw().begin().key();  // check_argument made it a one-key union
  const JsonAt v = arg[kind];
  auto real = [&](const JsonAt& x) -> double {
    if (x.is_string()) {
      const std::string& s = x.str();
      if (s == "Infinity") return std::numeric_limits<double>::infinity();
      if (s == "-Infinity") return -std::numeric_limits<double>::infinity();
      if (s == "NaN") return std::numeric_limits<double>::quiet_NaN();
      fail(what + ": float " + s);
    }
    return x.number();
  };
  auto sym = [&](const JsonAt& x) -> std::int64_t {
    if (x.has("as_name")) fail(what + " is symbolic ('" + x["as_name"].str() + "'): the program was exported with dynamic shapes; export without dynamic_shapes");
    return x["as_int"].whole();
  };
  if (kind == "as_none") return c10::IValue();
  if (kind == "as_int") return c10::IValue(v.whole());
  if (kind == "as_ints") {
    std::vector<std::int64_t> out;
    for (const auto& x : v.elements()) out.push_back(x.whole());
    return c10::IValue(out);
  }
  if (kind == "as_float") return c10::IValue(real(v));
  if (kind == "as_floats") {
    std::vector<double> out;
    for (const auto& x : v.elements()) out.push_back(real(x));
    return c10::IValue(out);
  }
  if (kind == "as_bool") return c10::IValue(v.boolean());
  if (kind == "as_bools") {
    c10::List<bool> out;
    for (const auto& x : v.elements()) out.push_back(x.boolean());
    return c10::IValue(out);
  }
  if (kind == "as_string") return c10::IValue(v.str());
  if (kind == "as_strings") {
    std::vector<std::string> out;
    for (const auto& x : v.elements()) out.push_back(x.str());
    return c10::IValue(out);
  }
  if (kind == "as_sym_int") return c10::IValue(sym(v));
  if (kind == "as_sym_ints") {
    std::vector<std::int64_t> out;
    for (const auto& x : v.elements()) out.push_back(sym(x));
    return c10::IValue(out);
  }
  if (kind == "as_scalar_type") {
    auto t = scalar_type(v.whole());
    if (!t) fail(what + ": dtype code " + v.shown() + " is not one spmdx reads");
    return c10::IValue(*t);
  }
  if (kind == "as_memory_format") {
    switch (v.whole()) {
      case 1: return c10::IValue(at::MemoryFormat::Contiguous);
      case 2: return c10::IValue(at::MemoryFormat::ChannelsLast);
      case 3: return c10::IValue(at::MemoryFormat::ChannelsLast3d);
      case 4: return c10::IValue(at::MemoryFormat::Preserve);
      default: fail(what + ": memory format " + v.shown());
    }
  }
  if (kind == "as_layout") {
    if (v.whole() != 7) fail(what + ": layout " + v.shown() + " is not strided (dense)");
    return c10::IValue(at::kStrided);
  }
  if (kind == "as_device") {
    // Where tensors live is spmdx's choice (training.device), not the file's: fold on the CPU.
    return c10::IValue(c10::Device(c10::DeviceType::CPU));
  }
  if (kind == "as_complex") return c10::IValue(c10::complex<double>(real(v["real"]), real(v["imag"])));
  if (kind == "as_tensor") {
    b.is_tensor = true;
    b.tensors = {v["name"].str()};
    return c10::IValue();
  }
  if (kind == "as_tensors" || kind == "as_optional_tensors") {
    b.is_tensor = b.is_list = true;
    for (const auto& x : v.elements()) {
      if (kind == "as_tensors") b.tensors.push_back(x["name"].str());
      else b.tensors.push_back(x.has("as_tensor") ? x["as_tensor"]["name"].str() : "");
    }
    return c10::IValue();
  }
  if (kind == "as_optional_tensor") {
    if (v.has("as_none")) return c10::IValue();
    b.is_tensor = true;
    b.tensors = {v["as_tensor"]["name"].str()};
    return c10::IValue();
  }
  fail(what + " is an argument of kind " + kind + ", which spmdx does not read (" +
       (kind == "as_graph" ? "a higher-order op: control flow or a wrapped subgraph" : "not an ATen tensor program") + ")");
}

struct BoundNode {
  JsonAt node;
  std::string target;  // "aten.add.Tensor"
  std::string name;    // the node's name ("add_3")
  const c10::FunctionSchema* schema = nullptr;
  std::optional<c10::OperatorHandle> op;  // none for a library's op (library_schema)
  std::vector<Bound> args;  // in schema order
  std::vector<std::string> outputs;  // value names ("" for an output not kept)

  const Bound& arg(const std::string& n) const {
    for (const auto& b : args) {
      if (b.name == n) return b;
    }
    throw std::logic_error("no argument " + n);
  }
};

std::optional<c10::OperatorHandle> find_op(const std::string& target) {
  const auto [name, overload] = op_name(target);
  return c10::Dispatcher::singleton().findOp({name, overload});
}

// Ops a Python library registers with torch.library when it is imported, which LibTorch alone
// does not know, by target: their schemas as the library declares them, so that their nodes
// bind as ATen's do. The importer maps them by name and never runs them.
const c10::FunctionSchema* library_schema(const std::string& target) {
  static const std::map<std::string, c10::FunctionSchema> schemas = [] {
    std::map<std::string, c10::FunctionSchema> s;
    // transformers/integrations/moe.py (5.x): the grouped GEMM of its experts under torch.compile
    // and torch.export when torch._grouped_mm cannot run (float32 weights)
    s.emplace("transformers.grouped_mm_fallback.default",
              torch::jit::parseSchema("transformers::grouped_mm_fallback(Tensor input, Tensor weight, Tensor offs) -> Tensor"));
    return s;
  }();
  const auto it = schemas.find(target);
  return it == schemas.end() ? nullptr : &it->second;
}

BoundNode bind_node(const Fail& fail, const JsonAt& node) {
  BoundNode b;
  b.node = node;
  b.target = short_target(node["target"].str());
  b.name = node.str_or("name", "?");
  if (auto op = find_op(node["target"].str())) {
    b.op = *op;
    b.schema = &b.op->schema();
  } else {
    b.schema = library_schema(b.target);
    if (b.schema == nullptr) fail("node '" + b.name + "' calls " + b.target + ", which this LibTorch does not know");
  }
  std::map<std::string, JsonAt> given;
  for (const auto& in : node["inputs"].elements()) {
    const std::string n = in["name"].str();
    bool known = false;
    for (const auto& a : b.schema->arguments()) known = known || a.name() == n;
    if (!known) fail("node '" + b.name + "' (" + b.target + ") passes argument '" + n + "', which its ATen schema " + c10::toString(*b.schema) + " lacks");
    given[n] = in["arg"];
  }
  for (const auto& a : b.schema->arguments()) {
    Bound x;
    x.name = a.name();
    if (auto it = given.find(a.name()); it != given.end()) {
      x.value = to_ivalue(fail, it->second, "node '" + b.name + "' argument '" + a.name() + "'", x);
    } else if (a.default_value()) {
      x.value = *a.default_value();
    } else {
      fail("node '" + b.name + "' (" + b.target + ") leaves out argument '" + a.name() + "', which has no default");
    }
    b.args.push_back(std::move(x));
  }
  for (const auto& out : node["outputs"].elements()) {
    const std::string kind = out.raw().begin().key();  // check_argument made it a one-key union
    if (kind == "as_tensor") {
      b.outputs.push_back(out["as_tensor"]["name"].str());
    } else if (kind == "as_tensors") {
      for (const auto& t : out["as_tensors"].elements()) b.outputs.push_back(t["name"].str());
    } else if (kind == "as_none") {
      b.outputs.push_back("");
    } else {
      fail("node '" + b.name + "' (" + b.target + ") returns " + kind + "; spmdx maps ops that return tensors");
    }
  }
  return b;
}

// Whether a node can be computed ahead, once: an op LibTorch can run (not a library's), no
// assert, and every tensor it reads a constant (`constant`: by value name). A random op that
// qualifies is refused by the callers.
bool foldable(const BoundNode& b, const std::function<bool(const std::string&)>& constant) {
  if (!b.op || b.target == "aten._assert_tensor_metadata.default" || b.target == "aten._assert_scalar.default") return false;
  for (const auto& a : b.args) {
    for (const auto& t : a.tensors) {
      if (!t.empty() && !constant(t)) return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// 3. Mapping onto the IR

struct Sym {
  enum class Kind { value, constant, complex, rotated, rms } kind = Kind::value;
  ir::Value* v = nullptr;  // value; complex/rotated: the real pairs x[..., d/2, 2]; rms: x
  at::Tensor c;            // constant
  at::Tensor cos, sin;     // rotated: [seq, d/2]
  // rms: a step of RMSNorm as transformers writes it (LlamaRMSNorm and its copies),
  // x * rsqrt(mean(x^2, -1, keepdim) + eps), not computed yet: the weight's product makes the
  // whole an rms_norm; any other reader computes the steps as written (rms_value).
  enum class RmsStep { square = 1, mean, shifted, inverse, normed } step = RmsStep::square;
  std::string previous;  // rms: the step before this one (its value's name); none for square
  double eps = 0;        // rms: from shifted on
};

class Mapper {
 public:
  Mapper(const Archive& a, const Program& p, const ModelArgs& args, Model& m) : a_(a), p_(p), args_(args), m_(m), fail_{a.path} {}

  void run() {
    bind_inputs();
    if (args_.moe.expert_parallel > 1) find_experts();
    for (const auto& node : p_.graph["nodes"].elements()) {
      BoundNode b = bind_node(fail_, node);
      current_ = &b;
      try {
        if (const auto r = region_of_.find(b.name); r == region_of_.end()) {
          map_node(b);
        } else if (experts_[r->second].last == b.name) {
          emit_experts(experts_[r->second], b);
        }  // the module's other nodes: computed by emit_experts' graph
      } catch (const ImportError&) {
        throw;
      } catch (const JsonError&) {
        throw;  // names where in the file: guarded() adds the file
      } catch (const c10::Error& e) {
        fail_(at_node(b) + ": " + e.what_without_backtrace());
      } catch (const std::exception& e) {
        fail_(at_node(b) + ": " + e.what());
      }
      current_ = nullptr;
    }
    finish();
  }

 private:
  std::string at_node(const BoundNode& b) const {
    const std::string src = source_line(b.node);
    return "node '" + b.name + "' (" + b.target + (src.empty() ? "" : ", " + src) + ")";
  }
  [[noreturn]] void fail_at(const BoundNode& b, const std::string& why) const { fail_(at_node(b) + ": " + why); }

  ir::DType ir_dtype(at::ScalarType t, const std::string& what) const {
    try {
      return exec::from_aten(t);
    } catch (const std::exception&) {
      fail_(what + " has dtype " + std::string(c10::toString(t)) + ", which the IR has no type for");
    }
  }

  void bind_inputs() {
    const InputRoles roles = classify_inputs(a_, p_);
    const std::vector<std::string>& user = roles.user;
    std::optional<std::pair<std::string, at::ScalarType>> param_dtype;  // the first trainable parameter's
    for (const auto& in : roles.parameters) {
      const at::Tensor& t = in.value;
      ir::TensorMeta meta{t.sizes().vec(), ir_dtype(t.scalar_type(), "parameter '" + in.fqn + "'"), "cpu", true};
      if (!ir::is_floating(meta.dtype)) fail_("parameter '" + in.fqn + "' is " + ir::to_string(meta.dtype) + "; trainable parameters must be floating point");
      if (!param_dtype) param_dtype.emplace(in.fqn, t.scalar_type());
      if (param_dtype->second != t.scalar_type()) {
        fail_("parameters '" + param_dtype->first + "' (" + c10::toString(param_dtype->second) + ") and '" + in.fqn + "' (" + c10::toString(t.scalar_type()) +
              ") differ in dtype; spmdx trains parameters of one dtype: export after model.to(dtype)");
      }
      Sym s;
      s.v = m_.graph.add_input(in.fqn, meta);
      add_init(in.fqn, t, true);
      m_.params.push_back(in.fqn);
      env_[in.arg] = s;
      arg_of_param_[in.fqn] = in.arg;
    }
    for (const auto& [alias, param] : roles.tied) env_[alias.arg] = env_.at(arg_of_param_.at(param));
    for (const auto& in : roles.frozen) {
      Sym s;
      s.kind = Sym::Kind::constant;
      s.c = in.value;
      constant_names_[in.arg] = in.fqn;
      env_[in.arg] = s;
    }
    // Tokens and labels, by name or position.
    std::vector<std::string> chosen;
    if (args_.inputs.empty()) {
      chosen = user;
    } else {
      for (const auto& want : args_.inputs) {
        if (std::find(chosen.begin(), chosen.end(), want) != chosen.end()) fail_("model.inputs names '" + want + "' twice; name the input that takes tokens, then the one that takes labels");
        if (std::find(user.begin(), user.end(), want) == user.end()) {
          fail_("model.inputs names '" + want + "', but the program's inputs are: " + join(user));
        }
        chosen.push_back(want);
      }
      if (chosen.size() != user.size()) fail_("model.inputs names " + std::to_string(chosen.size()) + " of the program's " + std::to_string(user.size()) + " inputs; name each");
    }
    if (chosen.empty() || chosen.size() > 2) {
      fail_("the program takes " + std::to_string(chosen.size()) + " inputs; spmdx feeds forward(tokens) or forward(tokens, labels)");
    }
    for (std::size_t i = 0; i < chosen.size(); ++i) {
      const Meta& m = p_.values.at(chosen[i]);
      const char* role = i == 0 ? "tokens" : "labels";
      if (m.dtype != at::kLong || m.sizes.size() != 2) {
        fail_("input '" + chosen[i] + "' (taking " + role + ") is " + c10::toString(m.dtype) + ir::shape_str(m.sizes) + "; spmdx feeds int64 [batch, seq] token ids");
      }
      Sym s;
      s.v = m_.graph.add_input(role, {m.sizes, ir::DType::i64, "cpu", false});
      env_[chosen[i]] = s;
    }
    if (chosen.size() == 2 && p_.values.at(chosen[0]).sizes != p_.values.at(chosen[1]).sizes) {
      fail_("the program's tokens " + ir::shape_str(p_.values.at(chosen[0]).sizes) + " and labels " + ir::shape_str(p_.values.at(chosen[1]).sizes) + " differ in shape");
    }
    takes_labels_ = chosen.size() == 2;
    if (!takes_labels_) m_.graph.add_input("labels", m_.graph.find_input("tokens")->meta());
  }

  void add_init(const std::string& name, const at::Tensor& t, bool trainable) {
    InitSpec spec;
    spec.name = name;
    spec.shape = t.sizes().vec();
    spec.kind = InitSpec::Kind::data;
    spec.trainable = trainable;
    auto held = std::make_shared<at::Tensor>(t.contiguous());  // the archive's own tensor when it is contiguous: no copy
    spec.nbytes = held->nbytes();
    spec.data = std::shared_ptr<const unsigned char>(held, static_cast<const unsigned char*>(held->data_ptr()));
    m_.init.push_back(std::move(spec));
  }

  // The IR value of a tensor argument: a frozen constant becomes a graph input (once).
  ir::Value* value(const std::string& name) {
    Sym& s = sym(name);
    if (s.kind == Sym::Kind::value) return s.v;
    if (s.kind == Sym::Kind::rms) return rms_value(name);
    if (s.kind != Sym::Kind::constant) fail_("value '" + name + "' is complex; spmdx maps complex numbers only in torchtitan's rotary embedding (view_as_complex(x) * freqs_cis, view_as_real)");
    // A constant read by a trainable op becomes a frozen input once; it stays a constant for
    // the nodes after (GPT-2's positions feed both its position embedding and its mask).
    if (s.v != nullptr) return s.v;
    auto it = constant_names_.find(name);
    std::string input = it != constant_names_.end() ? it->second : "const." + name;
    const ir::DType dtype = ir_dtype(s.c.scalar_type(), "constant '" + input + "'");
    s.v = m_.graph.add_input(input, {s.c.sizes().vec(), dtype, "cpu", false});
    add_init(input, s.c, false);
    return s.v;
  }

  // An RMSNorm step read by something other than the next step: its ops as the file writes
  // them (the steps before it first), once.
  ir::Value* rms_value(const std::string& name) {
    Sym s = sym(name);
    ir::Graph& g = m_.graph;
    ir::Value* x = s.v;
    ir::Value* out = nullptr;
    switch (s.step) {
      case Sym::RmsStep::square: out = g.add("pow_scalar", {x}, {{"value", 2.0}}); break;
      case Sym::RmsStep::mean:
        out = g.add("mean", {value(s.previous)}, {{"dims", Shape{static_cast<std::int64_t>(x->meta().shape.size()) - 1}}, {"keepdim", true}});
        break;
      case Sym::RmsStep::shifted: out = g.add("add_scalar", {value(s.previous)}, {{"value", s.eps}}); break;
      case Sym::RmsStep::inverse: out = g.add("rsqrt", {value(s.previous)}); break;
      case Sym::RmsStep::normed: out = g.add("mul", {x, value(s.previous)}); break;
    }
    Sym& kept = sym(name);
    kept = Sym{};
    kept.v = out;
    return out;
  }

  // The next RMSNorm step from value `from` (of kind rms at step `from_step`, or for the square
  // a plain floating value x), when node b's output is exactly what the file records for it.
  bool rms_step(const BoundNode& b, const std::string& from, Sym::RmsStep step, double eps = 0) {
    const Sym& in = sym(from);
    Sym s;
    s.kind = Sym::Kind::rms;
    s.step = step;
    if (step == Sym::RmsStep::square) {
      if (in.kind != Sym::Kind::value || !ir::is_floating(in.v->meta().dtype) || in.v->meta().shape.empty()) return false;
      s.v = in.v;
    } else {
      if (in.kind != Sym::Kind::rms || static_cast<int>(in.step) + 1 != static_cast<int>(step)) return false;
      s.v = in.v;
      s.previous = from;
      s.eps = step == Sym::RmsStep::shifted ? eps : in.eps;
    }
    const Meta& want = meta(b);
    Shape shape = s.v->meta().shape;
    if (step == Sym::RmsStep::mean || step == Sym::RmsStep::shifted || step == Sym::RmsStep::inverse) shape.back() = 1;
    if (want.sizes != shape || ir_dtype(want.dtype, "output") != s.v->meta().dtype) return false;
    env_[b.outputs.at(0)] = s;
    return true;
  }

  // Every read of a value by name goes through here: one the program never defines (no input,
  // no earlier node's output) is refused naming it and the node that reads it.
  Sym& sym(const std::string& name) {
    auto it = env_.find(name);
    if (it != env_.end()) return it->second;
    const std::string why = "value '" + name + "', which no input of the program and no earlier node defines: the file is damaged; save it again with torch.export.save";
    if (current_ != nullptr) fail_at(*current_, "reads " + why);
    fail_("the program returns " + why);
  }

  const Meta& meta(const BoundNode& b, std::size_t i = 0) const {
    auto it = p_.values.find(b.outputs.at(i));
    if (it == p_.values.end()) fail_at(b, "its output '" + b.outputs.at(i) + "' has no entry in tensor_values");
    return it->second;
  }

  static bool integer(const ir::Value* v) { return v->meta().dtype == ir::DType::i64 || v->meta().dtype == ir::DType::i32; }

  ir::Value* cast(ir::Value* v, ir::DType to) {
    if (v->meta().dtype == to) return v;
    return m_.graph.add("cast", {v}, {{"dtype", std::string(ir::to_string(to))}});
  }

  void set(const BoundNode& b, ir::Value* v, std::size_t i = 0) {
    const Meta& want = meta(b, i);
    if (v->meta().shape != want.sizes) {
      fail_at(b, "computes " + v->meta().str() + " but the file says its output '" + b.outputs[i] + "' is " + ir::shape_str(want.sizes) +
                     ": the file's shapes disagree with the op's arguments (a damaged file?), or spmdx maps the op wrongly (then please report it with the file)");
    }
    v = cast(v, ir_dtype(want.dtype, "output '" + b.outputs[i] + "'"));
    Sym s;
    s.v = v;
    env_[b.outputs.at(i)] = s;
  }

  // The node's arguments as the op's boxed call takes them, its tensors from `tensor` (by value name).
  torch::jit::Stack stack_of(const BoundNode& b, const std::function<at::Tensor(const std::string&)>& tensor) {
    torch::jit::Stack stack;
    const auto& schema_args = b.schema->arguments();
    for (std::size_t k = 0; k < b.args.size(); ++k) {
      const Bound& a = b.args[k];
      if (!a.is_tensor && (a.value.isDouble() || a.value.isInt() || a.value.isBool()) && schema_args[k].type()->kind() == c10::TypeKind::TensorType) {
        // A Python number where the schema has a Tensor (mul.Tensor(x, -1e9)): a wrapped number, as PyTorch makes it.
        at::Tensor t = a.value.isDouble() ? at::scalar_tensor(a.value.toDouble(), at::kDouble)
                       : a.value.isInt()  ? at::scalar_tensor(a.value.toInt(), at::kLong)
                                          : at::scalar_tensor(a.value.toBool(), at::kBool);
        t.unsafeGetTensorImpl()->set_wrapped_number(true);
        stack.emplace_back(t);
      } else if (!a.is_tensor) {
        stack.push_back(a.value);
      } else if (!a.is_list) {
        stack.emplace_back(tensor(a.tensors[0]));
      } else {
        std::vector<at::Tensor> list;
        for (const auto& t : a.tensors) list.push_back(tensor(t));
        stack.emplace_back(list);
      }
    }
    return stack;
  }

  static std::vector<at::Tensor> results_of(const torch::jit::Stack& stack) {
    std::vector<at::Tensor> results;
    for (const auto& r : stack) {
      if (r.isTensor()) results.push_back(r.toTensor());
      else if (r.isTensorList()) for (const auto& t : r.toTensorList()) results.push_back(t);
    }
    return results;
  }

  // The shapes the node's own arguments give its outputs, from ATen's shape functions (the op
  // run on meta tensors: shapes, no data) on its inputs as spmdx has them, must be the shapes
  // the file records in tensor_values: the shape ops' mappings take their output shapes from
  // there, so a view or split whose sizes were changed would otherwise be read as the file
  // says. Refused naming the node and both shapes.
  void check_shapes(const BoundNode& b) {
    bool all_known = true;
    torch::jit::Stack stack = stack_of(b, [&](const std::string& name) {
      const Sym& s = sym(name);
      if (s.kind == Sym::Kind::constant) return at::empty(s.c.sizes(), s.c.options().device(at::kMeta));
      if (s.kind != Sym::Kind::value) all_known = false;  // complex pairs: not a tensor of the file's shape
      const ir::TensorMeta& m = s.v->meta();
      return at::empty(m.shape, at::TensorOptions().dtype(exec::to_aten(m.dtype)).device(at::kMeta));
    });
    if (!all_known) return;
    try {
      b.op->callBoxed(&stack);
    } catch (const c10::Error& e) {
      std::string shapes;
      for (const auto& a : b.args) {
        for (const auto& t : a.tensors) shapes += (shapes.empty() ? "" : ", ") + t + " " + ir::shape_str(sym(t).kind == Sym::Kind::constant ? sym(t).c.sizes().vec() : sym(t).v->meta().shape);
      }
      fail_at(b, "its arguments do not fit its input" + std::string(shapes.find(',') == std::string::npos ? " " : "s ") + shapes + " (" + e.what_without_backtrace() +
                     "): the file is damaged; export the program again");
    }
    const std::vector<at::Tensor> results = results_of(stack);
    if (results.size() != b.outputs.size()) {
      std::vector<std::string> got, recorded;
      for (const auto& r : results) got.push_back(ir::shape_str(r.sizes().vec()));
      for (std::size_t k = 0; k < b.outputs.size(); ++k) recorded.push_back(b.outputs[k].empty() ? "(not kept)" : b.outputs[k] + " " + ir::shape_str(meta(b, k).sizes));
      fail_at(b, "its arguments give " + std::to_string(results.size()) + " outputs (" + join(got) + "), but the file records " + std::to_string(b.outputs.size()) + " (" +
                     join(recorded) + "): the file is damaged; export the program again");
    }
    for (std::size_t k = 0; k < b.outputs.size(); ++k) {
      if (b.outputs[k].empty()) continue;
      const Shape got = results[k].sizes().vec();
      if (got != meta(b, k).sizes) {
        fail_at(b, "its arguments give its output '" + b.outputs[k] + "' the shape " + ir::shape_str(got) + ", but tensor_values records " +
                       ir::shape_str(meta(b, k).sizes) + ": the file is damaged; export the program again");
      }
    }
  }

  // Constant folding: every tensor input frozen (or none), the op run once with ATen.
  bool try_fold(const BoundNode& b) {
    if (!foldable(b, [&](const std::string& name) { return sym(name).kind == Sym::Kind::constant; })) return false;
    if (b.op->hasTag(at::Tag::nondeterministic_seeded)) {
      fail_at(b, "a random op (dropout, rand); spmdx runs each step's program as exported: export in eval() mode or without random ops");
    }
    for (std::size_t i = 0; i < b.outputs.size(); ++i) {  // the sizes the file declares, before ATen allocates them
      if (b.outputs[i].empty()) continue;
      const Meta& m = meta(b, i);
      double bytes = static_cast<double>(c10::elementSize(m.dtype));
      for (auto d : m.sizes) bytes *= static_cast<double>(d);
      if (bytes > 4.0 * (1 << 30)) fail_at(b, "computing it ahead would make a constant of " + ir::shape_str(m.sizes) + " (" + std::to_string(bytes / (1 << 30)) + " GiB); spmdx folds constants up to 4 GiB");
    }
    torch::jit::Stack stack = stack_of(b, [&](const std::string& name) { return sym(name).c; });
    try {
      b.op->callBoxed(&stack);
    } catch (const c10::Error& e) {
      fail_at(b, std::string("computing it ahead (its inputs are all constants) failed: ") + e.what_without_backtrace());
    }
    const std::vector<at::Tensor> results = results_of(stack);
    if (results.size() < b.outputs.size()) fail_at(b, "folding it gave " + std::to_string(results.size()) + " tensors for " + std::to_string(b.outputs.size()) + " outputs");
    for (std::size_t i = 0; i < b.outputs.size(); ++i) {
      if (b.outputs[i].empty()) continue;
      if (results[i].sizes().vec() != meta(b, i).sizes) {
        fail_at(b, "computed ahead it gives " + ir::shape_str(results[i].sizes().vec()) + " but the file says " + ir::shape_str(meta(b, i).sizes) + ": the file is damaged");
      }
      Sym s;
      s.kind = Sym::Kind::constant;
      s.c = results[i].contiguous();
      env_[b.outputs[i]] = s;
    }
    return true;
  }

  // A node's arguments by name, of the kind the handler reads: one of another kind (an edited
  // file: a string where the schema has an int) is refused naming the node and the argument.
  [[noreturn]] void wrong_arg(const BoundNode& b, const char* n, const char* want) const {
    const Bound& a = b.arg(n);
    fail_at(b, "argument '" + std::string(n) + "' is " + (a.is_tensor ? "a tensor" : a.value.tagKind()) + ", not " + want + ": the file is damaged");
  }
  std::int64_t i(const BoundNode& b, const char* n) const {
    const Bound& a = b.arg(n);
    if (a.is_tensor || !a.value.isInt()) wrong_arg(b, n, "an int");
    return a.value.toInt();
  }
  double f(const BoundNode& b, const char* n) const {
    const Bound& a = b.arg(n);
    if (a.is_tensor || !(a.value.isDouble() || a.value.isInt() || a.value.isBool())) wrong_arg(b, n, "a number");
    return a.value.toScalar().toDouble();
  }
  bool none(const BoundNode& b, const char* n) const { return !b.arg(n).is_tensor && b.arg(n).value.isNone(); }
  const std::string& t(const BoundNode& b, const char* n) const {
    const Bound& a = b.arg(n);
    if (!a.is_tensor || a.tensors.empty() || a.tensors[0].empty()) wrong_arg(b, n, "a tensor");
    return a.tensors[0];
  }
  bool is_tensor(const BoundNode& b, const char* n) const { return b.arg(n).is_tensor; }

  ir::Value* reshape_to(ir::Value* x, const Shape& shape) {
    // A reshape of a reshape is one reshape (the first is dropped at the end if nothing else reads it).
    while (x->meta().shape != shape && x->producer() != nullptr && x->producer()->op() == "reshape") x = x->producer()->input(0);
    if (x->meta().shape == shape) return x;
    return m_.graph.add("reshape", {x}, {{"shape", shape}});
  }

  // Binary ops on a tensor and a tensor or a scalar, operands cast to the result's dtype.
  void binary(const BoundNode& b, const std::string& op, double alpha) {
    const ir::DType out = ir_dtype(meta(b).dtype, "output");
    ir::Value* x = cast(value(t(b, "self")), out);
    if (is_tensor(b, "other")) {
      ir::Value* y = cast(value(t(b, "other")), out);
      if (alpha != 1.0) y = m_.graph.add("mul_scalar", {y}, {{"value", alpha}});
      set(b, m_.graph.add(op, {x, y}));
      return;
    }
    const double v = f(b, "other") * alpha;
    if (op == "add") set(b, m_.graph.add("add_scalar", {x}, {{"value", v}}));
    else if (op == "sub") set(b, m_.graph.add("add_scalar", {x}, {{"value", -v}}));
    else if (op == "mul") set(b, m_.graph.add("mul_scalar", {x}, {{"value", v}}));
    else set(b, m_.graph.add("mul_scalar", {x}, {{"value", 1.0 / v}}));
  }

  Shape dims_arg(const BoundNode& b, const char* n, std::size_t rank) const {
    const c10::IValue& v = b.arg(n).value;
    Shape dims;
    if (v.isNone()) return dims;
    if (v.isInt()) dims.push_back(v.toInt());
    else dims = v.toIntVector();
    for (auto& d : dims) {
      if (d < 0) d += static_cast<std::int64_t>(rank);
    }
    return dims;
  }

  using Handler = void (Mapper::*)(const BoundNode&);

 public:
  // The ATen ops with an IR mapping, by family (the constant folder runs any op on frozen inputs).
  static const std::map<std::string, Handler>& mapped_ops() {
    static const std::map<std::string, Handler> table = [] {
      std::map<std::string, Handler> t;
      auto add = [&](Handler h, std::initializer_list<const char*> ops) {
        for (const char* op : ops) t[op] = h;
      };
      add(&Mapper::map_nothing, {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default"});
      add(&Mapper::map_dense, {"aten.embedding.default", "aten.linear.default", "aten.mm.default", "aten.bmm.default", "aten.matmul.default",
                               "aten.addmm.default", "aten.baddbmm.default",
                               "aten.t.default", "aten.transpose.int", "aten.permute.default"});
      add(&Mapper::map_arith, {"aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.add.Scalar", "aten.sub.Scalar",
                               "aten.mul.Scalar", "aten.div.Scalar", "aten.rsub.Scalar", "aten.rsub.Tensor", "aten.pow.Tensor_Scalar",
                               "aten.neg.default", "aten.exp.default", "aten.log.default", "aten.sqrt.default", "aten.rsqrt.default",
                               "aten.sigmoid.default", "aten.tanh.default", "aten.silu.default", "aten.relu.default", "aten.gelu.default"});
      add(&Mapper::map_shape, {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.flatten.using_ints",
                               "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default", "aten.slice.Tensor",
                               "aten.select.int", "aten.cat.default", "aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default",
                               "aten.unbind.int", "aten.expand.default"});
      add(&Mapper::map_reduce, {"aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim", "aten.mean.default", "aten.softmax.int",
                                "aten._softmax.default", "aten.log_softmax.int", "aten._log_softmax.default"});
      add(&Mapper::norm, {"aten.rms_norm.default", "aten.layer_norm.default"});
      add(&Mapper::attention, {"aten.scaled_dot_product_attention.default"});
      add(&Mapper::cross_entropy, {"aten.cross_entropy_loss.default"});
      add(&Mapper::map_copy, {"aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout", "aten.type_as.default", "aten.clone.default",
                              "aten.contiguous.default", "aten.alias.default", "aten.detach.default", "aten.lift_fresh_copy.default",
                              "aten.dropout.default"});
      add(&Mapper::map_complex, {"aten.view_as_complex.default", "aten.view_as_real.default"});
      add(&Mapper::map_select, {"aten.masked_fill.Scalar", "aten.masked_fill.Tensor", "aten.where.self", "aten.where.ScalarOther", "aten.where.ScalarSelf"});
      add(&Mapper::map_moe, {"aten.topk.default", "aten.sort.default", "aten.sort.stable", "aten.argsort.default", "aten.argsort.stable", "aten.gather.default",
                             "aten.scatter_add.default", "aten.bincount.default", "aten.histc.default", "aten.cumsum.default", "aten.floor_divide.default",
                             "aten.floor_divide.Scalar", "aten._grouped_mm.default", "transformers.grouped_mm_fallback.default"});
      add(&Mapper::map_index, {"aten.index.Tensor", "aten.index_put.default", "aten.repeat_interleave.self_int", "aten.empty_like.default"});
      return t;
    }();
    return table;
  }

 private:
  void map_node(const BoundNode& b) {
    if (try_fold(b)) return;
    const auto& table = mapped_ops();
    const auto it = table.find(b.target);
    if (it == table.end()) fail_at(b, "spmdx has no mapping for " + b.target + "; it runs on trainable values, so it cannot be computed ahead either");
    (this->*(it->second))(b);
  }

  void map_nothing(const BoundNode&) {}  // asserts: nothing to compute

  // Expert parallelism on an imported Mixture of Experts. transformers' experts modules (a class
  // named *Experts holding gate_up_proj [experts, 2 hidden, dim] and down_proj [experts, dim,
  // hidden]: the contract of transformers/integrations/moe.py, 5.x) compute
  // out[t] = sum_k w[t, k] down_e(silu(gate_e x_t) * up_e x_t), e = top_k_index[t, k], from
  // forward(hidden_states, top_k_index, top_k_weights), whichever experts implementation
  // exported them (grouped_mm, batched_mm). Their nodes are found by the module each was
  // exported from (nn_module_stack) and replaced, as a whole, by expert_parallel_experts: the
  // same function, in blocks exchanged by all_to_all_v. The router before them stays as
  // exported.
  struct ExpertsRegion {
    std::string path;                    // "model.model.layers.0.mlp.experts"
    std::string type;                    // "Qwen3MoeExperts"
    std::vector<std::string> inputs;     // values read from outside it, in first-read order
    std::vector<std::string> params;     // parameters it reads (FQNs)
    std::set<std::string> ops;           // its ATen ops
    std::set<std::string> outputs;       // values made in it and read outside
    std::string last;                    // the node that makes the output
    std::vector<JsonAt> nodes;           // its nodes, in program order
    double bytes = 0;                    // what its nodes' outputs hold (the sample check's memory)
  };

  // The innermost module of a node's nn_module_stack ("key,path,type;..." from the outermost)
  // whose class name ends in "Experts": {path, class}, or empty.
  static std::pair<std::string, std::string> experts_module(const JsonAt& node) {
    const auto md = node.is_object() ? node.find("metadata") : std::nullopt;
    if (!md || !md->is_object() || !md->has("nn_module_stack") || !(*md)["nn_module_stack"].is_string()) return {};
    std::pair<std::string, std::string> found;
    const std::string stack = md->raw()["nn_module_stack"].get<std::string>();
    for (std::size_t from = 0, to = 0; from <= stack.size(); from = to + 1) {
      to = std::min(stack.find(';', from), stack.size());
      const std::string entry = stack.substr(from, to - from);
      const auto type_at = entry.rfind(',');
      if (type_at == std::string::npos || type_at == 0) continue;
      const auto path_at = entry.rfind(',', type_at - 1);
      const std::string type = entry.substr(type_at + 1);
      const std::string cls = type.substr(type.rfind('.') == std::string::npos ? 0 : type.rfind('.') + 1);
      if (cls.ends_with("Experts")) {
        found = {entry.substr(path_at == std::string::npos ? 0 : path_at + 1, type_at - (path_at == std::string::npos ? 0 : path_at + 1)), cls};
      }
    }
    return found;
  }

  void find_experts() {
    std::map<std::string, std::string> param_of_arg;
    for (const auto& [fqn, arg] : arg_of_param_) param_of_arg[arg] = fqn;
    std::map<std::string, std::size_t> index;        // module path -> experts_
    std::map<std::string, std::size_t> made_in;      // value -> the region that makes it
    std::map<std::string, std::string> made_by;      // value -> its node
    auto read_outside = [&](const std::string& value) {
      const auto it = made_in.find(value);
      if (it == made_in.end()) return;
      ExpertsRegion& r = experts_[it->second];
      r.outputs.insert(value);
      r.last = made_by.at(value);
    };
    for (const auto& node : p_.graph["nodes"].elements()) {
      const BoundNode b = bind_node(fail_, node);
      const auto [path, type] = experts_module(node);
      if (path.empty()) {
        for (const auto& a : b.args) {
          for (const auto& t : a.tensors) read_outside(t);
        }
        continue;
      }
      const auto [it, fresh] = index.emplace(path, experts_.size());
      if (fresh) experts_.push_back({path, type, {}, {}, {}, {}, "", {}, 0});
      ExpertsRegion& r = experts_[it->second];
      region_of_[b.name] = it->second;
      r.ops.insert(b.target);
      r.nodes.push_back(node);
      for (const auto& o : b.outputs) {
        if (const auto m = p_.values.find(o); !o.empty() && m != p_.values.end()) {
          double n = static_cast<double>(c10::elementSize(m->second.dtype));
          for (const auto d : m->second.sizes) n *= static_cast<double>(d);
          r.bytes += n;
        }
      }
      for (const auto& a : b.args) {
        for (const auto& t : a.tensors) {
          if (t.empty()) continue;
          if (const auto m = made_in.find(t); m != made_in.end() && m->second == it->second) continue;
          if (const auto fqn = param_of_arg.find(t); fqn != param_of_arg.end()) {
            if (std::find(r.params.begin(), r.params.end(), fqn->second) == r.params.end()) r.params.push_back(fqn->second);
          } else if (std::find(r.inputs.begin(), r.inputs.end(), t) == r.inputs.end()) {
            read_outside(t);  // another region's output
            r.inputs.push_back(t);
          }
        }
      }
      for (const auto& o : b.outputs) {
        if (!o.empty()) made_in[o] = it->second, made_by[o] = b.name;
      }
    }
    for (const auto& o : p_.outputs) read_outside(o);
    const std::string key = "parallelism.expert_parallel_degree " + std::to_string(args_.moe.expert_parallel);
    if (experts_.empty()) {
      fail_(key + ": the program has no experts module to place (a transformers class named *Experts, as Qwen3MoeExperts and MixtralExperts, "
                  "seen in the nodes' nn_module_stack): expert parallelism applies to Mixture-of-Experts exports; set it to 1");
    }
    for (const auto& r : experts_) {
      if (r.outputs.size() != 1) {
        fail_(key + ": the experts module '" + r.path + "' (" + r.type + ") gives " + std::to_string(r.outputs.size()) +
              " values to the rest of the program; spmdx replaces an experts module that returns one tensor (transformers' experts forward)");
      }
    }
  }

  // The replacement is exact only if the module computes transformers' experts contract; its
  // class name and parameters say so, its ops are checked here: the module's own nodes run with
  // ATen on a sample (random hidden states, distinct random experts per token, random scores and
  // random weights of the parameters' shapes, seeded) against the contract's sum, in float64.
  // A module that computes something else (another activation order, a scale, a bias) is refused
  // naming it, rather than trained as if it were SwiGLU experts.
  void check_experts_function(const ExpertsRegion& r, const std::string& what, const std::string& gate_up, const std::string& down, const ir::Value* x,
                              const ir::Value* ids) {
    if (r.bytes > 8.0 * (1 << 30)) {
      fail_(what + "checking that it computes SwiGLU experts runs its nodes on a sample, which would take " + std::to_string(r.bytes / (1 << 30)) +
            " GiB at the exported batch; export with a smaller batch, or set the degree to 1");
    }
    at::manual_seed(20261206);
    const ir::TensorMeta &gu0 = value(arg_of_param_.at(gate_up))->meta(), &down0 = value(arg_of_param_.at(down))->meta();
    const std::int64_t tokens = x->meta().shape[0], dim = x->meta().shape[1], k = ids->meta().shape[1], E = gu0.shape[0], hidden = gu0.shape[1] / 2;
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    const at::Tensor gu = at::randn(gu0.shape, f32).div(std::sqrt(static_cast<double>(dim))).to(exec::to_aten(gu0.dtype));
    const at::Tensor dn = at::randn(down0.shape, f32).div(std::sqrt(static_cast<double>(hidden))).to(exec::to_aten(down0.dtype));
    const at::Tensor hs = at::randn({tokens, dim}, f32);
    const at::Tensor choice = at::argsort(at::rand({tokens, E}, f32), /*dim=*/1, /*descending=*/false).narrow(1, 0, std::min(k, E)).contiguous();
    const at::Tensor weights = at::rand({tokens, k}, f32);
    std::map<std::string, at::Tensor> vals;
    for (const auto& name : r.inputs) {
      const ir::Value* v = value(name);
      at::Tensor t = v == x ? hs : v == ids ? choice : weights;
      vals[name] = t.to(exec::to_aten(v->meta().dtype));
    }
    auto tensor = [&](const std::string& name) -> at::Tensor {
      if (const auto it = vals.find(name); it != vals.end()) return it->second;
      if (name == arg_of_param_.at(gate_up)) return gu;
      if (name == arg_of_param_.at(down)) return dn;
      const Sym& c = sym(name);
      if (c.kind == Sym::Kind::constant) return c.c;
      fail_(what + "its value '" + name + "' is neither an input of the module nor a constant: cannot check what it computes; set the degree to 1");
    };
    std::string output;
    for (const auto& node : r.nodes) {
      const BoundNode b = bind_node(fail_, node);
      if (b.target == "aten._assert_tensor_metadata.default" || b.target == "aten._assert_scalar.default") continue;
      std::vector<at::Tensor> results;
      if (b.target == "transformers.grouped_mm_fallback.default") {  // LibTorch does not know it: the grouped_mm it maps onto, by grouped_mm's kernel
        const std::vector<at::Tensor> in{tensor(b.arg("input").tensors.at(0)), tensor(b.arg("weight").tensors.at(0)), tensor(b.arg("offs").tensors.at(0))};
        ir::Graph one;
        std::vector<ir::Value*> args;
        for (std::size_t i = 0; i < in.size(); ++i) args.push_back(one.add_input("in" + std::to_string(i), {in[i].sizes().vec(), exec::from_aten(in[i].scalar_type()), "cpu", false}));
        results = (*exec::find_kernel("grouped_mm"))(*one.add_node("grouped_mm", args), in);
      } else {
        if (!b.op || b.op->hasTag(at::Tag::nondeterministic_seeded)) fail_at(b, what + "cannot run it on a sample to check the module; set the degree to 1");
        torch::jit::Stack stack = stack_of(b, tensor);
        b.op->callBoxed(&stack);
        results = results_of(stack);
      }
      for (std::size_t i = 0; i < b.outputs.size() && i < results.size(); ++i) {
        if (!b.outputs[i].empty()) vals[b.outputs[i]] = results[i];
      }
      if (b.name == r.last) output = *r.outputs.begin();
    }
    const at::Tensor got = vals.at(output).to(at::kDouble);
    // The contract: out[t] = sum_j w[t, j] down_e(silu(gate_e x_t) * up_e x_t), e = choice[t, j].
    const at::Tensor e = choice.reshape({-1}), xs = hs.to(at::kDouble).repeat_interleave(k, 0);
    const at::Tensor h = at::bmm(gu.to(at::kDouble).index_select(0, e), xs.unsqueeze(-1)).squeeze(-1);
    const at::Tensor act = at::silu(h.narrow(1, 0, hidden)) * h.narrow(1, hidden, hidden);
    const at::Tensor want = (at::bmm(dn.to(at::kDouble).index_select(0, e), act.unsqueeze(-1)).squeeze(-1) * weights.to(at::kDouble).reshape({-1, 1}))
                                .reshape({tokens, k, dim}).sum(1);
    const double off = (got - want).abs().max().item<double>(), scale = want.abs().max().item<double>();
    if (!(off <= 1e-3 * scale + 1e-6)) {
      fail_(what + "on a sample its nodes compute something other than SwiGLU experts (sum over the top_k of score x down(silu(gate x) * up x), gate_up_proj's first half "
                   "gate): off by " + std::to_string(off) + " where the values reach " + std::to_string(scale) +
            ". spmdx's expert parallelism replaces the module by that function, so it is refused: set the degree to 1 (the module then maps op by op)");
    }
  }

  void emit_experts(const ExpertsRegion& r, const BoundNode& b) {
    ir::Graph& g = m_.graph;
    const std::string what = "parallelism.expert_parallel_degree " + std::to_string(args_.moe.expert_parallel) + " on the experts module '" + r.path + "' (" + r.type + "): ";
    std::string gate_up, down;
    for (const auto& fqn : r.params) {
      if (fqn.ends_with("gate_up_proj") && gate_up.empty()) gate_up = fqn;
      else if (fqn.ends_with("down_proj") && down.empty()) down = fqn;
      else fail_(what + "it reads parameter '" + fqn + "'; spmdx's expert parallelism maps experts of gate_up_proj and down_proj only (no biases): set the degree to 1");
    }
    if (gate_up.empty() || down.empty()) fail_(what + "it does not read both gate_up_proj and down_proj; set the degree to 1");
    for (const char* act : {"aten.gelu.default", "aten.relu.default", "aten.tanh.default", "aten.sigmoid.default", "aten.clamp.default", "aten.elu.default"}) {
      if (r.ops.count(act)) fail_(what + "its experts call " + act + "; spmdx's expert parallelism maps SwiGLU experts (silu(gate) * up): set the degree to 1");
    }
    if (!r.ops.count("aten.silu.default")) fail_(what + "no silu among its ops; spmdx's expert parallelism maps SwiGLU experts (silu(gate) * up): set the degree to 1");
    ir::Value* gu = value(arg_of_param_.at(gate_up));
    ir::Value* w2 = value(arg_of_param_.at(down));
    ir::Value *x = nullptr, *ids = nullptr, *top = nullptr;
    for (const auto& name : r.inputs) {
      ir::Value* v = value(name);
      ir::Value*& slot = integer(v) ? ids : v->meta().rank() == 2 && gu->meta().rank() == 3 && v->meta().shape[1] == gu->meta().shape[2] && x == nullptr ? x : top;
      if (slot != nullptr) fail_(what + "it reads " + std::to_string(r.inputs.size()) + " values from outside; spmdx maps forward(hidden_states, top_k_index, top_k_weights)");
      slot = v;
    }
    if (x == nullptr || ids == nullptr || top == nullptr) fail_(what + "it does not read hidden_states [tokens, dim], top_k_index and top_k_weights [tokens, top_k]");
    const Shape &gs = gu->meta().shape, &ds = w2->meta().shape, &xs = x->meta().shape;
    const std::int64_t E = gs[0], hidden = gs[1] / 2, dim = xs[1], tokens = xs[0];
    if (gs.size() != 3 || gs[1] % 2 != 0 || gs[2] != dim || ds != Shape{E, dim, hidden} || ids->meta().rank() != 2 || ids->meta().shape[0] != tokens ||
        top->meta().shape != ids->meta().shape) {
      fail_(what + "gate_up_proj " + gu->meta().str() + ", down_proj " + w2->meta().str() + ", hidden_states " + x->meta().str() + ", top_k_index " + ids->meta().str() +
            ", top_k_weights " + top->meta().str() + "; spmdx maps gate_up_proj [experts, 2 hidden, dim], down_proj [experts, dim, hidden] and [tokens, top_k] "
            "routing (not transposed experts, not per-expert weights [tokens, experts])");
    }
    if (E % args_.moe.expert_parallel != 0) {
      std::string divisors;
      for (std::int64_t d = 1; d <= E; ++d) {
        if (E % d == 0) divisors += (divisors.empty() ? "" : ", ") + std::to_string(d);
      }
      fail_(what + "the degree does not divide its " + std::to_string(E) + " experts: use one that does (" + divisors + ") and divides data_parallel_shard_degree");
    }
    check_experts_function(r, what, gate_up, down, x, ids);
    const auto half = [&](std::int64_t start) { return g.add("slice", {gu}, {{"dim", std::int64_t{1}}, {"start", start}, {"end", start + hidden}}); };
    MoEArgs a = args_.moe;
    a.score_before_experts = false;  // transformers weights the experts' outputs
    ir::Value* y = models::expert_parallel_experts(g, x, cast(ids, ir::DType::i64), cast(top, ir::DType::f32), half(0), w2, half(hidden), {}, a,
                                                   r.path + ".tokens_per_expert");
    set(b, y);
    for (const auto& w : {gate_up, down}) m_.expert_params.push_back(w);
    m_.args.moe.experts = E;
    m_.args.moe.top_k = ids->meta().shape[1];
    m_.args.moe.hidden = hidden;
  }

  // embedding, linear, matmuls, transposes
  void map_dense(const BoundNode& b) {
    const std::string& op = b.target;
    ir::Graph& g = m_.graph;
    if (op == "aten.embedding.default") {
      if (b.arg("scale_grad_by_freq").value.toBool() || b.arg("sparse").value.toBool()) fail_at(b, "embedding with scale_grad_by_freq or sparse");
      return set(b, g.add("embedding", {value(t(b, "weight")), value(t(b, "indices"))}, {{"padding_idx", i(b, "padding_idx")}}));
    }
    if (op == "aten.linear.default") {
      ir::Value* y = g.add("linear", {value(t(b, "input")), value(t(b, "weight"))});
      if (is_tensor(b, "bias")) y = g.add("add", {y, value(t(b, "bias"))});
      return set(b, y);
    }
    if (op == "aten.mm.default" || op == "aten.bmm.default") return set(b, g.add("matmul", {value(t(b, "self")), value(t(b, "mat2"))}));
    // beta * self + alpha * (mat1 @ mat2) (GPT-2's Conv1D: x @ W + b with W [in, out]); baddbmm
    // the same over a batch, as ATen's.
    if (op == "aten.addmm.default" || op == "aten.baddbmm.default") {
      const bool batched = op == "aten.baddbmm.default";
      ir::Value* y = g.add("matmul", {value(t(b, batched ? "batch1" : "mat1")), value(t(b, batched ? "batch2" : "mat2"))});
      const double alpha = f(b, "alpha"), beta = f(b, "beta");
      if (alpha != 1.0) y = g.add("mul_scalar", {y}, {{"value", alpha}});
      if (beta == 0.0) return set(b, y);  // ATen ignores self (even NaN) when beta is 0
      ir::Value* self = value(t(b, "self"));
      if (beta != 1.0) self = g.add("mul_scalar", {self}, {{"value", beta}});
      return set(b, g.add("add", {y, self}));
    }
    if (op == "aten.matmul.default") {
      ir::Value* x = value(t(b, "self"));
      ir::Value* y = value(t(b, "other"));
      if (x->meta().rank() < 2 || y->meta().rank() < 2) fail_at(b, "matmul of a vector; spmdx's matmul takes rank >= 2");
      return set(b, g.add("matmul", {x, y}));
    }
    if (op == "aten.t.default") {
      ir::Value* x = value(t(b, "self"));
      return set(b, x->meta().rank() < 2 ? x : g.add("transpose", {x}, {{"dim0", std::int64_t{0}}, {"dim1", std::int64_t{1}}}));
    }
    if (op == "aten.transpose.int") return set(b, g.add("transpose", {value(t(b, "self"))}, {{"dim0", i(b, "dim0")}, {"dim1", i(b, "dim1")}}));
    if (op == "aten.permute.default") return set(b, g.add("permute", {value(t(b, "self"))}, {{"dims", b.arg("dims").value.toIntVector()}}));
    fail_at(b, "no mapping");  // listed for this family but not handled above
  }

  // elementwise arithmetic with tensors or scalars, and the unary ops
  void map_arith(const BoundNode& b) {
    const std::string& op = b.target;
    ir::Graph& g = m_.graph;
    if (op == "aten.mul.Tensor" && is_tensor(b, "other")) {
      Sym& x = sym(t(b, "self"));
      Sym& y = sym(t(b, "other"));
      if (x.kind == Sym::Kind::complex || y.kind == Sym::Kind::complex) return rotate(b, x.kind == Sym::Kind::complex ? x : y, x.kind == Sym::Kind::complex ? y : x);
      // RMSNorm: x * rsqrt(...), then weight * that (either order): one rms_norm.
      for (const auto& [a, other] : {std::pair{"self", "other"}, std::pair{"other", "self"}}) {
        const Sym& s = sym(t(b, a));
        const Sym& o = sym(t(b, other));
        if (s.kind != Sym::Kind::rms || o.kind != Sym::Kind::value) continue;
        if (s.step == Sym::RmsStep::inverse && o.v == s.v && rms_step(b, t(b, a), Sym::RmsStep::normed)) return;
        if (s.step == Sym::RmsStep::normed && o.v->meta().shape == Shape{s.v->meta().shape.back()} && o.v->meta().dtype == s.v->meta().dtype &&
            meta(b).sizes == s.v->meta().shape && ir_dtype(meta(b).dtype, "output") == s.v->meta().dtype) {
          return set(b, g.add("rms_norm", {s.v, o.v}, {{"eps", s.eps}}));
        }
      }
    }
    if (op == "aten.pow.Tensor_Scalar" && f(b, "exponent") == 2.0 && rms_step(b, t(b, "self"), Sym::RmsStep::square)) return;
    if ((op == "aten.add.Tensor" || op == "aten.add.Scalar") && !is_tensor(b, "other") && f(b, "alpha") == 1.0 &&
        rms_step(b, t(b, "self"), Sym::RmsStep::shifted, f(b, "other"))) {
      return;
    }
    if (op == "aten.rsqrt.default" && rms_step(b, t(b, "self"), Sym::RmsStep::inverse)) return;
    if (op == "aten.add.Tensor" || op == "aten.add.Scalar") return binary(b, "add", f(b, "alpha"));
    if (op == "aten.sub.Tensor" || op == "aten.sub.Scalar") return binary(b, "sub", f(b, "alpha"));
    if (op == "aten.mul.Tensor" || op == "aten.mul.Scalar") return binary(b, "mul", 1.0);
    if (op == "aten.div.Tensor" || op == "aten.div.Scalar") return binary(b, "div", 1.0);
    if (op == "aten.rsub.Scalar" || op == "aten.rsub.Tensor") {  // other - alpha * self
      ir::Value* x = g.add("mul_scalar", {value(t(b, "self"))}, {{"value", -f(b, "alpha")}});
      if (is_tensor(b, "other")) return set(b, g.add("add", {x, value(t(b, "other"))}));
      return set(b, g.add("add_scalar", {x}, {{"value", f(b, "other")}}));
    }
    if (op == "aten.pow.Tensor_Scalar") return set(b, g.add("pow_scalar", {value(t(b, "self"))}, {{"value", f(b, "exponent")}}));
    for (const char* unary : {"neg", "exp", "log", "sqrt", "rsqrt", "sigmoid", "tanh", "silu", "relu"}) {
      if (op == std::string("aten.") + unary + ".default") return set(b, g.add(unary, {value(t(b, "self"))}));
    }
    if (op == "aten.gelu.default") return set(b, g.add("gelu", {value(t(b, "self"))}, {{"approximate", b.arg("approximate").value.toStringRef()}}));
    fail_at(b, "no mapping");  // listed for this family but not handled above
  }

  // views, slices, concatenation, splits, expand
  void map_shape(const BoundNode& b) {
    const std::string& op = b.target;
    ir::Graph& g = m_.graph;
    check_shapes(b);
    if (op == "aten.view.default" || op == "aten.reshape.default" || op == "aten._unsafe_view.default" || op == "aten.flatten.using_ints" ||
        op == "aten.unsqueeze.default" || op == "aten.squeeze.dim" || op == "aten.squeeze.dims" || op == "aten.squeeze.default") {
      return set(b, reshape_to(value(t(b, "self")), meta(b).sizes));
    }
    if (op == "aten.slice.Tensor") {
      const c10::IValue& start = b.arg("start").value;
      const c10::IValue& end = b.arg("end").value;
      ir::Value* x = value(t(b, "self"));
      const std::int64_t dim = i(b, "dim") < 0 ? i(b, "dim") + x->meta().rank() : i(b, "dim");
      const std::int64_t step = i(b, "step");
      if (step == 1 && (start.isNone() || start.toInt() == 0) && meta(b).sizes == x->meta().shape) return set(b, x);  // the whole dim
      return set(b, g.add("slice", {x}, {{"dim", dim}, {"start", start.isNone() ? std::int64_t{0} : start.toInt()},
                                          {"end", end.isNone() ? std::numeric_limits<std::int64_t>::max() : end.toInt()}, {"step", step}}));
    }
    if (op == "aten.select.int") {
      ir::Value* x = value(t(b, "self"));
      std::int64_t index = i(b, "index");
      const std::int64_t dim = i(b, "dim") < 0 ? i(b, "dim") + x->meta().rank() : i(b, "dim");
      if (index < 0) index += x->meta().shape.at(static_cast<std::size_t>(dim));
      ir::Value* s = g.add("slice", {x}, {{"dim", dim}, {"start", index}, {"end", index + 1}});
      return set(b, reshape_to(s, meta(b).sizes));
    }
    if (op == "aten.cat.default") {
      std::vector<ir::Value*> xs;
      const ir::DType out = ir_dtype(meta(b).dtype, "output");
      for (const auto& n : b.arg("tensors").tensors) xs.push_back(cast(value(n), out));
      return set(b, g.add("cat", xs, {{"dim", i(b, "dim")}}));
    }
    // unbind (GPT-NeoX-style `q, k, v = qkv.unbind(dim)`): output k is index k along dim.
    if (op == "aten.unbind.int") {
      ir::Value* x = value(t(b, "self"));
      const std::int64_t dim = i(b, "dim") < 0 ? i(b, "dim") + x->meta().rank() : i(b, "dim");
      for (std::size_t k = 0; k < b.outputs.size(); ++k) {
        if (b.outputs[k].empty()) continue;
        const auto start = static_cast<std::int64_t>(k);
        set(b, reshape_to(g.add("slice", {x}, {{"dim", dim}, {"start", start}, {"end", start + 1}}), meta(b, k).sizes), k);
      }
      return;
    }
    // chunk (export's training IR keeps it; run_decompositions makes it split): the sizes are the
    // outputs' recorded ones.
    if (op == "aten.split.Tensor" || op == "aten.split_with_sizes.default" || op == "aten.chunk.default") {
      ir::Value* x = value(t(b, "self"));
      const std::int64_t dim = i(b, "dim") < 0 ? i(b, "dim") + x->meta().rank() : i(b, "dim");
      std::int64_t start = 0;
      for (std::size_t k = 0; k < b.outputs.size(); ++k) {
        const std::int64_t size = meta(b, k).sizes.at(static_cast<std::size_t>(dim));
        if (!b.outputs[k].empty()) set(b, g.add("slice", {x}, {{"dim", dim}, {"start", start}, {"end", start + size}}), k);
        start += size;
      }
      return;
    }
    if (op == "aten.expand.default") return set(b, g.add("expand", {value(t(b, "self"))}, {{"shape", meta(b).sizes}}));
    fail_at(b, "no mapping");  // listed for this family but not handled above
  }

  // sums, means, softmax
  void map_reduce(const BoundNode& b) {
    const std::string& op = b.target;
    ir::Graph& g = m_.graph;
    if (op == "aten.mean.dim" && sym(t(b, "self")).kind == Sym::Kind::rms && b.arg("keepdim").value.toBool() && b.arg("dtype").value.isNone()) {
      const Shape dims = dims_arg(b, "dim", sym(t(b, "self")).v->meta().shape.size());
      if (dims == Shape{static_cast<std::int64_t>(sym(t(b, "self")).v->meta().shape.size()) - 1} && rms_step(b, t(b, "self"), Sym::RmsStep::mean)) return;
    }
    if (op == "aten.sum.dim_IntList" || op == "aten.sum.default" || op == "aten.mean.dim" || op == "aten.mean.default") {
      ir::Value* x = value(t(b, "self"));
      const bool mean = op.rfind("aten.mean", 0) == 0;
      const bool has_dims = op == "aten.sum.dim_IntList" || op == "aten.mean.dim";
      ir::Attributes attrs{{"dims", has_dims ? dims_arg(b, "dim", x->meta().shape.size()) : Shape{}}, {"keepdim", has_dims && b.arg("keepdim").value.toBool()}};
      if (!b.arg("dtype").value.isNone()) x = cast(x, ir_dtype(b.arg("dtype").value.toScalarType(), "dtype"));
      return set(b, g.add(mean ? "mean" : "sum", {x}, attrs));
    }
    if (op == "aten.softmax.int" || op == "aten._softmax.default" || op == "aten.log_softmax.int" || op == "aten._log_softmax.default") {
      ir::Value* x = cast(value(t(b, "self")), ir_dtype(meta(b).dtype, "output"));
      const bool log = op.find("log_softmax") != std::string::npos;
      return set(b, g.add(log ? "log_softmax" : "softmax", {x}, {{"dim", i(b, "dim")}}));
    }
    fail_at(b, "no mapping");  // listed for this family but not handled above
  }

  // A Mixture of Experts' routing and experts (core/src/ops/moe.cpp): topk, sort / argsort,
  // gather, scatter_add, bincount (and histc of integer ids), cumsum of counts, floor_divide by
  // an int, _grouped_mm and transformers' grouped_mm_fallback. Outputs the program does not keep
  // are left out.
  void map_moe(const BoundNode& b) {
    const std::string& op = b.target;
    ir::Graph& g = m_.graph;
    auto set_kept = [&](ir::Value* v, std::size_t k) {
      if (k < b.outputs.size() && !b.outputs[k].empty()) set(b, v, k);
    };
    if (op == "aten.topk.default") {
      // spmdx's topk selects along the last dim: another dim is moved there and back.
      ir::Value* x = value(t(b, "self"));
      const auto rank = static_cast<std::int64_t>(x->meta().shape.size());
      const std::int64_t dim = i(b, "dim") < 0 ? i(b, "dim") + rank : i(b, "dim");
      const ir::Attributes swap{{"dim0", dim}, {"dim1", rank - 1}};
      const bool moved = rank > 1 && dim != rank - 1;
      if (moved) x = g.add("transpose", {x}, swap);
      ir::Node* n = g.add_node("topk", {x}, {{"k", i(b, "k")}, {"largest", b.arg("largest").value.toBool()}, {"sorted", b.arg("sorted").value.toBool()}});
      for (std::size_t k = 0; k < 2; ++k) set_kept(moved ? g.add("transpose", {n->output(static_cast<int>(k))}, swap) : n->output(static_cast<int>(k)), k);
      return;
    }
    if (op == "aten.sort.default" || op == "aten.sort.stable" || op == "aten.argsort.default" || op == "aten.argsort.stable") {
      // A stable sort: one of the orders an unstable one may give; the values gathered by it.
      ir::Value* x = value(t(b, "self"));
      const ir::Attributes dim{{"dim", i(b, "dim")}};
      ir::Value* order = g.add("argsort", {x}, {{"dim", i(b, "dim")}, {"descending", b.arg("descending").value.toBool()}, {"stable", true}});
      if (op.rfind("aten.argsort", 0) == 0) return set(b, order);
      set_kept(g.add("gather", {x, order}, dim), 0);
      set_kept(order, 1);
      return;
    }
    if (op == "aten.gather.default") {
      if (b.arg("sparse_grad").value.toBool()) fail_at(b, "gather with sparse_grad=True; spmdx's gradients are dense: export with sparse_grad=False");
      return set(b, g.add("gather", {value(t(b, "self")), cast(value(t(b, "index")), ir::DType::i64)}, {{"dim", i(b, "dim")}}));
    }
    if (op == "aten.scatter_add.default") {
      ir::Value* x = value(t(b, "self"));
      ir::Value* src = cast(value(t(b, "src")), x->meta().dtype);
      return set(b, g.add("scatter_add", {x, cast(value(t(b, "index")), ir::DType::i64), src}, {{"dim", i(b, "dim")}}));
    }
    if (op == "aten.bincount.default") {
      if (is_tensor(b, "weights")) fail_at(b, "bincount with weights; spmdx counts ids only (multiply the counts, or scatter_add the weights)");
      // The program's static output length is the number of bins; an id past it fails when the step runs.
      return set(b, g.add("bincount", {value(t(b, "self"))}, {{"minlength", meta(b).sizes.at(0)}}));
    }
    if (op == "aten.histc.default") {
      // transformers counts the tokens of each expert as histc(ids.float(), bins=E, min=0,
      // max=E-1) (a CPU's histc takes no integers): bins of width (E-1)/E put id e in bin e,
      // which is bincount(ids). An id outside [0, E) (histc drops it) fails when the step runs.
      ir::Value* x = value(t(b, "self"));
      const std::int64_t bins = i(b, "bins");
      ir::Node* from = x->producer();
      ir::Value* ids = from != nullptr && from->op() == "cast" && integer(from->input(0)) ? from->input(0) : nullptr;
      if (ids == nullptr || ids->meta().rank() != 1 || bins < 2 || f(b, "min") != 0.0 || f(b, "max") != static_cast<double>(bins - 1)) {
        fail_at(b, "histc of " + x->meta().str() + " into " + std::to_string(bins) + " bins over [" + std::to_string(f(b, "min")) + ", " + std::to_string(f(b, "max")) +
                       "]; spmdx maps histc(ids.float(), bins=n, min=0, max=n-1) of integer ids [k] (a count of each id, as bincount)");
      }
      return set(b, g.add("bincount", {ids}, {{"minlength", bins}}));  // set() casts the counts to histc's dtype
    }
    if (op == "aten.cumsum.default") {
      // Running sums of counts: a Mixture of Experts' group end rows (cumsum(counts, dtype=int32)).
      // A floating x is converted first, as torch does for an integer dtype; the sums are int64.
      const ir::DType out = ir_dtype(meta(b).dtype, "output");
      if (ir::is_floating(out)) fail_at(b, "a running sum of floating values; spmdx maps cumsum of integer counts only (a Mixture of Experts' group ends)");
      ir::Value* x = value(t(b, "self"));
      if (!integer(x)) x = cast(x, ir::DType::i64);
      return set(b, g.add("cumsum", {x}, {{"dim", i(b, "dim")}}));
    }
    if (op == "aten.floor_divide.default" || op == "aten.floor_divide.Scalar") {
      // A routed slot's token: slot // top_k.
      ir::Value* x = value(t(b, "self"));
      const Bound& by = b.arg("other");
      if (by.is_tensor || !by.value.isInt() || by.value.toInt() < 1 || !integer(x)) {
        fail_at(b, "floor_divide of " + x->meta().str() + " by " + (by.is_tensor ? "a tensor" : by.value.isInt() ? std::to_string(by.value.toInt()) : "a float") +
                       "; spmdx maps integer ids // a positive int (a routed slot's token, slot // top_k)");
      }
      return set(b, g.add("floor_divide_scalar", {x}, {{"value", by.value.toInt()}}));
    }
    if (op == "aten._grouped_mm.default" || op == "transformers.grouped_mm_fallback.default") {
      // transformers' grouped_mm_fallback (transformers/integrations/moe.py) is grouped_mm's
      // meaning: zeros, then rows [offs[g-1], offs[g]) times weight[g] for each nonempty group.
      const bool aten = op == "aten._grouped_mm.default";
      ir::Value* x = value(t(b, aten ? "self" : "input"));
      ir::Value* w = value(t(b, aten ? "mat2" : "weight"));
      if (x->meta().shape.size() != 2 || w->meta().shape.size() != 3 || !is_tensor(b, "offs")) {
        fail_at(b, std::string(aten ? "_grouped_mm" : "grouped_mm_fallback") + " of " + x->meta().str() + " and " + w->meta().str() + (is_tensor(b, "offs") ? "" : " without offs") +
                       "; spmdx maps the MoE form: x [tokens, k], w [groups, k, n] and offs");
      }
      if (aten && is_tensor(b, "bias")) fail_at(b, "_grouped_mm with a bias; spmdx maps it without one (add the bias after)");
      return set(b, g.add("grouped_mm", {x, w, value(t(b, "offs"))}));  // set() casts to out_dtype
    }
    fail_at(b, "no mapping");  // listed for this family but not handled above
  }

  // Indexing by integer tensors, as transformers' experts write their dispatch: x[ids] and
  // x[ids] = v (one index tensor, on dim 0), repeat_interleave by an int, empty_like.
  void map_index(const BoundNode& b) {
    const std::string& op = b.target;
    ir::Graph& g = m_.graph;
    // The one index tensor of `indices` (x[ids]: on dim 0), integer.
    auto row_ids = [&](ir::Value* x) {
      const Bound& ix = b.arg("indices");
      if (ix.tensors.size() != 1 || ix.tensors[0].empty() || x->meta().rank() < 1) {
        fail_at(b, "indexing " + x->meta().str() + " by " + std::to_string(ix.tensors.size()) +
                       " index tensors (None for a dim taken whole); spmdx maps x[ids]: one integer tensor indexing dim 0");
      }
      ir::Value* ids = value(ix.tensors[0]);
      if (!integer(ids)) fail_at(b, "indexing by a " + ids->meta().str() + " tensor (a mask: the result's size would depend on the data); spmdx maps integer indices");
      return ids;
    };
    if (op == "aten.index.Tensor") {
      // x[ids]: x's rows picked by id (a token's hidden state for each of its experts, an
      // expert's weights for each slot), an embedding lookup in x seen as [rows, the rest]; its
      // gradient adds each picked row back (embedding_backward). An id outside [0, rows)
      // (negative ones too, which x[ids] wraps) fails when the step runs.
      ir::Value* x = value(t(b, "self"));
      ir::Value* ids = row_ids(x);
      const std::int64_t rows = x->meta().shape[0];
      ir::Value* picked = g.add("embedding", {reshape_to(x, {rows, rows == 0 ? 0 : x->meta().numel() / rows}), ids});
      return set(b, reshape_to(picked, meta(b).sizes));
    }
    if (op == "aten.index_put.default") {
      // x[ids] += v (accumulate) is a scatter_add of v's rows into x's. x[ids] = v is one when
      // ids is a permutation of x's rows (an argsort's order: transformers inverts its dispatch
      // order so): every row is written once, so x itself is never read (zeros in its place).
      ir::Value* x = value(t(b, "self"));
      ir::Value* ids = row_ids(x);
      const bool accumulate = b.arg("accumulate").value.toBool();
      const Shape& xs = x->meta().shape;
      ir::Node* from = ids->producer();
      const bool permutation = from != nullptr && from->op() == "argsort" && from->input(0)->meta().rank() == 1 && ids->meta().shape == Shape{xs[0]};
      if (!accumulate && !permutation) {
        fail_at(b, "x[ids] = v with ids " + ids->meta().str() + " that may repeat a row (then which write wins is not defined); spmdx maps x[ids] += v "
                   "(accumulate=True), and x[ids] = v where ids is a permutation of x's rows (argsort's order)");
      }
      // scatter_add's index and src: one row of x's shape for each id.
      const std::int64_t n = ids->meta().numel();
      Shape each = ids->meta().shape, flat{n}, ones{n};
      for (std::size_t d = 1; d < xs.size(); ++d) {
        each.push_back(xs[d]);
        flat.push_back(xs[d]);
        ones.push_back(1);
      }
      ir::Value* v = cast(value(t(b, "values")), x->meta().dtype);
      if (v->meta().shape != each) v = g.add("expand", {v}, {{"shape", each}});
      ir::Value* index = reshape_to(cast(ids, ir::DType::i64), ones);
      if (ones != flat) index = g.add("expand", {index}, {{"shape", flat}});
      const bool zeros = x->producer() != nullptr && x->producer()->op() == "zeros_like";  // empty_like's
      ir::Value* base = accumulate || zeros ? x : g.add("zeros_like", {x});
      return set(b, g.add("scatter_add", {base, index, reshape_to(v, flat)}, {{"dim", std::int64_t{0}}}));
    }
    if (op == "aten.repeat_interleave.self_int") {
      // Each element along dim `repeats` times in a row (transformers' batched_mm experts copy each
      // token's hidden state for each of its top_k experts): x.unsqueeze(dim + 1), expanded
      // there, flattened back; without a dim, of x flattened.
      ir::Value* x = value(t(b, "self"));
      const std::int64_t r = i(b, "repeats");
      Shape s = x->meta().shape;
      std::int64_t dim = 0;
      if (none(b, "dim")) s = {x->meta().numel()};
      else dim = i(b, "dim") < 0 ? i(b, "dim") + static_cast<std::int64_t>(s.size()) : i(b, "dim");
      if (r < 0 || dim < 0 || dim >= static_cast<std::int64_t>(s.size())) fail_at(b, "repeat_interleave of " + x->meta().str() + " " + std::to_string(r) + " times along dim " + std::to_string(dim));
      s.insert(s.begin() + dim + 1, 1);
      ir::Value* one_each = reshape_to(x, s);
      s[static_cast<std::size_t>(dim + 1)] = r;
      return set(b, reshape_to(g.add("expand", {one_each}, {{"shape", s}}), meta(b).sizes));
    }
    if (op == "aten.empty_like.default") {
      // Memory not yet written: zeros are one of its values (transformers fills it by an
      // index_put that writes every row).
      return set(b, g.add("zeros_like", {value(t(b, "self"))}));  // set() casts to a dtype given
    }
    fail_at(b, "no mapping");  // listed for this family but not handled above
  }

  // dtype casts and copies (identity but for the dtype), dropout off
  void map_copy(const BoundNode& b) {
    const std::string& op = b.target;
    if (op == "aten._to_copy.default" || op == "aten.to.dtype" || op == "aten.to.dtype_layout" || op == "aten.type_as.default" ||
        op == "aten.clone.default" || op == "aten.contiguous.default" || op == "aten.alias.default" || op == "aten.detach.default" ||
        op == "aten.lift_fresh_copy.default") {
      if (op == "aten.detach.default") fail_at(b, "detach() stops gradients; spmdx's autodiff does not model it yet");
      return set(b, value(t(b, "self")));  // set() casts to the output's dtype
    }
    if (op == "aten.dropout.default") {
      if (b.arg("train").value.toBool() && f(b, "p") > 0) fail_at(b, "dropout with p > 0 in training; spmdx has no dropout yet: set p = 0");
      return set(b, value(t(b, "input")));
    }
    fail_at(b, "no mapping");  // listed for this family but not handled above
  }

  // torchtitan's complex rotary embedding
  void map_complex(const BoundNode& b) {
    const std::string& op = b.target;
    ir::Graph& g = m_.graph;
    if (op == "aten.view_as_complex.default") {
      ir::Value* x = value(t(b, "self"));
      if (x->meta().shape.empty() || x->meta().shape.back() != 2) fail_at(b, "view_as_complex of a tensor whose last dim is not 2");
      Sym s;
      s.kind = Sym::Kind::complex;
      s.v = x;
      env_[b.outputs[0]] = s;
      return;
    }
    if (op == "aten.view_as_real.default") {
      Sym& s = sym(t(b, "self"));
      if (s.kind != Sym::Kind::rotated) fail_at(b, "view_as_real of a complex value other than view_as_complex(x) * freqs_cis (torchtitan's rotary embedding)");
      // x[b, s, h, d/2, 2] -> [b, s, h, d] -> rotary_embedding -> back to pairs.
      const Shape& pairs = s.v->meta().shape;
      ir::Value* flat = reshape_to(s.v, {pairs[0], pairs[1], pairs[2], pairs[3] * 2});
      // One pair of tables for every use of the same frequencies (each layer's q and k).
      const at::Tensor cos_t = s.cos.to(exec::to_aten(flat->meta().dtype)), sin_t = s.sin.to(exec::to_aten(flat->meta().dtype));
      ir::Value* cos = nullptr;
      ir::Value* sin = nullptr;
      for (const auto& [c, s2, cv, sv] : rope_tables_) {
        if (c.sizes() == cos_t.sizes() && c.scalar_type() == cos_t.scalar_type() && at::equal(c, cos_t) && at::equal(s2, sin_t)) cos = cv, sin = sv;
      }
      if (cos == nullptr) {
        const std::string n = "rope" + (rope_tables_.empty() ? std::string() : std::to_string(rope_tables_.size()));
        cos = constant_input(n + ".cos", cos_t);
        sin = constant_input(n + ".sin", sin_t);
        rope_tables_.emplace_back(cos_t, sin_t, cos, sin);
      }
      return set(b, reshape_to(g.add("rotary_embedding", {flat, cos, sin}), pairs));
    }
    fail_at(b, "no mapping");  // listed for this family but not handled above
  }

  // masked_fill and where with a constant mask
  void map_select(const BoundNode& b) {
    const std::string& op = b.target;
    if (op == "aten.masked_fill.Scalar" || op == "aten.masked_fill.Tensor") {
      // x.masked_fill(mask, v) with a constant mask (a causal mask buffer): x * keep + fill,
      // keep = !mask and fill = where(mask, v, 0) computed here. Exact, and its gradient is
      // zero where masked, as masked_fill's (x finite).
      const Sym& mask = sym(t(b, "mask"));
      if (mask.kind != Sym::Kind::constant) fail_at(b, "masked_fill with a mask computed from the batch; spmdx takes masks computed from buffers (a causal mask) only");
      at::Tensor value;
      if (is_tensor(b, "value")) {
        const Sym& v = sym(t(b, "value"));
        if (v.kind != Sym::Kind::constant) fail_at(b, "masked_fill with a fill value computed from trainable values");
        value = v.c;
      } else {
        value = at::scalar_tensor(f(b, "value"), at::kDouble);
      }
      return select(b, value_of_mask(mask.c), t(b, "self"), value, /*fill_where_true=*/true);
    }
    if (op == "aten.where.ScalarOther" || op == "aten.where.ScalarSelf") {
      const Sym& cond = sym(t(b, "condition"));
      if (cond.kind != Sym::Kind::constant) fail_at(b, "where with a condition computed from the batch; spmdx takes conditions computed from buffers (a causal mask) only");
      const bool other_scalar = op == "aten.where.ScalarOther";
      const at::Tensor fill = at::scalar_tensor(f(b, other_scalar ? "other" : "self"), at::kDouble);
      return select(b, value_of_mask(cond.c), t(b, other_scalar ? "self" : "other"), fill, /*fill_where_true=*/!other_scalar);
    }
    if (op == "aten.where.self") {
      // where(cond, x, other) with a constant cond and one constant branch.
      const Sym& cond = sym(t(b, "condition"));
      const Sym& x = sym(t(b, "self"));
      const Sym& y = sym(t(b, "other"));
      if (cond.kind != Sym::Kind::constant) fail_at(b, "where with a condition computed from the batch; spmdx takes conditions computed from buffers (a causal mask) only");
      if (y.kind == Sym::Kind::constant) return select(b, value_of_mask(cond.c), t(b, "self"), y.c, /*fill_where_true=*/false);
      if (x.kind == Sym::Kind::constant) return select(b, value_of_mask(cond.c), t(b, "other"), x.c, /*fill_where_true=*/true);
      fail_at(b, "where with both branches computed from trainable values; spmdx takes one constant branch (a fill value)");
    }
    fail_at(b, "no mapping");  // listed for this family but not handled above
  }

  static at::Tensor value_of_mask(const at::Tensor& m) { return m.to(at::kBool); }

  // out = where(fill_where_true ? mask : !mask, fill, x) for a constant mask and fill, as
  // x * keep + fill_values: both constants, x read once. The output's dtype is the file's.
  void select(const BoundNode& b, const at::Tensor& mask, const std::string& x_name, const at::Tensor& fill, bool fill_where_true) {
    const Meta& out = meta(b);
    const at::TensorOptions options = at::TensorOptions().dtype(out.dtype);
    const at::Tensor filled = fill_where_true ? mask : mask.logical_not();
    const at::Tensor keep = filled.logical_not().to(options.dtype());
    const at::Tensor fill_values = at::where(filled, fill.to(at::kDouble), at::zeros({}, at::kDouble)).to(options.dtype());
    ir::Value* x = cast(value(x_name), ir_dtype(out.dtype, "output"));
    ir::Value* kept = m_.graph.add("mul", {x, constant_input(b.name + ".keep", keep)});
    ir::Value* y = m_.graph.add("add", {kept, constant_input(b.name + ".fill", fill_values)});
    set(b, y->meta().shape == out.sizes ? y : m_.graph.add("expand", {y}, {{"shape", out.sizes}}));
  }

  ir::Value* constant_input(const std::string& name, const at::Tensor& t) {
    const std::string input = "const." + name;
    ir::Value* v = m_.graph.add_input(input, {t.sizes().vec(), ir_dtype(t.scalar_type(), input), "cpu", false});
    add_init(input, t, false);
    return v;
  }

  // view_as_complex(x) * freqs_cis, x [b, s, h, d/2, 2] and freqs_cis broadcasting as [1, s, 1, d/2].
  void rotate(const BoundNode& b, const Sym& x, const Sym& freqs) {
    const Shape& pairs = x.v->meta().shape;
    if (freqs.kind != Sym::Kind::constant || pairs.size() != 5) {
      fail_at(b, "a complex product other than torchtitan's rotary embedding (view_as_complex(x[batch, seq, heads, head_dim/2, 2]) * freqs_cis, a buffer)");
    }
    at::Tensor f = freqs.c;
    while (f.dim() > 2 && f.size(0) == 1) f = f.squeeze(0);
    if (f.dim() == 3 && f.size(1) == 1) f = f.squeeze(1);
    if (f.dim() != 2 || f.size(0) != pairs[1] || f.size(1) != pairs[3]) {
      fail_at(b, "freqs_cis " + ir::shape_str(freqs.c.sizes().vec()) + " does not broadcast as [1, " + std::to_string(pairs[1]) + ", 1, " + std::to_string(pairs[3]) + "] (torchtitan's reshape_for_broadcast)");
    }
    Sym s;
    s.kind = Sym::Kind::rotated;
    s.v = x.v;
    s.cos = at::real(f).contiguous();
    s.sin = at::imag(f).contiguous();
    env_[b.outputs[0]] = s;
  }

  void norm(const BoundNode& b) {
    const bool rms = b.target == "aten.rms_norm.default";
    ir::Value* x = value(t(b, "input"));
    const Shape shape = b.arg("normalized_shape").value.toIntVector();
    if (x->meta().shape.empty() || shape != Shape{x->meta().shape.back()}) fail_at(b, "normalizes over " + ir::shape_str(shape) + "; spmdx's norms take the last dim only");
    const at::TensorOptions options = at::TensorOptions().dtype(exec::to_aten(x->meta().dtype));
    auto weight = [&](const char* n, bool ones) -> ir::Value* {
      if (is_tensor(b, n)) return value(t(b, n));
      return constant_input(b.name + "." + n, ones ? at::ones(shape, options) : at::zeros(shape, options));
    };
    double eps = 1e-5;
    if (!b.arg("eps").value.isNone()) eps = b.arg("eps").value.toDouble();
    else if (rms) eps = std::numeric_limits<float>::epsilon();  // torch.finfo(float32).eps, as nn.RMSNorm(eps=None)
    if (rms) return set(b, m_.graph.add("rms_norm", {x, weight("weight", true)}, {{"eps", eps}}));
    set(b, m_.graph.add("layer_norm", {x, weight("weight", true), weight("bias", false)}, {{"eps", eps}}));
  }

  void attention(const BoundNode& b) {
    ir::Graph& g = m_.graph;
    // A mask computed from positions and buffers (what transformers builds under torch.export,
    // and minGPT's or nanoGPT's tril buffers) is a constant here: the causal one becomes the
    // causal kernel, a causal one within a window of W tokens the tiled window kernel (sdpa's
    // window), any other (a prefix, a document mask) a general masked attention below.
    at::Tensor mask;
    if (is_tensor(b, "attn_mask")) {
      const Sym& m = sym(t(b, "attn_mask"));
      if (m.kind != Sym::Kind::constant) {
        fail_at(b, "attention with a mask computed from the batch (a padding mask from an attention_mask input, or a document mask from the ids); "
                   "spmdx takes masks computed from positions and buffers: export forward(input_ids) without attention_mask");
      }
      if (b.arg("is_causal").value.toBool()) fail_at(b, "attention with both attn_mask and is_causal=True (PyTorch refuses it too)");
      mask = m.c;
    }
    if (f(b, "dropout_p") != 0.0) fail_at(b, "attention dropout (dropout_p " + std::to_string(f(b, "dropout_p")) + "); export with dropout_p = 0");
    ir::Value* q = value(t(b, "query"));
    ir::Value* k = value(t(b, "key"));
    ir::Value* v = value(t(b, "value"));
    const Shape qs = q->meta().shape, ks = k->meta().shape;
    if (qs.size() != 4 || ks.size() != 4) fail_at(b, "attention on rank-" + std::to_string(qs.size()) + " tensors; spmdx's takes [batch, heads, seq, head_dim]");
    if (!b.arg("scale").value.isNone()) {  // spmdx's sdpa scales by 1/sqrt(head_dim): fold the rest into q
      const double want = b.arg("scale").value.toDouble();
      q = g.add("mul_scalar", {q}, {{"value", want * std::sqrt(static_cast<double>(qs[3]))}});
    }
    if (ks[1] != qs[1]) {
      if (!b.arg("enable_gqa").value.toBool() || qs[1] % ks[1] != 0) fail_at(b, "q has " + std::to_string(qs[1]) + " heads, k and v " + std::to_string(ks[1]) + "; pass enable_gqa=True (or repeat k and v)");
      // enable_gqa repeats each KV head heads/kv_heads times in a row (repeat_interleave on dim -3).
      const std::int64_t rep = qs[1] / ks[1];
      auto repeat = [&](ir::Value* x) {
        const Shape s = x->meta().shape;
        ir::Value* e = g.add("expand", {reshape_to(x, {s[0], s[1], 1, s[2], s[3]})}, {{"shape", Shape{s[0], s[1], rep, s[2], s[3]}}});
        return reshape_to(e, {s[0], s[1] * rep, s[2], s[3]});
      };
      k = repeat(k);
      v = repeat(v);
    }
    bool causal = b.arg("is_causal").value.toBool();
    std::int64_t window = 0;
    if (mask.defined()) {
      const at::Tensor bias = attention_bias(b, mask, qs[2], ks[2], aten_dtype_of(q));
      if (is_causal_bias(bias, qs[2], ks[2])) {
        causal = true;
      } else if ((window = sliding_window_of(bias, qs[2], ks[2])) > 0) {
        causal = true;
      } else {
        // softmax(q k^T / sqrt(d) + bias) v, as PyTorch's math attention (a boolean mask is 0 where
        // kept and -inf where masked): matmul, scale, add, softmax, matmul, each with its rules.
        ir::Value* kt = g.add("transpose", {k}, {{"dim0", std::int64_t{-2}}, {"dim1", std::int64_t{-1}}});
        ir::Value* scores = g.add("mul_scalar", {g.add("matmul", {q, kt})}, {{"value", 1.0 / std::sqrt(static_cast<double>(qs[3]))}});
        scores = g.add("add", {scores, constant_input(b.name + ".attn_bias", bias)});
        return set(b, g.add("matmul", {g.add("softmax", {scores}, {{"dim", std::int64_t{-1}}}), v}));
      }
    }
    set(b, g.add_node("sdpa", {q, k, v}, {{"causal", causal}, {"window", window}})->output(0));
  }

  static at::ScalarType aten_dtype_of(const ir::Value* v) { return exec::to_aten(v->meta().dtype); }

  // The additive attention bias of a constant attn_mask, in the scores' dtype: a boolean mask as
  // 0 (attend) and -inf (not), a float mask as is (PyTorch's sdpa adds it). Broadcast to
  // [batch or 1, heads or 1, q_len, kv_len] and collapsed over batch and heads where every
  // slice is the same (transformers' [batch, 1, s, s] mask is one [s, s] pattern repeated).
  at::Tensor attention_bias(const BoundNode& b, at::Tensor mask, std::int64_t q_len, std::int64_t kv_len, at::ScalarType dtype) {
    while (mask.dim() < 4) mask = mask.unsqueeze(0);
    if (mask.dim() != 4 || mask.size(2) != q_len || mask.size(3) != kv_len) {
      if (mask.dim() == 4 && (mask.size(2) == 1 || mask.size(3) == 1)) {
        mask = mask.expand({mask.size(0), mask.size(1), q_len, kv_len});
      } else {
        fail_at(b, "attn_mask " + ir::shape_str(mask.sizes().vec()) + " does not broadcast as [batch, heads, " + std::to_string(q_len) + ", " + std::to_string(kv_len) + "]");
      }
    }
    for (int d = 0; d < 2; ++d) {
      if (mask.size(d) > 1 && mask.narrow(d, 0, 1).expand_as(mask).equal(mask)) mask = mask.narrow(d, 0, 1);
    }
    at::Tensor bias = mask.scalar_type() == at::kBool
                          ? at::where(mask, at::zeros({}, at::kDouble), at::full({}, -std::numeric_limits<double>::infinity(), at::kDouble))
                          : mask;
    return bias.to(dtype).contiguous();
  }

  // Whether an additive bias is the causal mask: 0 on and below the diagonal, -inf above, the
  // same for every batch row and head (as is_causal=True: the top-left aligned lower triangle).
  static bool is_causal_bias(const at::Tensor& bias, std::int64_t q_len, std::int64_t kv_len) {
    if (q_len != kv_len || bias.size(0) != 1 || bias.size(1) != 1) return false;
    const at::Tensor allowed = at::ones({q_len, kv_len}, at::kBool).tril();
    const at::Tensor m = bias[0][0];
    return m.isneginf().logical_not().equal(allowed) && m.masked_select(allowed).eq(0).all().item<bool>();
  }

  // The window W of an additive bias that is causal within W tokens (key j kept for query i when
  // i - W < j <= i, transformers' sliding_window_causal_mask_function), the same for every batch
  // row and head, with W < the sequence (a wider one is the causal mask); else 0.
  static std::int64_t sliding_window_of(const at::Tensor& bias, std::int64_t q_len, std::int64_t kv_len) {
    if (q_len != kv_len || q_len < 2 || bias.size(0) != 1 || bias.size(1) != 1) return 0;
    const at::Tensor m = bias[0][0], kept = m.isneginf().logical_not();
    const std::int64_t window = kept[q_len - 1].sum().item<std::int64_t>();
    if (window < 1 || window >= q_len) return 0;
    const at::Tensor ones = at::ones({q_len, kv_len}, at::kBool);
    const at::Tensor allowed = ones.tril().logical_and_(ones.triu(-(window - 1)));
    return kept.equal(allowed) && m.masked_select(allowed).eq(0).all().item<bool>() ? window : 0;
  }

  // Mean cross entropy becomes sum / count of valid targets, as the built-in models' loss: both
  // stay exact when the tokens are split over ranks.
  void cross_entropy(const BoundNode& b) {
    if (is_tensor(b, "weight")) fail_at(b, "cross entropy with class weights");
    if (f(b, "label_smoothing") != 0.0) fail_at(b, "cross entropy with label_smoothing " + std::to_string(f(b, "label_smoothing")));
    ir::Value* logits = value(t(b, "self"));
    ir::Value* target = value(t(b, "target"));
    if (logits->meta().rank() != 2 || target->meta().rank() != 1) fail_at(b, "cross entropy of " + logits->meta().str() + " and " + target->meta().str() + "; flatten to logits [N, classes] and targets [N]");
    const std::int64_t reduction = i(b, "reduction");
    const std::int64_t ignore = i(b, "ignore_index");
    if (reduction == 0) fail_at(b, "cross entropy with reduction='none'; reduce to the mean or the sum");
    vocab_ = logits->meta().shape[1];
    ir::Value* total = m_.graph.add("cross_entropy", {logits, target}, {{"reduction", std::string("sum")}, {"ignore_index", ignore}});
    if (reduction == 2) return set(b, total);
    ir::Value* count = m_.graph.add("count_valid", {target}, {{"ignore_index", ignore}, {"dtype", std::string(ir::to_string(logits->meta().dtype))}});
    set(b, m_.graph.add("div", {total, count}));
  }

  void finish() {
    if (p_.outputs.size() != 1) fail_("the program returns " + std::to_string(p_.outputs.size()) + " tensors; return the loss or the logits, one tensor");
    ir::Value* out = value(p_.outputs[0]);
    const bool scalar = out->meta().shape.empty();
    const std::string& loss = args_.loss;
    if (loss != "auto" && loss != "cross_entropy" && loss != "output") fail_("model.loss is \"" + loss + "\"; use \"auto\", \"cross_entropy\" or \"output\"");
    if (scalar) {
      if (loss == "cross_entropy") fail_("model.loss = \"cross_entropy\" but the program returns a scalar " + out->meta().str() + " (a loss already): use \"output\" or \"auto\"");
      if (!ir::is_floating(out->meta().dtype)) fail_("the program returns " + out->meta().str() + ", not a floating loss");
      if (!takes_labels_) fail_("the program takes no labels but returns a scalar; spmdx trains forward(tokens, labels) -> loss or forward(tokens) -> logits");
      m_.graph.add_output("loss", cast(out, ir::DType::f32));
    } else {
      if (loss == "output") fail_("model.loss = \"output\" but the program returns " + out->meta().str() + ", not a scalar loss");
      if (takes_labels_) fail_("the program takes labels but returns " + out->meta().str() + ", not a scalar loss; return the loss, or take tokens only and let spmdx append cross entropy");
      const Shape& s = out->meta().shape;
      const std::int64_t classes = s.back();
      ir::Value* labels = m_.graph.find_input("labels");
      const std::int64_t rows = labels->meta().numel();
      if (out->meta().numel() != rows * classes) fail_("the program returns " + out->meta().str() + ", not logits [batch, seq, vocab] for tokens " + labels->meta().str());
      ir::Value* logits = cast(reshape_to(out, {rows, classes}), ir::DType::f32);
      ir::Value* flat = reshape_to(labels, {rows});
      ir::Value* total = m_.graph.add("cross_entropy", {logits, flat}, {{"reduction", std::string("sum")}});
      ir::Value* count = m_.graph.add("count_valid", {flat}, {{"dtype", std::string("f32")}});
      m_.graph.add_output("loss", m_.graph.add("div", {total, count}));
      vocab_ = classes;
    }
    m_.args.vocab_size = vocab_;
    // Nodes nothing reads (reshapes collapsed into one, values only the loss's other branch used).
    std::vector<ir::Node*> nodes;
    for (const auto& n : m_.graph.nodes()) nodes.push_back(n.get());
    std::set<const ir::Value*> outputs;
    for (const auto& [name, v] : m_.graph.outputs()) outputs.insert(v);
    for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
      bool used = false;
      for (const ir::Value* v : (*it)->outputs()) used = used || !v->uses().empty() || outputs.count(v);
      if (!used) m_.graph.erase(*it);
    }
    m_.graph.verify();
  }

 public:
  const Archive& a_;
  const Program& p_;
  const ModelArgs& args_;
  Model& m_;
  Fail fail_;
  const BoundNode* current_ = nullptr;  // the node being mapped, for messages
  std::map<std::string, Sym> env_;
  std::map<std::string, std::string> constant_names_;  // graph arg -> buffer/constant fqn
  std::map<std::string, std::string> arg_of_param_;    // parameter fqn -> graph arg
  std::vector<ExpertsRegion> experts_;                  // expert parallelism: the experts modules replaced
  std::map<std::string, std::size_t> region_of_;        // their nodes (by name) -> experts_
  std::vector<std::tuple<at::Tensor, at::Tensor, ir::Value*, ir::Value*>> rope_tables_;  // cos, sin and their inputs
  bool takes_labels_ = false;
  std::int64_t vocab_ = 0;
};

std::string dtype_name(at::ScalarType t) {
  try {
    return ir::to_string(exec::from_aten(t));
  } catch (const std::exception&) {
    return t == at::kComplexFloat ? "complex64" : t == at::kComplexDouble ? "complex128" : c10::toString(t);
  }
}

// Registers the importer with build_model when this library is loaded.
const bool registered = [] {
  set_importer(import_pt2);
  set_import_release([] {
    std::lock_guard<std::mutex> lock(cache_mu);
    cache.clear();
  });
  return true;
}();

Pt2Summary summarize(const std::string& path);

// Runs `f`, turning what a malformed program makes the JSON library or a lookup throw into an
// ImportError naming the file.
template <class F>
auto guarded(const std::string& path, F f) -> decltype(f()) {
  try {
    return f();
  } catch (const ImportError&) {
    throw;
  } catch (const JsonError& e) {
    throw ImportError(path + ": " + e.what() + ": the file is damaged; save it again with torch.export.save");
  } catch (const json::exception& e) {
    throw ImportError(path + ": the program's JSON is malformed (" + e.what() + "): the file is damaged; save it again with torch.export.save");
  } catch (const c10::Error& e) {
    throw ImportError(path + ": " + e.what_without_backtrace());
  } catch (const std::logic_error& e) {  // out_of_range (map::at, vector::at), length_error, invalid_argument
    throw ImportError(path + ": the program refers to something it does not define (" + e.what() + "): the file is damaged; save it again with torch.export.save");
  }
}

}  // namespace

std::int64_t Pt2Summary::parameter_count() const {
  std::int64_t n = 0;
  for (const auto& p : parameters) {
    std::int64_t e = 1;
    for (auto d : p.shape) e *= d;
    n += e;
  }
  return n;
}

std::int64_t Pt2Summary::parameter_bytes() const {
  std::int64_t n = 0;
  for (const auto& p : parameters) n += p.bytes;
  return n;
}

Pt2Summary summarize_pt2(const std::string& path) {
  return guarded(path, [&] { return summarize(path); });
}

Model import_pt2(const ModelArgs& args) {
  try {
    return guarded(args.path, [&] {
      const auto a = archive(args.path);
      const Program p = read_program(*a);
      Model m;
      m.args = args;
      Mapper mapper(*a, p, args, m);
      mapper.run();
      return m;
    });
  } catch (const ImportError& first) {
    // Every construct spmdx cannot train, in one list (as `spmdx import` prints it), not only
    // the first that stopped the mapping: a user fixes them all in one round.
    std::vector<Pt2Summary::Unsupported> all;
    try {
      all = summarize_pt2(args.path).unsupported;
    } catch (const std::exception&) {
      throw first;  // the file itself is damaged: the first error says where
    }
    if (all.size() < 2) throw;
    std::string list;
    for (const auto& u : all) list += "\n  " + u.op + " at node '" + u.node + "'" + (u.source.empty() ? "" : ": " + u.source) + " (" + u.why + ")";
    throw ImportError(args.path + ": " + std::to_string(all.size()) + " nodes spmdx cannot train (`spmdx import " + args.path + "` lists them too):" + list);
  }
}

namespace {

Pt2Summary summarize(const std::string& path) {
  (void)registered;
  const auto a = archive(path);
  const Program p = read_program(*a);
  const Fail fail{path};
  Pt2Summary s;
  s.path = path;
  s.torch_version = p.torch_version;
  s.schema_version = p.schema_version;
  s.verifier = p.verifier;
  auto tensor = [](const std::string& name, const at::Tensor& t) {
    return Pt2Summary::Tensor{name, t.sizes().vec(), dtype_name(t.scalar_type()), static_cast<std::int64_t>(t.nbytes())};
  };
  const InputRoles roles = classify_inputs(*a, p);
  for (const auto& arg : roles.user) {
    const Meta& m = p.values.at(arg);
    s.inputs.push_back({arg, m.sizes, dtype_name(m.dtype), 0});
  }
  for (const auto& in : roles.parameters) s.parameters.push_back(tensor(in.fqn, in.value));
  for (const auto& [alias, param] : roles.tied) s.tied.emplace_back(alias.fqn, param);
  for (const auto& in : roles.frozen) s.buffers.push_back(tensor(in.fqn, in.value));
  for (const auto& o : p.outputs) {
    auto m = p.values.find(o);
    if (m != p.values.end()) s.outputs.push_back({o, m->second.sizes, dtype_name(m->second.dtype), 0});
  }
  // Which nodes could map: ops in the table, and any op the importer computes ahead.
  std::set<std::string> frozen;
  for (const auto& in : roles.frozen) frozen.insert(in.arg);
  for (const auto& node : p.graph["nodes"].elements()) {
    BoundNode b = bind_node(fail, node);
    ++s.ops[b.target];
    if (foldable(b, [&](const std::string& name) { return frozen.count(name) > 0; }) && !b.op->hasTag(at::Tag::nondeterministic_seeded)) {
      for (const auto& o : b.outputs) frozen.insert(o);
      continue;
    }
    if (!Mapper::mapped_ops().count(b.target)) {
      s.unsupported.push_back({b.target, b.name, source_line(node),
                               b.op && b.op->hasTag(at::Tag::nondeterministic_seeded) ? "a random op: export in eval() mode" : "spmdx has no mapping for it"});
    } else if (b.target == "aten.cumsum.default" && !b.outputs.empty() && p.values.count(b.outputs[0]) && at::isFloatingType(p.values.at(b.outputs[0]).dtype)) {
      s.unsupported.push_back({b.target, b.name, source_line(node), "a running sum of floating values: spmdx maps cumsum of integer counts only (a Mixture of Experts' group ends)"});
    } else if (b.target == "aten.scaled_dot_product_attention.default" && b.arg("attn_mask").is_tensor && !frozen.count(b.arg("attn_mask").tensors.front())) {
      // A mask computed from positions and buffers folds to a constant; one from the batch does not.
      s.unsupported.push_back({b.target, b.name, source_line(node),
                               "attention with a mask computed from the batch (a padding mask from an attention_mask input): export forward(input_ids) "
                               "without attention_mask, so that the mask comes from positions only"});
    }
  }
  return s;
}

}  // namespace
}  // namespace spmdx::models
