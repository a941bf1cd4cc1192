// The lexers of the Jinja engine (jinja_parser.h): the template split into text, {{ }} and
// {% %} tags with transformers' white-space settings (trim_blocks, lstrip_blocks, newlines
// normalised, one trailing newline dropped), and a tag's code split into tokens. Internal to the
// parser.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace baton::jinja {

// A parse failure: the message and the line, turned into a Status by parse_template().
struct ParseError {
  StatusCode code;
  std::string message;
  int line;
};

[[noreturn]] void fail(int line, std::string message, StatusCode code = StatusCode::kInvalidArgument);

struct Tag {
  enum class Kind { kText, kExpr, kStmt } kind;
  std::string text;
  int line;
};

// The template's text and tags in order; comments are dropped.
std::vector<Tag> lex(std::string_view source);

struct Token {
  enum class Kind { kName, kString, kInt, kFloat, kOp, kEnd } kind;
  std::string text;  // a name, an operator, a string's value, a number's digits
};

// A tag's code as tokens, ending with a kEnd token.
std::vector<Token> tokenize(std::string_view code, int line);

}  // namespace baton::jinja
