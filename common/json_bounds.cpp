#include "common/json_bounds.h"

#include <string>
#include <vector>

namespace baton {

namespace {

// Calls `f(c, i)` for each byte of `text` outside JSON strings (escapes understood), until it
// returns false.
template <typename F>
void outside_strings(std::string_view text, F f) {
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (!f(c, i)) {
      return;
    }
  }
}

}  // namespace

JsonShape json_shape(std::string_view text, int stop_depth) {
  JsonShape shape;
  // Per open container: its members so far (an object's), or -1 (an array).
  std::vector<int64_t> open;
  outside_strings(text, [&](char c, size_t) {
    switch (c) {
      case '[':
      case '{':
        open.push_back(c == '{' ? 0 : -1);
        if (static_cast<int>(open.size()) > shape.depth) {
          shape.depth = static_cast<int>(open.size());
          if (shape.depth > stop_depth) return false;
        }
        break;
      case ']':
      case '}':
        if (!open.empty()) open.pop_back();
        break;
      case ':':  // one per member of the object it is in
        if (!open.empty() && open.back() >= 0 && ++open.back() > shape.widest_object) shape.widest_object = open.back();
        break;
      default: break;
    }
    return true;
  });
  return shape;
}

size_t json_value_end(std::string_view text) {
  int depth = 0;
  size_t end = std::string_view::npos;
  outside_strings(text, [&](char c, size_t i) {
    if (c == '[' || c == '{') {
      ++depth;
    } else if ((c == ']' || c == '}') && --depth == 0) {
      end = i + 1;
      return false;
    }
    return true;
  });
  return end;
}

Status check_json_bounds(std::string_view text, std::string_view field, int max_depth, int64_t max_members) {
  const JsonShape shape = json_shape(text, max_depth);
  if (shape.depth > max_depth) {
    return invalid_argument(std::string(field) + " nests deeper than " + std::to_string(max_depth) +
                            " levels of arrays and objects (the limit on JSON in a request)");
  }
  if (shape.widest_object > max_members) {
    return invalid_argument(std::string(field) + " has an object of " + std::to_string(shape.widest_object) +
                            " members; at most " + std::to_string(max_members) + " (the limit on JSON in a request)");
  }
  return {};
}

}  // namespace baton
