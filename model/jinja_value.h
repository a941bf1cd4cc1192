// The values a chat template computes with, and the Python semantics Jinja gives them.
//
// Jinja is Python underneath: `+` on two strings concatenates, `str.strip()` strips Unicode
// white space, `{{ 1.0 }}` prints "1.0", `[1] == [1]`, a dict iterates its keys in insertion
// order. transformers renders chat templates with Jinja2, so baton must reproduce those rules
// wherever a template can observe them. Strings are UTF-8 bytes; indexing and slicing count
// code points, as Python's str does.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace baton::jinja {

// What a template did wrong while rendering (a type error, an undefined value used, or the
// template's own raise_exception()). Thrown inside the engine only; Template turns it into a
// Status at its boundary.
struct RenderError : std::runtime_error {
  using std::runtime_error::runtime_error;
  bool raised = false;  // from raise_exception(): the template refuses this conversation
};

class Value {
 public:
  enum class Type { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict };
  using List = std::vector<Value>;
  using Dict = std::vector<std::pair<std::string, Value>>;  // insertion order, as Python's dict

  Value() = default;  // undefined
  Value(bool b) : type_(Type::kBool), int_(b) {}
  Value(int v) : type_(Type::kInt), int_(v) {}
  Value(int64_t v) : type_(Type::kInt), int_(v) {}
  Value(double v) : type_(Type::kFloat), float_(v) {}
  Value(std::string s) : type_(Type::kString), str_(std::move(s)) {}
  Value(const char* s) : Value(std::string(s)) {}
  static Value none();
  static Value list(List items = {});
  static Value dict(Dict items = {});
  // A namespace() object: a dict whose attributes `{% set ns.x = ... %}` may assign.
  static Value name_space(Dict items = {});

  Type type() const { return type_; }
  bool is_undefined() const { return type_ == Type::kUndefined; }
  bool is_none() const { return type_ == Type::kNone; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_number() const { return type_ == Type::kInt || type_ == Type::kFloat || type_ == Type::kBool; }
  bool is_list() const { return type_ == Type::kList; }
  bool is_dict() const { return type_ == Type::kDict; }
  bool is_namespace() const { return type_ == Type::kDict && namespace_; }

  const std::string& str() const { return str_; }
  int64_t as_int() const { return int_; }  // bool or int
  double as_float() const { return type_ == Type::kFloat ? float_ : static_cast<double>(int_); }
  const List& items() const { return *list_; }
  const Dict& entries() const { return *dict_; }
  // The entry for `key`, or nullptr.
  const Value* find(std::string_view key) const;
  // Sets `key` on a namespace or dict (shared: every copy of this value sees it).
  void set(const std::string& key, Value v);

  bool truthy() const;
  // str(value) as Jinja prints it in {{ }}: undefined -> "", None -> "None", True -> "True".
  std::string to_string() const;
  // Python's repr(): strings quoted, as inside a printed list.
  std::string repr() const;
  // What a {% for %} iterates: a list's items, a dict's keys, a string's characters.
  List iterate() const;
  std::string type_name() const;

 private:
  Type type_ = Type::kUndefined;
  bool namespace_ = false;
  int64_t int_ = 0;
  double float_ = 0;
  std::string str_;
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
};

// Python's ==: numbers by value (True == 1), lists and dicts element by element.
bool equals(const Value& a, const Value& b);
// Python's <, for numbers and strings; anything else raises, as Python does.
bool less(const Value& a, const Value& b);
// Python's `x in seq`: a substring of a string, a key of a dict, an item of a list; false for
// undefined; anything else raises.
bool contains(const Value& seq, const Value& x);

// Python str methods on UTF-8 text.
bool is_python_space(uint32_t cp);
std::string py_strip(std::string_view s, bool left, bool right);  // white space
std::string py_strip_chars(std::string_view s, std::string_view chars, bool left, bool right);
std::vector<std::string> py_split(std::string_view s);  // on runs of white space
std::vector<std::string> py_split(std::string_view s, std::string_view sep, int64_t max_split);
std::string py_upper(std::string_view s);  // ASCII letters only; others as they are
std::string py_lower(std::string_view s);
std::string py_title(std::string_view s);
std::string py_capitalize(std::string_view s);
std::vector<std::string> code_points(std::string_view s);  // one string per character

// transformers' tojson: json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=...).
std::string to_json(const Value& v, int indent, bool sort_keys);

}  // namespace baton::jinja
