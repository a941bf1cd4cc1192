#include "model/jinja.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <ctime>
#include <unordered_map>

#include "model/jinja_parser.h"

namespace baton::jinja {
namespace {

using List = Value::List;
using Dict = Value::Dict;

[[noreturn]] void error(std::string message) { throw RenderError(std::move(message)); }

std::string describe(const Expr& e) {
  return e.kind == Expr::Kind::kName ? "'" + e.name + "'" : e.kind == Expr::Kind::kAttr ? "'" + e.name + "'" : "a value";
}

// Python's index normalisation for a sequence of `n`: negative counts from the end.
bool normalise_index(int64_t& i, size_t n) {
  if (i < 0) i += static_cast<int64_t>(n);
  return i >= 0 && i < static_cast<int64_t>(n);
}

// The indices Python's seq[start:stop:step] selects from a sequence of `n`.
std::vector<size_t> slice_indices(const Value& start, const Value& stop, const Value& step, size_t n) {
  const auto as_opt = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_undefined() || v.is_none()) return std::nullopt;
    if (v.type() != Value::Type::kInt && v.type() != Value::Type::kBool) error(std::string("slice ") + what + " must be an integer");
    return v.as_int();
  };
  const int64_t len = static_cast<int64_t>(n);
  const int64_t st = as_opt(step, "step").value_or(1);
  if (st == 0) error("slice step cannot be zero");
  const auto clamp = [&](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t x = *v < 0 ? *v + len : *v;
    if (st > 0) return std::clamp<int64_t>(x, 0, len);
    return std::clamp<int64_t>(x, -1, len - 1);
  };
  const int64_t a = clamp(as_opt(start, "start"), st > 0 ? 0 : len - 1);
  const int64_t b = clamp(as_opt(stop, "stop"), st > 0 ? len : -1);
  std::vector<size_t> out;
  for (int64_t i = a; st > 0 ? i < b : i > b; i += st) out.push_back(static_cast<size_t>(i));
  return out;
}

// A call's or a filter's arguments, evaluated: positional ones, then keyword ones.
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;

  // The keyword argument `name`, or undefined.
  Value named(std::string_view name) const {
    for (const auto& [k, v] : keyword) {
      if (k == name) return v;
    }
    return Value();
  }
  // Parameter `i` of the callee, called `name`: given by position or by keyword, else undefined.
  Value operator()(size_t i, std::string_view name) const {
    return i < positional.size() ? positional[i] : named(name);
  }
};

std::string require_string(const Value& v, const char* what) {
  if (!v.is_string()) error(std::string(what) + " must be a string, not " + v.type_name());
  return v.str();
}

enum class Flow { kNormal, kBreak, kContinue };

class Renderer {
 public:
  explicit Renderer(const Value& globals) {
    frames_.emplace_back();
    if (globals.is_dict()) {
      for (const auto& [k, v] : globals.entries()) frames_.back()[k] = v;
    }
  }

  std::string out;

  Flow exec(const Body& body) {
    for (const NodePtr& node : body) {
      const Flow f = exec(*node);
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

 private:
  Flow exec(const Node& n) {
    line_ = n.line;
    switch (n.kind) {
      case Node::Kind::kText: out += n.text; return Flow::kNormal;
      case Node::Kind::kOutput: out += eval(*n.expr).to_string(); return Flow::kNormal;
      case Node::Kind::kIf:
        for (const auto& [cond, body] : n.branches) {
          if (!cond || eval(*cond).truthy()) return exec(body);
        }
        return Flow::kNormal;
      case Node::Kind::kFor: return exec_for(n);
      case Node::Kind::kSet: {
        Value v = eval(*n.expr);
        if (!n.attr.empty()) {
          Value target = lookup(n.targets[0]);
          if (!target.is_namespace()) error("can only assign attributes of a namespace(), not of '" + n.targets[0] + "'");
          target.set(n.attr, std::move(v));
        } else {
          assign(n.targets, std::move(v));
        }
        return Flow::kNormal;
      }
      case Node::Kind::kBreak: return Flow::kBreak;
      case Node::Kind::kContinue: return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  void assign(const std::vector<std::string>& targets, Value v) {
    if (targets.size() == 1) {
      frames_.back()[targets[0]] = std::move(v);
      return;
    }
    const List items = v.iterate();
    if (items.size() != targets.size()) {
      error("cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(targets.size()) + " names");
    }
    for (size_t i = 0; i < targets.size(); ++i) frames_.back()[targets[i]] = items[i];
  }

  Flow exec_for(const Node& n) {
    List items = eval(*n.expr).iterate();
    if (n.filter) {
      List kept;
      for (Value& item : items) {
        frames_.emplace_back();
        assign(n.targets, item);
        const bool keep = eval(*n.filter).truthy();
        frames_.pop_back();
        if (keep) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      exec(n.else_body);
      return Flow::kNormal;
    }
    const auto length = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < length; ++i) {
      frames_.emplace_back();  // each pass starts from the outer scope, as Jinja's loop frames do
      assign(n.targets, items[static_cast<size_t>(i)]);
      frames_.back()["loop"] = Value::dict({
          {"index", Value(i + 1)},
          {"index0", Value(i)},
          {"revindex", Value(length - i)},
          {"revindex0", Value(length - i - 1)},
          {"first", Value(i == 0)},
          {"last", Value(i == length - 1)},
          {"length", Value(length)},
          {"previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : Value()},
          {"nextitem", i + 1 < length ? items[static_cast<size_t>(i + 1)] : Value()},
          {"depth", Value(1)},
          {"depth0", Value(0)},
      });
      const Flow f = exec(n.body);
      frames_.pop_back();
      if (f == Flow::kBreak) break;
    }
    return Flow::kNormal;
  }

  Value lookup(const std::string& name) const {
    for (auto it = frames_.rbegin(); it != frames_.rend(); ++it) {
      if (auto found = it->find(name); found != it->end()) return found->second;
    }
    return Value();
  }

  Value eval(const Expr& e) {
    switch (e.kind) {
      case Expr::Kind::kLiteral: return e.value;
      case Expr::Kind::kName: return lookup(e.name);
      case Expr::Kind::kList: {
        List items;
        for (const ExprPtr& a : e.args) items.push_back(eval(*a));
        return Value::list(std::move(items));
      }
      case Expr::Kind::kDict: {
        Dict entries;
        for (const auto& [k, v] : e.kwargs) entries.emplace_back(k, eval(*v));
        return Value::dict(std::move(entries));
      }
      case Expr::Kind::kAttr: {
        const Value obj = eval(*e.args[0]);
        if (obj.is_undefined()) error(describe(*e.args[0]) + " is undefined (reading its '" + e.name + "')");
        const Value* v = obj.find(e.name);
        return v != nullptr ? *v : Value();
      }
      case Expr::Kind::kItem: return item(eval(*e.args[0]), eval(*e.args[1]), *e.args[0]);
      case Expr::Kind::kSlice: {
        const Value obj = eval(*e.args[0]);
        const auto part = [&](size_t k) { return e.args[k] ? eval(*e.args[k]) : Value(); };
        const Value a = part(1), b = part(2), c = part(3);
        if (obj.is_list()) {
          List out;
          for (size_t i : slice_indices(a, b, c, obj.items().size())) out.push_back(obj.items()[i]);
          return Value::list(std::move(out));
        }
        if (obj.is_string()) {
          const std::vector<std::string> chars = code_points(obj.str());
          std::string out;
          for (size_t i : slice_indices(a, b, c, chars.size())) out += chars[i];
          return Value(std::move(out));
        }
        error("cannot slice " + describe(*e.args[0]) + " (" + obj.type_name() + ")");
      }
      case Expr::Kind::kCall: return call(e);
      case Expr::Kind::kFilter: return filter(e);
      case Expr::Kind::kTest: {
        const Expr& subject = *e.args[0];
        if ((e.name == "defined" || e.name == "undefined") && subject.kind == Expr::Kind::kName &&
            is_known_function(subject.name) && lookup(subject.name).is_undefined()) {
          // The global functions are defined names (`strftime_now is defined` guards a date).
          return Value((e.name == "defined") != e.negate);
        }
        const bool r = test(e.name, eval(subject), e, 1);
        return Value(e.negate ? !r : r);
      }
      case Expr::Kind::kUnary: {
        const Value v = eval(*e.args[0]);
        if (e.name == "not") return Value(!v.truthy());
        if (!v.is_number()) error("bad operand type for unary " + e.name + ": '" + v.type_name() + "'");
        if (e.name == "+") return v.type() == Value::Type::kFloat ? v : Value(v.as_int());
        return v.type() == Value::Type::kFloat ? Value(-v.as_float()) : Value(-v.as_int());
      }
      case Expr::Kind::kBinary: return binary(e);
      case Expr::Kind::kCompare: {
        Value left = eval(*e.args[0]);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.args[i + 1]);
          if (!compare(e.ops[i], left, right)) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case Expr::Kind::kCond:
        if (eval(*e.args[1]).truthy()) return eval(*e.args[0]);
        return e.args[2] ? eval(*e.args[2]) : Value();
    }
    return Value();
  }

  Value item(const Value& obj, const Value& key, const Expr& what) {
    if (obj.is_undefined()) error(describe(what) + " is undefined (reading its item " + key.repr() + ")");
    if (obj.is_dict()) {
      if (!key.is_string()) return Value();
      const Value* v = obj.find(key.str());
      return v != nullptr ? *v : Value();
    }
    if (obj.is_list() || obj.is_string()) {
      if (key.type() != Value::Type::kInt && key.type() != Value::Type::kBool) return Value();
      int64_t i = key.as_int();
      if (obj.is_list()) return normalise_index(i, obj.items().size()) ? obj.items()[static_cast<size_t>(i)] : Value();
      const std::vector<std::string> chars = code_points(obj.str());
      return normalise_index(i, chars.size()) ? Value(chars[static_cast<size_t>(i)]) : Value();
    }
    return Value();
  }

  static bool compare(const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return equals(a, b);
    if (op == "!=") return !equals(a, b);
    if (op == "<") return less(a, b);
    if (op == ">") return less(b, a);
    if (op == "<=") return !less(b, a);
    if (op == ">=") return !less(a, b);
    const bool in = contains(b, a);
    return op == "in" ? in : !in;
  }

  static bool contains(const Value& seq, const Value& x) {
    if (seq.is_string()) {
      if (!x.is_string()) error("'in <string>' requires a string as left operand, not " + x.type_name());
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
    error("argument of type '" + seq.type_name() + "' is not iterable");
  }

  Value binary(const Expr& e) {
    if (e.name == "and") {
      Value a = eval(*e.args[0]);
      return a.truthy() ? eval(*e.args[1]) : a;
    }
    if (e.name == "or") {
      Value a = eval(*e.args[0]);
      return a.truthy() ? a : eval(*e.args[1]);
    }
    const Value a = eval(*e.args[0]);
    const Value b = eval(*e.args[1]);
    if (e.name == "~") return Value(a.to_string() + b.to_string());
    if (a.is_undefined() || b.is_undefined()) {
      error(describe(*e.args[a.is_undefined() ? 0 : 1]) + " is undefined (an operand of '" + e.name + "')");
    }
    if (e.name == "+") {
      if (a.is_string() && b.is_string()) return Value(a.str() + b.str());
      if (a.is_list() && b.is_list()) {
        List items = a.items();
        items.insert(items.end(), b.items().begin(), b.items().end());
        return Value::list(std::move(items));
      }
    }
    if (e.name == "*" && (a.is_string() || b.is_string()) && (a.type() == Value::Type::kInt || b.type() == Value::Type::kInt)) {
      const std::string& s = a.is_string() ? a.str() : b.str();
      std::string out;
      for (int64_t k = 0; k < (a.is_string() ? b : a).as_int(); ++k) out += s;
      return Value(std::move(out));
    }
    if (!a.is_number() || !b.is_number()) {
      error("unsupported operand types for " + e.name + ": '" + a.type_name() + "' and '" + b.type_name() + "'");
    }
    const bool ints = a.type() != Value::Type::kFloat && b.type() != Value::Type::kFloat;
    const int64_t x = a.as_int(), y = b.as_int();
    const double fx = a.as_float(), fy = b.as_float();
    if (e.name == "+") return ints ? Value(x + y) : Value(fx + fy);
    if (e.name == "-") return ints ? Value(x - y) : Value(fx - fy);
    if (e.name == "*") return ints ? Value(x * y) : Value(fx * fy);
    if (e.name == "**") return ints && y >= 0 ? Value(static_cast<int64_t>(std::pow(fx, fy))) : Value(std::pow(fx, fy));
    if (fy == 0) error("division by zero");
    if (e.name == "/") return Value(fx / fy);
    if (e.name == "//") {
      if (ints) return Value(x / y - ((x % y != 0) && ((x < 0) != (y < 0)) ? 1 : 0));
      return Value(std::floor(fx / fy));
    }
    if (ints) {  // Python's %: the sign of the divisor
      const int64_t r = x % y;
      return Value(r != 0 && ((r < 0) != (y < 0)) ? r + y : r);
    }
    const double r = std::fmod(fx, fy);
    return Value(r != 0 && ((r < 0) != (fy < 0)) ? r + fy : r);
  }

  // The arguments of a call, filter or test node: args[from..] and its keyword arguments.
  CallArgs call_args(const Expr& e, size_t from) {
    CallArgs a;
    for (size_t i = from; i < e.args.size(); ++i) a.positional.push_back(eval(*e.args[i]));
    for (const auto& [k, v] : e.kwargs) a.keyword.emplace_back(k, eval(*v));
    return a;
  }

  Value call(const Expr& e) {
    const Expr& callee = *e.args[0];
    const CallArgs arg = call_args(e, 1);
    const std::vector<Value>& args = arg.positional;
    if (callee.kind == Expr::Kind::kName) {
      const std::string& f = callee.name;
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
    return method(eval(*callee.args[0]), callee.name, arg);
  }

  Value method(const Value& obj, const std::string& name, const CallArgs& arg) {
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

  static Value attribute_of(const Value& v, const std::string& path) {
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

  Value filter(const Expr& e) {
    const Value v = eval(*e.args[0]);
    const CallArgs arg = call_args(e, 1);
    const std::vector<Value>& args = arg.positional;
    const std::string& f = e.name;
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
      return method(Value(v.to_string()), "replace", replace);
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
          r = test_values(t, item, std::vector<Value>(args.begin() + std::min<size_t>(1, args.size()), args.end()));
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
          r = test_values(t, a, std::vector<Value>(args.begin() + 2, args.end()));
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

  bool test(const std::string& name, const Value& v, const Expr& e, size_t first_arg) {
    return test_values(name, v, call_args(e, first_arg).positional);
  }

  static bool test_values(const std::string& name, const Value& v, const std::vector<Value>& args) {
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

  std::vector<std::unordered_map<std::string, Value>> frames_;
  int line_ = 0;

 public:
  int line() const { return line_; }
};

}  // namespace

Result<Template> Template::parse(std::string_view source) {
  BATON_ASSIGN_OR_RETURN(Body body, parse_template(source));
  Template t;
  t.body_ = std::make_shared<const Body>(std::move(body));
  return t;
}

Result<std::string> Template::render(const Value& globals) const {
  Renderer r(globals);
  try {
    r.exec(*body_);
  } catch (const RenderError& e) {
    if (e.raised) return failed_precondition(e.what());
    return invalid_argument("line " + std::to_string(r.line()) + ": " + e.what());
  }
  return std::move(r.out);
}

}  // namespace baton::jinja
