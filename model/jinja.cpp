#include "model/jinja.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <unordered_map>

#include "model/jinja_builtins.h"
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
      case Expr::Kind::kFilter: {
        const Value v = eval(*e.args[0]);
        return builtin_filter(e.name, v, call_args(e, 1));
      }
      case Expr::Kind::kTest: {
        const Expr& subject = *e.args[0];
        if ((e.name == "defined" || e.name == "undefined") && subject.kind == Expr::Kind::kName &&
            is_known_function(subject.name) && lookup(subject.name).is_undefined()) {
          // The global functions are defined names (`strftime_now is defined` guards a date).
          return Value((e.name == "defined") != e.negate);
        }
        const Value v = eval(subject);
        const bool r = builtin_test(e.name, v, call_args(e, 1).positional);
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
    if (callee.kind == Expr::Kind::kName) return builtin_function(callee.name, arg);
    return builtin_method(eval(*callee.args[0]), callee.name, arg);
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
