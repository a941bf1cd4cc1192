#include "model/jinja_parser.h"

#include "model/jinja_lexer.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>

namespace baton::jinja {
namespace {

// ---- the expression parser: Jinja's precedence, loosest first ----------------------------------

class ExprParser {
 public:
  ExprParser(std::string_view code, int line) : tokens_(tokenize(code, line)), line_(line) {}

  bool at_end() const { return peek().kind == Token::Kind::kEnd; }
  const Token& peek(size_t ahead = 0) const { return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)]; }
  bool is_op(std::string_view op, size_t ahead = 0) const {
    return peek(ahead).kind == Token::Kind::kOp && peek(ahead).text == op;
  }
  bool is_name(std::string_view name, size_t ahead = 0) const {
    return peek(ahead).kind == Token::Kind::kName && peek(ahead).text == name;
  }
  bool accept_op(std::string_view op) { return is_op(op) && (++pos_, true); }
  bool accept_name(std::string_view name) { return is_name(name) && (++pos_, true); }
  void expect_op(std::string_view op) {
    if (!accept_op(op)) fail(line_, "expected '" + std::string(op) + "', found " + describe(peek()));
  }
  std::string expect_name() {
    if (peek().kind != Token::Kind::kName) fail(line_, "expected a name, found " + describe(peek()));
    return tokens_[pos_++].text;
  }
  void expect_end() {
    if (!at_end()) fail(line_, "unexpected " + describe(peek()));
  }

  // expr := or ['if' or ['else' expr]]
  ExprPtr expression(bool with_cond = true) {
    ExprPtr e = or_expr();
    while (with_cond && accept_name("if")) {
      ExprPtr cond = make(Expr::Kind::kCond);
      ExprPtr test = or_expr();
      ExprPtr other = accept_name("else") ? expression() : nullptr;
      cond->args.push_back(std::move(e));
      cond->args.push_back(std::move(test));
      cond->args.push_back(std::move(other));
      e = std::move(cond);
    }
    return e;
  }

  // An assignment or loop target: a name, or names separated by commas.
  std::vector<std::string> targets() {
    std::vector<std::string> names{expect_name()};
    while (accept_op(",")) names.push_back(expect_name());
    return names;
  }

 private:
  static std::string describe(const Token& t) {
    switch (t.kind) {
      case Token::Kind::kEnd: return "the end of the tag";
      case Token::Kind::kString: return "a string";
      default: return "'" + t.text + "'";
    }
  }

  ExprPtr make(Expr::Kind kind) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line_;
    return e;
  }

  ExprPtr binary(std::string op, ExprPtr l, ExprPtr r) {
    ExprPtr e = make(Expr::Kind::kBinary);
    e->name = std::move(op);
    e->args.push_back(std::move(l));
    e->args.push_back(std::move(r));
    return e;
  }

  ExprPtr or_expr() {
    ExprPtr e = and_expr();
    while (accept_name("or")) e = binary("or", std::move(e), and_expr());
    return e;
  }

  ExprPtr and_expr() {
    ExprPtr e = not_expr();
    while (accept_name("and")) e = binary("and", std::move(e), not_expr());
    return e;
  }

  ExprPtr not_expr() {
    if (accept_name("not")) {
      ExprPtr e = make(Expr::Kind::kUnary);
      e->name = "not";
      e->args.push_back(not_expr());
      return e;
    }
    return compare();
  }

  ExprPtr compare() {
    ExprPtr first = math1();
    ExprPtr e;
    for (;;) {
      std::string op;
      if (peek().kind == Token::Kind::kOp &&
          (is_op("==") || is_op("!=") || is_op("<") || is_op("<=") || is_op(">") || is_op(">="))) {
        op = tokens_[pos_++].text;
      } else if (accept_name("in")) {
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        pos_ += 2;
        op = "not in";
      } else {
        break;
      }
      if (!e) {
        e = make(Expr::Kind::kCompare);
        e->args.push_back(std::move(first));
      }
      e->ops.push_back(op);
      e->args.push_back(math1());
    }
    return e ? std::move(e) : std::move(first);
  }

  ExprPtr math1() {
    ExprPtr e = concat();
    while (is_op("+") || is_op("-")) {
      std::string op = tokens_[pos_++].text;
      e = binary(op, std::move(e), concat());
    }
    return e;
  }

  ExprPtr concat() {
    ExprPtr e = math2();
    while (accept_op("~")) e = binary("~", std::move(e), math2());
    return e;
  }

  ExprPtr math2() {
    ExprPtr e = power();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = tokens_[pos_++].text;
      e = binary(op, std::move(e), power());
    }
    return e;
  }

  ExprPtr power() {
    ExprPtr e = unary(true);
    while (accept_op("**")) e = binary("**", std::move(e), unary(true));
    return e;
  }

  ExprPtr unary(bool with_filter) {
    if (is_op("-") || is_op("+")) {
      ExprPtr e = make(Expr::Kind::kUnary);
      e->name = tokens_[pos_++].text;
      e->args.push_back(unary(false));
      return with_filter ? filters(std::move(e)) : std::move(e);
    }
    ExprPtr e = postfix(primary());
    return with_filter ? filters(std::move(e)) : std::move(e);
  }

  void call_args(Expr& e) {
    if (accept_op(")")) return;
    do {
      if (peek().kind == Token::Kind::kName && is_op("=", 1)) {
        std::string key = tokens_[pos_].text;
        pos_ += 2;
        e.kwargs.emplace_back(std::move(key), expression());
      } else {
        if (!e.kwargs.empty()) fail(line_, "a positional argument follows a keyword argument");
        e.args.push_back(expression());
      }
    } while (accept_op(",") && !is_op(")"));
    expect_op(")");
  }

  ExprPtr filters(ExprPtr e) {
    for (;;) {
      if (accept_op("|")) {
        ExprPtr f = make(Expr::Kind::kFilter);
        f->name = expect_name();
        if (!is_known_filter(f->name)) fail(line_, "the filter '" + f->name + "'", StatusCode::kUnimplemented);
        f->args.push_back(std::move(e));
        if (accept_op("(")) call_args(*f);
        e = std::move(f);
      } else if (accept_name("is")) {
        ExprPtr t = make(Expr::Kind::kTest);
        t->negate = accept_name("not");
        t->name = peek().kind == Token::Kind::kName ? expect_name() : std::string();
        if (t->name.empty() && (is_op("==") || is_op("!="))) t->name = tokens_[pos_++].text;
        if (!is_known_test(t->name)) fail(line_, "the test '" + t->name + "'", StatusCode::kUnimplemented);
        t->args.push_back(std::move(e));
        if (accept_op("(")) {
          call_args(*t);
        } else if (peek().kind == Token::Kind::kString || peek().kind == Token::Kind::kInt ||
                   peek().kind == Token::Kind::kFloat || (peek().kind == Token::Kind::kName && !is_name("and") &&
                                                          !is_name("or") && !is_name("else") && !is_name("if"))) {
          t->args.push_back(postfix(primary()));  // `x is divisibleby 3`, `x is sameas none`
        }
        e = std::move(t);
      } else {
        return e;
      }
    }
  }

  ExprPtr postfix(ExprPtr e) {
    for (;;) {
      if (accept_op(".")) {
        ExprPtr a = make(Expr::Kind::kAttr);
        if (peek().kind == Token::Kind::kInt) {  // `x.0` is x[0]
          a->kind = Expr::Kind::kItem;
          a->args.push_back(std::move(e));
          ExprPtr index = make(Expr::Kind::kLiteral);
          index->value = Value(static_cast<int64_t>(std::stoll(tokens_[pos_++].text)));
          a->args.push_back(std::move(index));
        } else {
          a->name = expect_name();
          a->args.push_back(std::move(e));
        }
        e = std::move(a);
      } else if (accept_op("[")) {
        std::array<ExprPtr, 3> parts;
        int colons = 0;
        for (;;) {
          if (is_op(":")) {
            if (++colons > 2) fail(line_, "a slice has at most three parts");
            ++pos_;
          } else if (is_op("]")) {
            break;
          } else {
            if (parts[colons]) fail(line_, "expected ':' or ']' in a subscript");
            parts[colons] = expression();
          }
        }
        expect_op("]");
        ExprPtr s = make(colons == 0 ? Expr::Kind::kItem : Expr::Kind::kSlice);
        if (colons == 0 && !parts[0]) fail(line_, "an empty subscript");
        s->args.push_back(std::move(e));
        for (int k = 0; k <= (colons == 0 ? 0 : 2); ++k) s->args.push_back(std::move(parts[k]));
        e = std::move(s);
      } else if (accept_op("(")) {
        ExprPtr c = make(Expr::Kind::kCall);
        if (e->kind == Expr::Kind::kName) {
          if (!is_known_function(e->name)) fail(line_, "the function '" + e->name + "'", StatusCode::kUnimplemented);
        } else if (e->kind == Expr::Kind::kAttr) {
          if (!is_known_method(e->name)) fail(line_, "the method '" + e->name + "'", StatusCode::kUnimplemented);
        } else {
          fail(line_, "only functions and methods can be called", StatusCode::kUnimplemented);
        }
        c->args.push_back(std::move(e));
        call_args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  ExprPtr primary() {
    const Token t = peek();
    ++pos_;
    ExprPtr e = make(Expr::Kind::kLiteral);
    switch (t.kind) {
      case Token::Kind::kString: {
        std::string s = t.text;
        while (peek().kind == Token::Kind::kString) s += tokens_[pos_++].text;  // 'a' 'b' is 'ab'
        e->value = Value(std::move(s));
        return e;
      }
      case Token::Kind::kInt: e->value = Value(static_cast<int64_t>(std::stoll(t.text))); return e;
      case Token::Kind::kFloat: e->value = Value(std::stod(t.text)); return e;
      case Token::Kind::kName:
        if (t.text == "true" || t.text == "True") {
          e->value = Value(true);
        } else if (t.text == "false" || t.text == "False") {
          e->value = Value(false);
        } else if (t.text == "none" || t.text == "None") {
          e->value = Value::none();
        } else {
          e->kind = Expr::Kind::kName;
          e->name = t.text;
        }
        return e;
      case Token::Kind::kOp:
        if (t.text == "(") {
          if (accept_op(")")) {
            e->value = Value::list();  // () is an empty tuple
            return e;
          }
          ExprPtr inner = expression();
          if (is_op(",")) {  // a tuple: a list for every purpose a template has
            ExprPtr list = make(Expr::Kind::kList);
            list->args.push_back(std::move(inner));
            while (accept_op(",") && !is_op(")")) list->args.push_back(expression());
            inner = std::move(list);
          }
          expect_op(")");
          return inner;
        }
        if (t.text == "[") {
          e->kind = Expr::Kind::kList;
          while (!accept_op("]")) {
            e->args.push_back(expression());
            if (!is_op("]")) expect_op(",");
          }
          return e;
        }
        if (t.text == "{") {
          e->kind = Expr::Kind::kDict;
          while (!accept_op("}")) {
            if (peek().kind != Token::Kind::kString) fail(line_, "dict keys must be string literals", StatusCode::kUnimplemented);
            std::string key = tokens_[pos_++].text;
            expect_op(":");
            e->kwargs.emplace_back(std::move(key), expression());
            if (!is_op("}")) expect_op(",");
          }
          return e;
        }
        break;
      default: break;
    }
    fail(line_, "unexpected " + describe(t));
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int line_;
};

// ---- the statement parser ------------------------------------------------------------------------

class Parser {
 public:
  explicit Parser(std::vector<Tag> tags) : tags_(std::move(tags)) {}

  Body parse() {
    Body body = block({});
    if (pos_ < tags_.size()) fail(tags_[pos_].line, "unexpected {% " + keyword_ + " %}");
    return body;
  }

 private:
  // Nodes up to a statement whose keyword is in `ends` (left as keyword_, its parser in args_).
  Body block(const std::vector<std::string_view>& ends) {
    Body body;
    while (pos_ < tags_.size()) {
      const Tag& tag = tags_[pos_];
      auto node = std::make_unique<Node>();
      node->line = tag.line;
      if (tag.kind == Tag::Kind::kText) {
        node->kind = Node::Kind::kText;
        node->text = tag.text;
        ++pos_;
      } else if (tag.kind == Tag::Kind::kExpr) {
        ExprParser p(tag.text, tag.line);
        node->kind = Node::Kind::kOutput;
        node->expr = p.expression();
        p.expect_end();
        ++pos_;
      } else {
        args_ = std::make_unique<ExprParser>(tag.text, tag.line);
        keyword_ = args_->at_end() ? "" : args_->peek().text;
        if (std::find(ends.begin(), ends.end(), keyword_) != ends.end()) return body;
        args_->expect_name();
        ++pos_;
        if (!statement(*node)) continue;
      }
      body.push_back(std::move(node));
    }
    if (!ends.empty()) fail(tags_.empty() ? 1 : tags_.back().line, "the template ends inside a block (expected {% " + std::string(ends.back()) + " %})");
    return body;
  }

  // Parses the statement whose keyword was just read; false when it makes no node.
  bool statement(Node& node) {
    ExprParser& p = *args_;
    const int line = node.line;
    if (keyword_ == "if") {
      node.kind = Node::Kind::kIf;
      ExprPtr cond = p.expression();
      p.expect_end();
      for (;;) {
        Body body = block({"elif", "else", "endif"});
        node.branches.emplace_back(std::move(cond), std::move(body));
        const std::string kw = keyword_;
        ExprParser& q = *args_;
        q.expect_name();
        ++pos_;
        if (kw == "elif") {
          cond = q.expression();
          q.expect_end();
          continue;
        }
        q.expect_end();
        if (kw == "else") {
          node.branches.emplace_back(nullptr, block({"endif"}));
          args_->expect_name();
          args_->expect_end();
          ++pos_;
        }
        break;
      }
      return true;
    }
    if (keyword_ == "for") {
      node.kind = Node::Kind::kFor;
      node.targets = p.targets();
      if (!p.accept_name("in")) fail(line, "expected 'in' in a for loop");
      node.expr = p.expression(/*with_cond=*/false);
      if (p.accept_name("if")) node.filter = p.expression(false);
      if (p.accept_name("recursive")) fail(line, "recursive loops", StatusCode::kUnimplemented);
      p.expect_end();
      node.body = block({"else", "endfor"});
      if (keyword_ == "else") {
        args_->expect_name();
        args_->expect_end();
        ++pos_;
        node.else_body = block({"endfor"});
      }
      args_->expect_name();
      args_->expect_end();
      ++pos_;
      return true;
    }
    if (keyword_ == "set") {
      node.kind = Node::Kind::kSet;
      node.targets = p.targets();
      if (node.targets.size() == 1 && p.accept_op(".")) node.attr = p.expect_name();
      if (!p.accept_op("=")) fail(line, "block assignments ({% set x %}...{% endset %})", StatusCode::kUnimplemented);
      node.expr = p.expression();
      p.expect_end();
      return true;
    }
    if (keyword_ == "break" || keyword_ == "continue") {
      node.kind = keyword_ == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      p.expect_end();
      return true;
    }
    if (keyword_ == "generation") {  // transformers' assistant-mask marker: renders its body
      p.expect_end();
      node.kind = Node::Kind::kIf;
      auto always = std::make_unique<Expr>();
      always->kind = Expr::Kind::kLiteral;
      always->value = Value(true);
      node.branches.emplace_back(std::move(always), block({"endgeneration"}));
      args_->expect_name();
      args_->expect_end();
      ++pos_;
      return true;
    }
    if (keyword_ == "endif" || keyword_ == "endfor" || keyword_ == "elif" || keyword_ == "else" ||
        keyword_ == "endgeneration") {
      fail(line, "{% " + keyword_ + " %} without its opening statement");
    }
    fail(line, "the statement {% " + keyword_ + " %}", StatusCode::kUnimplemented);
  }

  std::vector<Tag> tags_;
  size_t pos_ = 0;
  std::string keyword_;
  std::unique_ptr<ExprParser> args_;
};

}  // namespace

bool is_known_filter(std::string_view name) {
  static constexpr std::array<std::string_view, 27> kFilters = {
      "trim",  "length", "count",   "upper", "lower",   "title",  "capitalize", "tojson", "string",
      "int",   "float",  "first",   "last",  "join",    "default", "d",         "replace", "list",
      "reverse", "abs",  "safe",    "items", "selectattr", "rejectattr", "map", "select", "reject"};
  return std::find(kFilters.begin(), kFilters.end(), name) != kFilters.end();
}

bool is_known_test(std::string_view name) {
  static constexpr std::array<std::string_view, 22> kTests = {
      "defined", "undefined", "none",  "string",  "number", "integer", "float",  "mapping",
      "iterable", "sequence", "boolean", "true",  "false",  "even",    "odd",    "divisibleby",
      "equalto", "eq",        "==",    "ne",      "!=",     "in"};
  return std::find(kTests.begin(), kTests.end(), name) != kTests.end();
}

bool is_known_function(std::string_view name) {
  return name == "raise_exception" || name == "namespace" || name == "range" || name == "strftime_now" ||
         name == "dict";
}

bool is_known_method(std::string_view name) {
  static constexpr std::array<std::string_view, 17> kMethods = {
      "strip", "lstrip", "rstrip", "upper", "lower", "title", "capitalize", "startswith", "endswith",
      "split", "replace", "join",  "items", "keys",  "values", "get",       "count"};
  return std::find(kMethods.begin(), kMethods.end(), name) != kMethods.end();
}

Result<Body> parse_template(std::string_view source) {
  try {
    return Parser(lex(source)).parse();
  } catch (const ParseError& e) {
    std::string what = e.code == StatusCode::kUnimplemented ? "uses " + e.message + ", which baton does not render"
                                                            : e.message;
    return Status(e.code, "line " + std::to_string(e.line) + ": " + what);
  } catch (const RenderError& e) {  // a value built while parsing
    return invalid_argument(e.what());
  }
}

}  // namespace baton::jinja
