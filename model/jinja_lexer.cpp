#include "model/jinja_lexer.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cstddef>

namespace baton::jinja {
namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// ---- the template lexer ---------------------------------------------------------------------------

// Jinja's newline handling: "\r\n" and "\r" read as "\n", and one trailing newline dropped
// (keep_trailing_newline is off).
std::string normalise_newlines(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

// The end of the tag that starts its code at `pos`: the offset of `close` outside string literals.
size_t find_tag_end(const std::string& s, size_t pos, std::string_view close, int line) {
  char quote = 0;
  for (; pos < s.size(); ++pos) {
    const char c = s[pos];
    if (quote != 0) {
      if (c == '\\') {
        ++pos;
      } else if (c == quote) {
        quote = 0;
      }
    } else if (c == '\'' || c == '"') {
      quote = c;
    } else if (s.compare(pos, close.size(), close) == 0) {
      return pos;
    }
  }
  fail(line, "a tag is not closed with '" + std::string(close) + "'");
}

// ---- the expression lexer ----------------------------------------------------------------------

// Python's unicode-escape decoding of a string literal's body.
std::string unescape(std::string_view body, int line) {
  std::string out;
  const auto append_utf8 = [&](uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | cp >> 6);
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | cp >> 12);
      out += static_cast<char>(0x80 | (cp >> 6 & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | cp >> 18);
      out += static_cast<char>(0x80 | (cp >> 12 & 0x3F));
      out += static_cast<char>(0x80 | (cp >> 6 & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  };
  const auto hex = [&](size_t& i, int digits) {
    if (i + static_cast<size_t>(digits) > body.size()) fail(line, "a truncated \\x, \\u or \\U escape in a string");
    uint32_t cp = 0;
    auto [p, ec] = std::from_chars(body.data() + i, body.data() + i + digits, cp, 16);
    if (ec != std::errc() || p != body.data() + i + digits) fail(line, "a malformed \\x, \\u or \\U escape");
    i += static_cast<size_t>(digits) - 1;
    append_utf8(cp);
  };
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] != '\\' || i + 1 == body.size()) {
      out += body[i];
      continue;
    }
    const char e = body[++i];
    switch (e) {
      case 'n': out += '\n'; break;
      case 't': out += '\t'; break;
      case 'r': out += '\r'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'v': out += '\v'; break;
      case '\n': break;  // a line continuation
      case '\\':
      case '\'':
      case '"': out += e; break;
      case 'x': ++i, hex(i, 2); break;
      case 'u': ++i, hex(i, 4); break;
      case 'U': ++i, hex(i, 8); break;
      default:
        if (e >= '0' && e <= '7') {
          uint32_t cp = 0;
          int n = 0;
          for (; n < 3 && i < body.size() && body[i] >= '0' && body[i] <= '7'; ++n, ++i) cp = cp * 8 + (body[i] - '0');
          --i;
          append_utf8(cp);
        } else {
          out += {'\\', e};  // Python keeps an unknown escape as it is
        }
    }
  }
  return out;
}

}  // namespace

void fail(int line, std::string message, StatusCode code) { throw ParseError{code, std::move(message), line}; }

std::vector<Tag> lex(std::string_view raw) {
  const std::string s = normalise_newlines(raw);
  std::vector<Tag> tags;
  size_t pos = 0;
  int line = 1;
  bool line_starting = true;  // the previous tag's last consumed character was a newline
  const auto count_lines = [&](size_t from, size_t to) {
    line += static_cast<int>(std::count(s.begin() + static_cast<std::ptrdiff_t>(from), s.begin() + static_cast<std::ptrdiff_t>(to), '\n'));
  };
  while (pos < s.size()) {
    size_t open = pos;
    while ((open = s.find('{', open)) != std::string::npos && open + 1 < s.size() &&
           s[open + 1] != '{' && s[open + 1] != '%' && s[open + 1] != '#') {
      ++open;
    }
    if (open == std::string::npos || open + 1 >= s.size()) {
      tags.push_back({Tag::Kind::kText, s.substr(pos), line});
      break;
    }
    const char type = s[open + 1];
    const char sign = open + 2 < s.size() ? s[open + 2] : 0;
    std::string text = s.substr(pos, open - pos);
    if (sign == '-') {
      while (!text.empty() && is_space(text.back())) text.pop_back();
    } else if (sign != '+' && type != '{') {
      // lstrip_blocks: white space between a line's start and a block or comment tag goes.
      const size_t line_start = text.rfind('\n') + 1;  // npos + 1 == 0
      if ((line_start > 0 || line_starting) && line_start < text.size() &&
          std::all_of(text.begin() + static_cast<std::ptrdiff_t>(line_start), text.end(), is_space)) {
        text.resize(line_start);
      }
    }
    count_lines(pos, open);
    if (!text.empty()) tags.push_back({Tag::Kind::kText, std::move(text), line});
    const int tag_line = line;
    const size_t code = open + 2 + (sign == '-' || sign == '+' ? 1 : 0);
    const std::string close = type == '{' ? "}}" : type == '%' ? "%}" : "#}";
    const size_t end = type == '#' ? s.find(close, code) : find_tag_end(s, code, close, tag_line);
    if (end == std::string::npos) fail(tag_line, "a comment is not closed with '#}'");
    const char end_sign = end > code && (s[end - 1] == '-' || s[end - 1] == '+') ? s[end - 1] : 0;
    if (type != '#') {
      tags.push_back({type == '{' ? Tag::Kind::kExpr : Tag::Kind::kStmt,
                      s.substr(code, end - code - (end_sign != 0 ? 1 : 0)), tag_line});
    }
    size_t next = end + 2;
    if (end_sign == '-') {
      while (next < s.size() && is_space(s[next])) ++next;
    } else if (end_sign != '+' && type != '{' && next < s.size() && s[next] == '\n') {
      ++next;  // trim_blocks: the newline after a block or comment tag goes
    }
    count_lines(open, next);
    line_starting = s[next - 1] == '\n';
    pos = next;
  }
  return tags;
}

std::vector<Token> tokenize(std::string_view code, int line) {
  static constexpr std::array<std::string_view, 6> kTwoChar = {"==", "!=", "<=", ">=", "//", "**"};
  std::vector<Token> tokens;
  size_t i = 0;
  while (i < code.size()) {
    const char c = code[i];
    if (is_space(c)) {
      line += c == '\n';
      ++i;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < code.size() && (std::isalnum(static_cast<unsigned char>(code[j])) || code[j] == '_')) ++j;
      tokens.push_back({Token::Kind::kName, std::string(code.substr(i, j - i))});
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      bool is_float = false;
      while (j < code.size() && (std::isdigit(static_cast<unsigned char>(code[j])) || code[j] == '_')) ++j;
      if (j + 1 < code.size() && code[j] == '.' && std::isdigit(static_cast<unsigned char>(code[j + 1]))) {
        is_float = true;
        for (++j; j < code.size() && std::isdigit(static_cast<unsigned char>(code[j])); ++j) {
        }
      }
      if (j < code.size() && (code[j] == 'e' || code[j] == 'E')) {
        size_t k = j + 1;
        if (k < code.size() && (code[k] == '+' || code[k] == '-')) ++k;
        if (k < code.size() && std::isdigit(static_cast<unsigned char>(code[k]))) {
          is_float = true;
          for (j = k; j < code.size() && std::isdigit(static_cast<unsigned char>(code[j])); ++j) {
          }
        }
      }
      std::string digits(code.substr(i, j - i));
      std::erase(digits, '_');
      tokens.push_back({is_float ? Token::Kind::kFloat : Token::Kind::kInt, std::move(digits)});
      i = j;
    } else if (c == '\'' || c == '"') {
      size_t j = i + 1;
      while (j < code.size() && code[j] != c) j += code[j] == '\\' ? 2 : 1;
      if (j >= code.size()) fail(line, "a string literal is not closed");
      tokens.push_back({Token::Kind::kString, unescape(code.substr(i + 1, j - i - 1), line)});
      line += static_cast<int>(std::count(code.begin() + static_cast<std::ptrdiff_t>(i), code.begin() + static_cast<std::ptrdiff_t>(j), '\n'));
      i = j + 1;
    } else {
      const std::string_view two = code.substr(i, 2);
      if (std::find(kTwoChar.begin(), kTwoChar.end(), two) != kTwoChar.end() && two.size() == 2) {
        tokens.push_back({Token::Kind::kOp, std::string(two)});
        i += 2;
      } else if (std::string_view("+-*/%~<>=()[]{},.:|").find(c) != std::string_view::npos) {
        tokens.push_back({Token::Kind::kOp, std::string(1, c)});
        ++i;
      } else {
        fail(line, std::string("unexpected character '") + c + "'");
      }
    }
  }
  tokens.push_back({Token::Kind::kEnd, ""});
  return tokens;
}

}  // namespace baton::jinja
