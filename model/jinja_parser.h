// Jinja source -> a syntax tree, with the lexer settings transformers renders chat templates
// with: trim_blocks and lstrip_blocks on, a single trailing newline dropped, newlines normalised
// to "\n", the loop controls (break, continue) enabled.
//
// The statements: if/elif/else, for (with `if` filter, else, tuple targets), set (names, tuple
// targets, namespace attributes), break, continue, and generation blocks (rendered as their
// body). Expressions: Python literals, lists, dicts, names, attributes, subscripts and slices,
// calls, filters, tests, arithmetic, ~, comparisons (chained), in / not in, and / or / not, and
// conditional expressions. Filters, tests, functions and methods are checked against what the
// renderer implements when the template is parsed, so a template baton cannot render fails to
// load, naming the construct and its line, and never renders half.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "model/jinja_value.h"

namespace baton::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,  // value
    kName,     // name
    kList,     // args: the items
    kDict,     // kwargs: the entries (keys are literal strings)
    kAttr,     // args[0].name
    kItem,     // args[0][args[1]]
    kSlice,    // args[0][args[1]:args[2]:args[3]], a null part omitted
    kCall,     // args[0](args[1..], kwargs): args[0] a global function's name or a method (kAttr)
    kFilter,   // args[0] | name(args[1..], kwargs)
    kTest,     // args[0] is [not] name(args[1..])
    kUnary,    // name in {"-", "+", "not"} applied to args[0]
    kBinary,   // args[0] name args[1]; name an arithmetic operator, "~", "and", "or"
    kCompare,  // args[0] ops[0] args[1] ops[1] args[2] ...; ops in {==, !=, <, <=, >, >=, in, not in}
    kCond,     // args[0] if args[1] else args[2] (args[2] null: undefined)
  };
  Kind kind;
  int line = 0;
  Value value;
  std::string name;
  bool negate = false;  // kTest: `is not`
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

struct Node {
  enum class Kind {
    kText,      // text
    kOutput,    // {{ expr }}
    kIf,        // branches: (condition, body)...; a null condition is the else branch
    kFor,       // for targets in expr [if filter]: body [else: else_body]
    kSet,       // set targets = expr, or set targets[0].attr = expr when attr is not empty
    kBreak,
    kContinue,
  };
  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr filter;
  std::vector<std::string> targets;
  std::string attr;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body;
  Body else_body;
};

// The names the renderer implements, which the parser accepts.
bool is_known_filter(std::string_view name);
bool is_known_test(std::string_view name);
bool is_known_function(std::string_view name);
bool is_known_method(std::string_view name);

// INVALID_ARGUMENT for malformed source, UNIMPLEMENTED for Jinja that baton does not render;
// both name the line.
Result<Body> parse_template(std::string_view source);

}  // namespace baton::jinja
