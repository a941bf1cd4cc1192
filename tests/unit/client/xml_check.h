// A strict, small XML well-formedness check for the SVG the client writes (no DTDs, no CDATA,
// no comments: the writer emits none): one root, tags nested and closed in order, attribute
// values quoted and free of '<', '&' only as one of the five predefined entities. Returns the
// problem, or "" when the document is well-formed; `*root` gets the root element's name.
#pragma once

#include <cctype>
#include <string>
#include <string_view>
#include <vector>

namespace baton::test {

inline bool xml_name_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == ':' || c == '.';
}

// `text` at `i` starts an entity: one of &amp; &lt; &gt; &quot; &apos;.
inline bool xml_entity_at(std::string_view text, size_t i) {
  for (std::string_view e : {"&amp;", "&lt;", "&gt;", "&quot;", "&apos;"}) {
    if (text.substr(i, e.size()) == e) return true;
  }
  return false;
}

inline std::string xml_problem(std::string_view doc, std::string* root = nullptr) {
  size_t i = 0;
  if (doc.starts_with("<?xml")) {
    i = doc.find("?>");
    if (i == std::string_view::npos) return "unterminated XML declaration";
    i += 2;
  }
  std::vector<std::string> open;
  bool root_seen = false;
  while (i < doc.size()) {
    if (doc[i] != '<') {
      if (doc[i] == '&' && !xml_entity_at(doc, i)) return "bare '&' at " + std::to_string(i);
      if (doc[i] == '>') return "bare '>' at " + std::to_string(i);
      if (open.empty() && !std::isspace(static_cast<unsigned char>(doc[i]))) return "text outside the root";
      ++i;
      continue;
    }
    const bool closing = i + 1 < doc.size() && doc[i + 1] == '/';
    size_t j = i + (closing ? 2 : 1);
    const size_t name_start = j;
    while (j < doc.size() && xml_name_char(doc[j])) ++j;
    const std::string name(doc.substr(name_start, j - name_start));
    if (name.empty()) return "empty tag name at " + std::to_string(i);
    if (closing) {
      if (j >= doc.size() || doc[j] != '>') return "bad closing tag " + name;
      if (open.empty() || open.back() != name)
        return "</" + name + "> closes " + (open.empty() ? "nothing" : open.back());
      open.pop_back();
      i = j + 1;
      continue;
    }
    // Attributes: name="value" separated by spaces.
    std::vector<std::string> names;
    for (;;) {
      while (j < doc.size() && doc[j] == ' ') ++j;
      if (j >= doc.size()) return "unterminated tag " + name;
      if (doc[j] == '>' || doc.substr(j, 2) == "/>") break;
      const size_t an = j;
      while (j < doc.size() && xml_name_char(doc[j])) ++j;
      if (j == an || j + 1 >= doc.size() || doc[j] != '=' || doc[j + 1] != '"') return "bad attribute in " + name;
      const std::string attr(doc.substr(an, j - an));
      for (const std::string& n : names) {
        if (n == attr) return "attribute " + attr + " twice in " + name;
      }
      names.push_back(attr);
      j += 2;
      while (j < doc.size() && doc[j] != '"') {
        if (doc[j] == '<') return "'<' in attribute " + attr;
        if (doc[j] == '&' && !xml_entity_at(doc, j)) return "bare '&' in attribute " + attr;
        ++j;
      }
      if (j >= doc.size()) return "unterminated attribute " + attr;
      ++j;
      if (j < doc.size() && doc[j] != ' ' && doc[j] != '>' && doc[j] != '/') return "no space after attribute " + attr;
    }
    if (open.empty()) {
      if (root_seen) return "a second root element " + name;
      root_seen = true;
      if (root != nullptr) *root = name;
    }
    if (doc[j] == '>') {
      open.push_back(name);
      i = j + 1;
    } else {
      i = j + 2;
    }
  }
  if (!open.empty()) return "<" + open.back() + "> never closed";
  if (!root_seen) return "no root element";
  return "";
}

}  // namespace baton::test
