#include "model/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include "model/utf8.h"

namespace baton::jinja {
namespace {

// The code point at `pos` and its length; an invalid byte is one unit that is not white space.
std::pair<uint32_t, size_t> code_point_at(std::string_view s, size_t pos) {
  const Utf8Step step = utf8_step(s, pos);
  if (step.kind != Utf8Step::kValid || step.len == 1) {
    return {step.kind == Utf8Step::kValid ? static_cast<uint8_t>(s[pos]) : 0xFFFDu, std::max<size_t>(step.len, 1)};
  }
  const auto b0 = static_cast<uint8_t>(s[pos]);
  uint32_t cp = b0 & (0x7F >> step.len);
  for (size_t k = 1; k < step.len; ++k) cp = cp << 6 | (static_cast<uint8_t>(s[pos + k]) & 0x3F);
  return {cp, step.len};
}

std::string float_repr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, end);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";  // Python prints 1.0, not 1
  return s;
}

void json_string(std::string& out, std::string_view s) {
  out += '"';
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (static_cast<uint8_t>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<uint8_t>(c));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

void json_value(std::string& out, const Value& v, int indent, bool sort_keys, int depth) {
  const auto newline = [&](int d) {
    out += '\n';
    out.append(static_cast<size_t>(indent * d), ' ');
  };
  switch (v.type()) {
    case Value::Type::kUndefined:
    case Value::Type::kNone: out += "null"; return;
    case Value::Type::kBool: out += v.as_int() ? "true" : "false"; return;
    case Value::Type::kInt: out += std::to_string(v.as_int()); return;
    case Value::Type::kFloat: {
      const double f = v.as_float();
      out += std::isnan(f) ? "NaN" : std::isinf(f) ? (f > 0 ? "Infinity" : "-Infinity") : float_repr(f);
      return;
    }
    case Value::Type::kString: json_string(out, v.str()); return;
    case Value::Type::kList: {
      if (v.items().empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < v.items().size(); ++i) {
        if (i > 0) out += indent >= 0 ? "," : ", ";
        if (indent >= 0) newline(depth + 1);
        json_value(out, v.items()[i], indent, sort_keys, depth + 1);
      }
      if (indent >= 0) newline(depth);
      out += ']';
      return;
    }
    case Value::Type::kDict: {
      if (v.entries().empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& e : v.entries()) entries.push_back(&e);
      if (sort_keys) std::stable_sort(entries.begin(), entries.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i > 0) out += indent >= 0 ? "," : ", ";
        if (indent >= 0) newline(depth + 1);
        json_string(out, entries[i]->first);
        out += ": ";
        json_value(out, entries[i]->second, indent, sort_keys, depth + 1);
      }
      if (indent >= 0) newline(depth);
      out += '}';
      return;
    }
  }
}

}  // namespace

Value Value::none() {
  Value v;
  v.type_ = Type::kNone;
  return v;
}

Value Value::list(List items) {
  Value v;
  v.type_ = Type::kList;
  v.list_ = std::make_shared<List>(std::move(items));
  return v;
}

Value Value::dict(Dict items) {
  Value v;
  v.type_ = Type::kDict;
  v.dict_ = std::make_shared<Dict>(std::move(items));
  return v;
}

Value Value::name_space(Dict items) {
  Value v = dict(std::move(items));
  v.namespace_ = true;
  return v;
}

const Value* Value::find(std::string_view key) const {
  if (type_ != Type::kDict) return nullptr;
  for (const auto& [k, v] : *dict_) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Value::set(const std::string& key, Value v) {
  for (auto& [k, old] : *dict_) {
    if (k == key) {
      old = std::move(v);
      return;
    }
  }
  dict_->emplace_back(key, std::move(v));
}

bool Value::truthy() const {
  switch (type_) {
    case Type::kUndefined:
    case Type::kNone: return false;
    case Type::kBool:
    case Type::kInt: return int_ != 0;
    case Type::kFloat: return float_ != 0;
    case Type::kString: return !str_.empty();
    case Type::kList: return !list_->empty();
    case Type::kDict: return !dict_->empty();
  }
  return false;
}

std::string Value::to_string() const {
  switch (type_) {
    case Type::kUndefined: return "";
    case Type::kString: return str_;
    default: return repr();
  }
}

std::string Value::repr() const {
  switch (type_) {
    case Type::kUndefined: return "";
    case Type::kNone: return "None";
    case Type::kBool: return int_ ? "True" : "False";
    case Type::kInt: return std::to_string(int_);
    case Type::kFloat: return float_repr(float_);
    case Type::kString: {
      // Python quotes with ' unless the text has ' and no ".
      const char q = str_.find('\'') != std::string::npos && str_.find('"') == std::string::npos ? '"' : '\'';
      std::string out(1, q);
      for (char c : str_) {
        if (c == q || c == '\\') out += '\\';
        if (c == '\n') {
          out += "\\n";
        } else if (c == '\t') {
          out += "\\t";
        } else if (c == '\r') {
          out += "\\r";
        } else {
          out += c;
        }
      }
      return out + q;
    }
    case Type::kList: {
      std::string out = "[";
      for (size_t i = 0; i < list_->size(); ++i) out += (i ? ", " : "") + (*list_)[i].repr();
      return out + "]";
    }
    case Type::kDict: {
      std::string out = namespace_ ? "<Namespace {" : "{";
      for (size_t i = 0; i < dict_->size(); ++i) {
        out += (i ? ", " : "") + Value((*dict_)[i].first).repr() + ": " + (*dict_)[i].second.repr();
      }
      return out + (namespace_ ? "}>" : "}");
    }
  }
  return "";
}

Value::List Value::iterate() const {
  switch (type_) {
    case Type::kUndefined: return {};  // Jinja iterates an undefined value as empty
    case Type::kList: return *list_;
    case Type::kDict: {
      List keys;
      for (const auto& e : *dict_) keys.emplace_back(e.first);
      return keys;
    }
    case Type::kString: {
      List chars;
      for (std::string& c : code_points(str_)) chars.emplace_back(std::move(c));
      return chars;
    }
    default: throw RenderError("'" + type_name() + "' object is not iterable");
  }
}

std::string Value::type_name() const {
  switch (type_) {
    case Type::kUndefined: return "Undefined";
    case Type::kNone: return "NoneType";
    case Type::kBool: return "bool";
    case Type::kInt: return "int";
    case Type::kFloat: return "float";
    case Type::kString: return "str";
    case Type::kList: return "list";
    case Type::kDict: return namespace_ ? "Namespace" : "dict";
  }
  return "?";
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.type() == Value::Type::kFloat || b.type() == Value::Type::kFloat) return a.as_float() == b.as_float();
    return a.as_int() == b.as_int();
  }
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case Value::Type::kUndefined:
    case Value::Type::kNone: return true;
    case Value::Type::kString: return a.str() == b.str();
    case Value::Type::kList:
      return std::equal(a.items().begin(), a.items().end(), b.items().begin(), b.items().end(), equals);
    case Value::Type::kDict: {
      if (a.entries().size() != b.entries().size()) return false;
      for (const auto& [k, v] : a.entries()) {
        const Value* w = b.find(k);
        if (w == nullptr || !equals(v, *w)) return false;
      }
      return true;
    }
    default: return false;
  }
}

bool less(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.as_float() < b.as_float();
  if (a.is_string() && b.is_string()) return a.str() < b.str();  // UTF-8 byte order = code point order
  throw RenderError("'<' not supported between instances of '" + a.type_name() + "' and '" + b.type_name() + "'");
}

bool contains(const Value& seq, const Value& x) {
  if (seq.is_string()) {
    if (!x.is_string()) throw RenderError("'in <string>' requires a string as left operand, not " + x.type_name());
    return seq.str().find(x.str()) != std::string::npos;
  }
  if (seq.is_dict()) return x.is_string() && seq.find(x.str()) != nullptr;
  if (seq.is_list()) {
    for (const Value& v : seq.items()) {
      if (equals(v, x)) return true;
    }
    return false;
  }
  if (seq.is_undefined()) return false;
  throw RenderError("argument of type '" + seq.type_name() + "' is not iterable");
}

bool is_python_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

namespace {

template <typename IsStripped>
std::string strip_if(std::string_view s, bool left, bool right, IsStripped stripped) {
  size_t begin = 0;
  if (left) {
    while (begin < s.size()) {
      const auto [cp, len] = code_point_at(s, begin);
      if (!stripped(s.substr(begin, len), cp)) break;
      begin += len;
    }
  }
  size_t end = begin;  // one past the last character kept
  if (!right) end = s.size();
  for (size_t pos = begin; right && pos < s.size();) {
    const auto [cp, len] = code_point_at(s, pos);
    const bool strip = stripped(s.substr(pos, len), cp);
    pos += len;
    if (!strip) end = pos;
  }
  return std::string(s.substr(begin, end - begin));
}

}  // namespace

std::string py_strip(std::string_view s, bool left, bool right) {
  return strip_if(s, left, right, [](std::string_view, uint32_t cp) { return is_python_space(cp); });
}

std::string py_strip_chars(std::string_view s, std::string_view chars, bool left, bool right) {
  const std::vector<std::string> set = code_points(chars);
  return strip_if(s, left, right, [&](std::string_view c, uint32_t) {
    return std::find(set.begin(), set.end(), c) != set.end();
  });
}

std::vector<std::string> py_split(std::string_view s) {
  std::vector<std::string> parts;
  std::string part;
  for (size_t pos = 0; pos < s.size();) {
    const auto [cp, len] = code_point_at(s, pos);
    if (is_python_space(cp)) {
      if (!part.empty()) parts.push_back(std::move(part));
      part.clear();
    } else {
      part.append(s.substr(pos, len));
    }
    pos += len;
  }
  if (!part.empty()) parts.push_back(std::move(part));
  return parts;
}

std::vector<std::string> py_split(std::string_view s, std::string_view sep, int64_t max_split) {
  if (sep.empty()) throw RenderError("empty separator");
  std::vector<std::string> parts;
  size_t pos = 0;
  for (size_t at; (max_split < 0 || static_cast<int64_t>(parts.size()) < max_split) &&
                  (at = s.find(sep, pos)) != std::string_view::npos;
       pos = at + sep.size()) {
    parts.emplace_back(s.substr(pos, at - pos));
  }
  parts.emplace_back(s.substr(pos));
  return parts;
}

std::string py_upper(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  }
  return out;
}

std::string py_lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

std::string py_title(std::string_view s) {
  std::string out(s);
  bool word = false;
  for (char& c : out) {
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    if (alpha) c = word ? py_lower(std::string(1, c))[0] : py_upper(std::string(1, c))[0];
    word = alpha;
  }
  return out;
}

std::string py_capitalize(std::string_view s) {
  std::string out = py_lower(s);
  if (!out.empty()) out[0] = py_upper(out.substr(0, 1))[0];
  return out;
}

std::vector<std::string> code_points(std::string_view s) {
  std::vector<std::string> out;
  for (size_t pos = 0; pos < s.size();) {
    const size_t len = code_point_at(s, pos).second;
    out.emplace_back(s.substr(pos, len));
    pos += len;
  }
  return out;
}

std::string to_json(const Value& v, int indent, bool sort_keys) {
  std::string out;
  json_value(out, v, indent, sort_keys, 0);
  return out;
}

}  // namespace baton::jinja
