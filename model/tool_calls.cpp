#include "model/tool_calls.h"

#include <nlohmann/json.hpp>

#include "common/json_bounds.h"
#include "common/json_parse.h"
#include "model/output_constraints.h"

namespace baton {
namespace {

using Json = nlohmann::ordered_json;

// Generated JSON (which a prompt can steer) nested deeper than this, or with an object wider than
// kMaxJsonObjectMembers, stays text: a call's arguments are copied and dumped again, which recurses
// per level, and ordered_json parses wide objects in quadratic time.
constexpr int kMaxCallDepth = 256;

constexpr std::string_view kOpen = "<tool_call>", kClose = "</tool_call>";
// Mistral (v0.3 and later templates): "[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]".
constexpr std::string_view kMistralCalls = "[TOOL_CALLS]";

std::string_view trim(std::string_view s) {
  const size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string_view::npos) return {};
  return s.substr(a, s.find_last_not_of(" \t\r\n") - a + 1);
}

// {"name": ..., "arguments" | "parameters": {...}} → a call (arguments as compact JSON text).
bool read_call(const Json& j, ToolCall* call) {
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return false;
  const Json* args = j.contains("arguments") ? &j["arguments"] : j.contains("parameters") ? &j["parameters"] : nullptr;
  call->name = j["name"].get<std::string>();
  if (args == nullptr) {
    call->arguments = "{}";
  } else if (args->is_string()) {
    call->arguments = args->get<std::string>();  // already JSON text, as OpenAI sends it
  } else {
    call->arguments = args->dump();
  }
  return true;
}

bool read_call(std::string_view text, ToolCall* call) {
  if (!check_json_bounds(text, "", kMaxCallDepth).ok()) return false;
  Json j;
  return parse_ordered_json(trim(text), &j) && read_call(j, call);
}

// Mistral: each "[TOOL_CALLS]" followed by a JSON list of calls (or one call) is read; a list
// with anything but calls in it, or one cut short, is text, as is everything after it.
void parse_mistral(std::string_view text, ToolOutput* out) {
  size_t at = 0;
  while (at < text.size()) {
    const size_t marker = text.find(kMistralCalls, at);
    if (marker == std::string_view::npos) break;
    const size_t open = text.find_first_not_of(" \t\r\n", marker + kMistralCalls.size());
    if (open == std::string_view::npos || (text[open] != '[' && text[open] != '{')) break;
    const size_t end = json_value_end(text.substr(open));
    if (end == std::string_view::npos || !check_json_bounds(text.substr(open, end), "", kMaxCallDepth).ok()) break;
    Json j;
    if (!parse_ordered_json(text.substr(open, end), &j)) break;
    std::vector<ToolCall> calls;
    bool all = true;
    for (const Json& item : j.is_array() ? j : Json::array({j})) {
      ToolCall call;
      all = all && read_call(item, &call);
      calls.push_back(std::move(call));
    }
    if (!all || calls.empty()) break;
    out->content += text.substr(at, marker - at);
    for (ToolCall& c : calls) out->calls.push_back(std::move(c));
    at = open + end;
  }
  out->content += text.substr(std::min(at, text.size()));
}

// The text a call starts with in `syntax` (empty: kJson, whose call is the whole output).
std::string_view call_marker(ToolCallSyntax syntax) {
  switch (syntax) {
    case ToolCallSyntax::kTagged: return kOpen;
    case ToolCallSyntax::kMistral: return kMistralCalls;
    case ToolCallSyntax::kJson: break;
  }
  return {};
}

}  // namespace

Result<OutputFormat> forced_tool_call_format(ToolCallSyntax syntax, std::string_view tools_json, const std::string& name) {
  BATON_RETURN_IF_ERROR(check_json_bounds(tools_json, "tools"));
  Json tools;
  if (!parse_ordered_json(tools_json, &tools) || !tools.is_array()) return invalid_argument("tools must be an array");
  const char* args_key = syntax == ToolCallSyntax::kJson ? "parameters" : "arguments";
  Json calls = Json::array(), defs = Json::object();
  for (const Json& t : tools) {
    const Json& f = t["function"];
    const std::string fname = f["name"].get<std::string>();
    if (!name.empty() && fname != name) continue;
    Json params = f.contains("parameters") ? f["parameters"] : Json{{"type", "object"}, {"properties", Json::object()}};
    for (const char* key : {"$defs", "definitions"}) {
      if (params.is_object() && params.contains(key)) {
        for (const auto& [k, v] : params[key].items()) defs[k] = v;
        params.erase(key);
      }
    }
    calls.push_back({{"type", "object"},
                     {"properties", {{"name", {{"const", fname}}}, {args_key, params}}},
                     {"required", {"name", args_key}},
                     {"additionalProperties", false}});
  }
  if (calls.empty()) return invalid_argument("tool_choice names function '" + name + "', which is not in tools");
  Json schema = calls.size() == 1 ? calls[0] : Json{{"anyOf", calls}};
  if (!defs.empty()) {
    if (calls.size() == 1) schema = Json{{"anyOf", Json::array({schema})}};
    schema["$defs"] = defs;
  }
  OutputFormat f;
  f.kind = OutputFormat::Kind::kJsonSchema;
  f.schema = schema.dump();
  if (syntax == ToolCallSyntax::kTagged) {
    f.prefix = std::string(kOpen) + "\n";
    f.suffix = "\n" + std::string(kClose);
  } else if (syntax == ToolCallSyntax::kMistral) {
    f.prefix = std::string(kMistralCalls) + " [";
    f.suffix = "]";
  }
  if (Status st = validate_output_format(f); !st.ok()) return st.with_message("tools: " + st.message());
  return f;
}

ToolOutput parse_tool_calls(ToolCallSyntax syntax, std::string_view text) {
  ToolOutput out;
  if (syntax == ToolCallSyntax::kJson) {
    ToolCall call;
    if (!trim(text).empty() && trim(text).front() == '{' && read_call(text, &call)) {
      out.calls.push_back(std::move(call));
    } else {
      out.content = std::string(text);
    }
  } else if (syntax == ToolCallSyntax::kMistral) {
    parse_mistral(text, &out);
  } else {
    size_t at = 0;
    while (at < text.size()) {
      const size_t open = text.find(kOpen, at);
      if (open == std::string_view::npos) break;
      const size_t body = open + kOpen.size();
      const size_t close = text.find(kClose, body);
      std::string_view inner = text.substr(body, close == std::string_view::npos ? std::string_view::npos : close - body);
      if (close == std::string_view::npos) {
        // Cut short inside the closing tag: what it had of it is not part of the JSON.
        inner = trim(inner);
        for (size_t n = std::min(inner.size(), kClose.size() - 1); n > 0; --n) {
          if (inner.substr(inner.size() - n) == kClose.substr(0, n)) {
            inner.remove_suffix(n);
            break;
          }
        }
      }
      ToolCall call;
      if (!read_call(inner, &call)) {
        break;  // not a call after all: the rest is text
      }
      out.content += text.substr(at, open - at);
      out.calls.push_back(std::move(call));
      at = close == std::string_view::npos ? text.size() : close + kClose.size();
    }
    out.content += text.substr(std::min(at, text.size()));
  }
  if (!out.calls.empty()) {
    out.content = std::string(trim(out.content));
    out.content_null = out.content.empty();
  }
  return out;
}

size_t tool_call_free_prefix(ToolCallSyntax syntax, std::string_view text) {
  if (syntax == ToolCallSyntax::kJson) {
    // A call is the whole output: undecided while there is only blank space, held when it opens
    // with '{'.
    const std::string_view t = trim(text);
    return t.empty() || t.front() == '{' ? 0 : text.size();
  }
  const std::string_view marker = call_marker(syntax);
  if (const size_t open = text.find(marker); open != std::string_view::npos) return open;
  // A tail that may still become the marker waits.
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == marker.substr(0, n)) return text.size() - n;
  }
  return text.size();
}

}  // namespace baton
