// Reading a JSON document a user hands spmdx (a .pt2 program, a tokenizer.json) with every
// access checked: a missing member or a value of the wrong type is refused naming where it is,
// as a JSON pointer (RFC 6901: "/graph_module/graph/nodes/3/target"), and what is there
// ("is 5, not a string"), instead of nlohmann's "type must be string, but is number", which
// names neither. The reader catches JsonError and adds its file's name and what to do. Private
// to the core's readers (header only: nlohmann::json is no part of spmdx's public headers).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace spmdx {

/// What JsonAt throws: what() is a whole sentence ("models/model.json /graph_module/graph/nodes/3/name
/// is 5, not a string"); pointer() is where.
class JsonError : public std::runtime_error {
 public:
  JsonError(std::string pointer, const std::string& message) : std::runtime_error(message), pointer_(std::move(pointer)) {}
  const std::string& pointer() const noexcept { return pointer_; }

 private:
  std::string pointer_;
};

/// A value of a parsed document and where it is in it. Cheap to copy; refers to the document,
/// which must outlive it.
class JsonAt {
 public:
  using json = nlohmann::json;

  JsonAt() : v_(&null_value()) {}
  /// The root of a document; `document` names it in messages ("models/model.json"; "" when the
  /// reader names the file itself).
  explicit JsonAt(const json& root, const std::string& document = "")
      : v_(&root), doc_(document.empty() ? nullptr : std::make_shared<const std::string>(document)) {}

  const json& raw() const { return *v_; }
  const std::string& pointer() const { return pointer_; }
  /// The document's name and the pointer, for messages: "models/model.json /graph_module",
  /// "/model/vocab"; the root: the document's name or "the top level".
  std::string where() const {
    if (pointer_.empty()) return doc_ ? *doc_ : "the top level";
    return doc_ ? *doc_ + " " + pointer_ : pointer_;
  }

  bool is_null() const { return v_->is_null(); }
  bool is_object() const { return v_->is_object(); }
  bool is_array() const { return v_->is_array(); }
  bool is_string() const { return v_->is_string(); }
  bool is_whole() const {
    return v_->is_number_integer() && !(v_->is_number_unsigned() && v_->get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX));
  }

  // ---- Objects

  /// Whether this is an object with member `key`.
  bool has(const std::string& key) const { return v_->is_object() && v_->contains(key); }
  /// Member `key`: this must be an object that has it.
  JsonAt operator[](const std::string& key) const {
    object();
    auto it = v_->find(key);
    if (it == v_->end()) fail("has no \"" + key + "\"");
    return child(*it, key);
  }
  /// Member `key`, or nothing when this is an object without it or with it null (an optional
  /// member). This must be an object.
  std::optional<JsonAt> find(const std::string& key) const {
    object();
    auto it = v_->find(key);
    if (it == v_->end() || it->is_null()) return std::nullopt;
    return child(*it, key);
  }
  /// The members in the document's order (nlohmann's: sorted by key); this must be an object.
  std::vector<std::pair<std::string, JsonAt>> members() const {
    object();
    std::vector<std::pair<std::string, JsonAt>> out;
    out.reserve(v_->size());
    for (auto it = v_->begin(); it != v_->end(); ++it) out.emplace_back(it.key(), child(it.value(), it.key()));
    return out;
  }
  /// An optional member read with its default when absent or null.
  std::string str_or(const std::string& key, const std::string& otherwise) const {
    const auto v = find(key);
    return v ? v->str() : otherwise;
  }
  bool bool_or(const std::string& key, bool otherwise) const {
    const auto v = find(key);
    return v ? v->boolean() : otherwise;
  }
  std::int64_t whole_or(const std::string& key, std::int64_t otherwise) const {
    const auto v = find(key);
    return v ? v->whole() : otherwise;
  }
  double number_or(const std::string& key, double otherwise) const {
    const auto v = find(key);
    return v ? v->number() : otherwise;
  }

  // ---- Arrays

  /// Element i: this must be an array that long.
  JsonAt at(std::size_t i) const {
    array();
    if (i >= v_->size()) fail("has " + std::to_string(v_->size()) + " elements, not the " + std::to_string(i + 1) + " expected");
    return child((*v_)[i], std::to_string(i));
  }
  /// The elements; this must be an array.
  std::vector<JsonAt> elements() const {
    array();
    std::vector<JsonAt> out;
    out.reserve(v_->size());
    for (std::size_t i = 0; i < v_->size(); ++i) out.push_back(child((*v_)[i], std::to_string(i)));
    return out;
  }
  /// Elements of an array or members of an object; 0 for other values.
  std::size_t size() const { return v_->is_array() || v_->is_object() ? v_->size() : 0; }

  // ---- Values

  const std::string& str() const {
    if (!v_->is_string()) wrong("a string");
    return v_->get_ref<const std::string&>();
  }
  /// A whole number in int64's range (not 2.5, not 1e30: nlohmann's get<int64_t> of 1e30 is
  /// undefined and of 2.5 truncates).
  std::int64_t whole() const {
    if (!is_whole()) wrong("a whole number");
    return v_->get<std::int64_t>();
  }
  double number() const {
    if (!v_->is_number()) wrong("a number");
    return v_->get<double>();
  }
  bool boolean() const {
    if (!v_->is_boolean()) wrong("true or false");
    return v_->get<bool>();
  }
  const JsonAt& object() const {
    if (!v_->is_object()) wrong("an object");
    return *this;
  }
  const JsonAt& array() const {
    if (!v_->is_array()) wrong("an array");
    return *this;
  }

  /// The value as the document has it, cut to `most` characters.
  std::string shown(std::size_t most = 60) const {
    std::string s = v_->dump(-1, ' ', false, json::error_handler_t::replace);
    return s.size() > most ? s.substr(0, most - 3) + "..." : s;
  }
  /// Throws JsonError: "<where> is <value>, not <want>".
  [[noreturn]] void wrong(const std::string& want) const { throw JsonError(pointer_, where() + " is " + shown() + ", not " + want); }
  /// Throws JsonError: "<where> <why>".
  [[noreturn]] void fail(const std::string& why) const { throw JsonError(pointer_, where() + " " + why); }

 private:
  static const json& null_value() {
    static const json null;
    return null;
  }
  // RFC 6901: '~' is written "~0" and '/' "~1" in a pointer's tokens.
  JsonAt child(const json& v, const std::string& token) const {
    JsonAt c;
    c.v_ = &v;
    c.doc_ = doc_;
    c.pointer_.reserve(pointer_.size() + token.size() + 1);
    c.pointer_ = pointer_;
    c.pointer_ += '/';
    for (char ch : token) {
      if (ch == '~') c.pointer_ += "~0";
      else if (ch == '/') c.pointer_ += "~1";
      else c.pointer_ += ch;
    }
    return c;
  }

  const json* v_;
  std::shared_ptr<const std::string> doc_;
  std::string pointer_;
};

}  // namespace spmdx
