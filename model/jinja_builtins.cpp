#include "model/jinja_builtins.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <ctime>

#include "model/jinja_parser.h"

namespace baton::jinja {
namespace {

using List = Value::List;
using Dict = Value::Dict;

[[noreturn]] void error(std::string message) { throw RenderError(std::move(message)); }

std::string require_string(const Value& v, const char* what) {
  if (!v.is_string()) error(std::string(what) + " must be a string, not " + v.type_name());
  return v.str();
}

// The value at dotted `path` in `v` ("a.b" reads v.a.b), undefined where a step is missing.
Value attribute_of(const Value& v, const std::string& path) {
  Value cur = v;
  size_t pos = 0;
  while (pos <= path.size()) {
    const size_t dot = std::min(path.find('.', pos), path.size());
    const Value* next = cur.find(path.substr(pos, dot - pos));
    cur = next != nullptr ? *next : Value();
    pos = dot + 1;
  }
  return cur;
}

}  // namespace

Value builtin_function(const std::string& f, const CallArgs& arg) {
  const std::vector<Value>& args = arg.positional;
  if (f == "raise_exception") {
    RenderError raised(arg(0, "message").to_string());
    raised.raised = true;
    throw raised;
  }
  if (f == "namespace" || f == "dict") {
    Dict entries;
    if (!args.empty() && args[0].is_dict()) entries = args[0].entries();
    entries.insert(entries.end(), arg.keyword.begin(), arg.keyword.end());
    return f == "namespace" ? Value::name_space(std::move(entries)) : Value::dict(std::move(entries));
  }
  if (f == "range") {
    for (const Value& a : args) {
      if (a.type() != Value::Type::kInt) error("range() takes integers");
    }
    if (args.empty() || args.size() > 3) error("range() takes 1 to 3 arguments");
    const int64_t start = args.size() > 1 ? args[0].as_int() : 0;
    const int64_t stop = args.size() > 1 ? args[1].as_int() : args[0].as_int();
    const int64_t step = args.size() > 2 ? args[2].as_int() : 1;
    if (step == 0) error("range() step must not be zero");
    List out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.emplace_back(i);
    return Value::list(std::move(out));
  }
  // strftime_now(format): the local time now, as transformers' datetime.now().strftime().
  const std::string format = require_string(arg(0, "format"), "strftime_now's format");
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buf[256];
  const size_t n = std::strftime(buf, sizeof buf, format.c_str(), &local);
  return Value(std::string(buf, n));
}

Value builtin_method(const Value& obj, const std::string& name, const CallArgs& arg) {
  if (obj.is_string()) {
    const std::string& s = obj.str();
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      const Value chars = arg(0, "chars");
      const bool left = name != "rstrip", right = name != "lstrip";
      return Value(chars.is_undefined() || chars.is_none() ? py_strip(s, left, right)
                                                           : py_strip_chars(s, require_string(chars, "chars"), left, right));
    }
    if (name == "upper") return Value(py_upper(s));
    if (name == "lower") return Value(py_lower(s));
    if (name == "title") return Value(py_title(s));
    if (name == "capitalize") return Value(py_capitalize(s));
    if (name == "startswith" || name == "endswith") {
      const Value affix = arg(0, "prefix");
      List options = affix.is_list() ? affix.items() : List{affix};
      for (const Value& o : options) {
        const std::string a = require_string(o, name.c_str());
        if (name == "startswith" ? s.starts_with(a) : s.ends_with(a)) return Value(true);
      }
      return Value(false);
    }
    if (name == "split") {
      const Value sep = arg(0, "sep"), max = arg(1, "maxsplit");
      const int64_t max_split = max.is_undefined() ? -1 : max.as_int();
      List out;
      if (sep.is_undefined() || sep.is_none()) {
        if (max_split >= 0) error("split(None, maxsplit) is not supported");
        for (std::string& p : py_split(s)) out.emplace_back(std::move(p));
      } else {
        for (std::string& p : py_split(s, require_string(sep, "sep"), max_split)) out.emplace_back(std::move(p));
      }
      return Value::list(std::move(out));
    }
    if (name == "replace") {
      const std::string from = require_string(arg(0, "old"), "old"), to = require_string(arg(1, "new"), "new");
      const Value count = arg(2, "count");
      if (from.empty()) error("replace() of an empty string is not supported");
      std::string out;
      size_t pos = 0;
      int64_t left = count.is_undefined() ? -1 : count.as_int();
      for (size_t at; left != 0 && (at = s.find(from, pos)) != std::string::npos; pos = at + from.size(), --left) {
        out += s.substr(pos, at - pos) + to;
      }
      return Value(out + s.substr(pos));
    }
    if (name == "join") {
      std::string out;
      const List items = arg(0, "iterable").iterate();
      for (size_t i = 0; i < items.size(); ++i) out += (i ? s : "") + require_string(items[i], "join's items");
      return Value(std::move(out));
    }
    if (name == "count") {
      const std::string sub = require_string(arg(0, "sub"), "sub");
      if (sub.empty()) return Value(static_cast<int64_t>(code_points(s).size() + 1));
      int64_t n = 0;
      for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
      return Value(n);
    }
  }
  if (obj.is_dict()) {
    if (name == "items" || name == "keys" || name == "values") {
      List out;
      for (const auto& [k, v] : obj.entries()) {
        out.push_back(name == "items" ? Value::list({Value(k), v}) : name == "keys" ? Value(k) : v);
      }
      return Value::list(std::move(out));
    }
    if (name == "get") {
      const Value key = arg(0, "key");
      const Value* v = key.is_string() ? obj.find(key.str()) : nullptr;
      if (v != nullptr) return *v;
      return arg.positional.size() > 1 ? arg.positional[1] : Value::none();
    }
  }
  if (obj.is_undefined()) error("a method '" + name + "' called on an undefined value");
  error("'" + obj.type_name() + "' object has no method '" + name + "'");
}

Value builtin_filter(const std::string& f, const Value& v, const CallArgs& arg) {
  const std::vector<Value>& args = arg.positional;
  if (f == "trim") {
    const Value chars = arg(0, "chars");
    return Value(chars.is_undefined() || chars.is_none() ? py_strip(v.to_string(), true, true)
                                                         : py_strip_chars(v.to_string(), require_string(chars, "chars"), true, true));
  }
  if (f == "length" || f == "count") {
    if (v.is_string()) return Value(static_cast<int64_t>(code_points(v.str()).size()));
    if (v.is_list()) return Value(static_cast<int64_t>(v.items().size()));
    if (v.is_dict()) return Value(static_cast<int64_t>(v.entries().size()));
    if (v.is_undefined()) return Value(0);
    error("object of type '" + v.type_name() + "' has no length");
  }
  if (f == "upper") return Value(py_upper(v.to_string()));
  if (f == "lower") return Value(py_lower(v.to_string()));
  if (f == "title") return Value(py_title(v.to_string()));
  if (f == "capitalize") return Value(py_capitalize(v.to_string()));
  if (f == "string") return Value(v.to_string());
  if (f == "safe") return v;
  if (f == "tojson") {
    const Value ascii = arg(0, "ensure_ascii"), indent = arg(1, "indent"), separators = arg(2, "separators");
    if (ascii.truthy() || !(separators.is_undefined() || separators.is_none())) {
      error("tojson supports indent and sort_keys only");
    }
    return Value(to_json(v, indent.is_undefined() || indent.is_none() ? -1 : static_cast<int>(indent.as_int()),
                         arg(3, "sort_keys").truthy()));
  }
  if (f == "int" || f == "float") {
    const Value dflt = arg(0, "default");
    double x = 0;
    bool ok = true;
    if (v.is_number()) {
      x = v.as_float();
    } else if (v.is_string()) {
      try {
        size_t used = 0;
        x = std::stod(v.str(), &used);
        ok = used == v.str().size();
      } catch (const std::exception&) {
        ok = false;
      }
    } else {
      ok = false;
    }
    if (f == "int") {
      if (!ok) return dflt.is_undefined() ? Value(0) : dflt;
      return v.type() == Value::Type::kInt ? v : Value(static_cast<int64_t>(x));
    }
    if (!ok) return dflt.is_undefined() ? Value(0.0) : dflt;
    return Value(x);
  }
  if (f == "first" || f == "last") {
    const List items = v.iterate();
    if (items.empty()) return Value();
    return f == "first" ? items.front() : items.back();
  }
  if (f == "join") {
    const std::string sep = arg(0, "d").is_undefined() ? "" : arg(0, "d").to_string();
    const Value attr = arg(1, "attribute");
    std::string out;
    const List items = v.iterate();
    for (size_t i = 0; i < items.size(); ++i) {
      out += (i ? sep : "") + (attr.is_undefined() ? items[i] : attribute_of(items[i], attr.to_string())).to_string();
    }
    return Value(std::move(out));
  }
  if (f == "default" || f == "d") {
    const Value dflt = arg(0, "default_value");
    if (v.is_undefined() || (arg(1, "boolean").truthy() && !v.truthy())) return dflt.is_undefined() ? Value("") : dflt;
    return v;
  }
  if (f == "replace") {
    CallArgs replace{{arg(0, "old"), arg(1, "new"), arg(2, "count")}, {}};
    return builtin_method(Value(v.to_string()), "replace", replace);
  }
  if (f == "list") return Value::list(v.iterate());
  if (f == "reverse") {
    if (v.is_string()) {
      std::vector<std::string> chars = code_points(v.str());
      std::string out;
      for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += *it;
      return Value(std::move(out));
    }
    List items = v.iterate();
    std::reverse(items.begin(), items.end());
    return Value::list(std::move(items));
  }
  if (f == "abs") {
    if (!v.is_number()) error("bad operand type for abs(): '" + v.type_name() + "'");
    return v.type() == Value::Type::kFloat ? Value(std::fabs(v.as_float())) : Value(static_cast<int64_t>(std::llabs(v.as_int())));
  }
  if (f == "items") {
    if (v.is_undefined()) return Value::list();
    if (!v.is_dict()) error("the items filter takes a mapping, not " + v.type_name());
    List out;
    for (const auto& [k, x] : v.entries()) out.push_back(Value::list({Value(k), x}));
    return Value::list(std::move(out));
  }
  if (f == "select" || f == "reject") {
    const Value test_name = arg(0, "test");
    List out;
    for (const Value& item : v.iterate()) {
      bool r = item.truthy();
      if (!test_name.is_undefined()) {
        const std::string t = require_string(test_name, "select's test");
        if (!is_known_test(t)) error("the test '" + t + "' is not one baton implements");
        r = builtin_test(t, item, std::vector<Value>(args.begin() + std::min<size_t>(1, args.size()), args.end()));
      }
      if (r == (f == "select")) out.push_back(item);
    }
    return Value::list(std::move(out));
  }
  if (f == "selectattr" || f == "rejectattr") {
    const std::string attr = require_string(arg(0, "attribute"), "selectattr's attribute");
    const Value test_name = args.size() > 1 ? args[1] : Value();
    List out;
    for (const Value& item : v.iterate()) {
      const Value a = attribute_of(item, attr);
      bool r = a.truthy();
      if (!test_name.is_undefined()) {
        const std::string t = require_string(test_name, "selectattr's test");
        if (!is_known_test(t)) error("the test '" + t + "' is not one baton implements");
        r = builtin_test(t, a, std::vector<Value>(args.begin() + 2, args.end()));
      }
      if (r == (f == "selectattr")) out.push_back(item);
    }
    return Value::list(std::move(out));
  }
  // map(attribute=...) or map('filter'): only attribute lookups and the string filters.
  const Value attr = arg.named("attribute");
  List out;
  for (const Value& item : v.iterate()) {
    if (!attr.is_undefined()) {
      out.push_back(attribute_of(item, attr.to_string()));
    } else {
      const std::string name = require_string(arg(0, "filter"), "map's filter");
      if (name == "trim") out.emplace_back(py_strip(item.to_string(), true, true));
      else if (name == "lower") out.emplace_back(py_lower(item.to_string()));
      else if (name == "upper") out.emplace_back(py_upper(item.to_string()));
      else if (name == "string") out.emplace_back(item.to_string());
      else error("map('" + name + "') is not supported");
    }
  }
  return Value::list(std::move(out));
}

bool builtin_test(const std::string& name, const Value& v, const std::vector<Value>& args) {
  const auto need = [&](size_t n) {
    if (args.size() < n) error("the test '" + name + "' needs an argument");
  };
  using T = Value::Type;
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "string") return v.is_string();
  if (name == "number") return v.is_number();
  if (name == "integer") return v.type() == T::kInt;
  if (name == "float") return v.type() == T::kFloat;
  if (name == "boolean") return v.type() == T::kBool;
  if (name == "true") return v.type() == T::kBool && v.as_int() != 0;
  if (name == "false") return v.type() == T::kBool && v.as_int() == 0;
  if (name == "mapping") return v.is_dict();
  if (name == "iterable") return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined();
  if (name == "sequence") return v.is_list() || v.is_dict() || v.is_string();
  if (name == "even" || name == "odd" || name == "divisibleby") {
    if (v.type() != T::kInt && v.type() != T::kBool) error("the test '" + name + "' takes an integer");
    const int64_t d = name == "divisibleby" ? (need(1), args[0].as_int()) : 2;
    if (d == 0) error("divisibleby(0)");
    const bool divisible = v.as_int() % d == 0;
    return name == "odd" ? !divisible : divisible;
  }
  need(1);
  if (name == "equalto" || name == "eq" || name == "==") return equals(v, args[0]);
  if (name == "ne" || name == "!=") return !equals(v, args[0]);
  return contains(args[0], v);  // "in"
}

}  // namespace baton::jinja
