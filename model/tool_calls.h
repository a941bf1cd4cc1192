// OpenAI tools on a chat model: the format a forced call is decoded under, and the model's output
// read back into content and calls, in the syntax its chat template uses (ToolCallSyntax).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/chat_template.h"
#include "model/sampler.h"

namespace baton {

struct ToolOutput {
  std::string content;  // the text outside the calls
  bool content_null = false;  // calls and nothing else (OpenAI's content: null)
  std::vector<ToolCall> calls;  // id empty: the caller names them
};

// One call to the function `name` (empty: to any of `tools`) in `syntax`, its arguments
// constrained by the function's parameters schema. `tools_json`: OpenAI's tools array (checked by
// the caller: each {"type": "function", "function": {"name", "parameters"?}}). The parameters'
// $defs are lifted beside the call's schema (a later tool's definition wins a clash of names).
// INVALID_ARGUMENT when `name` is not among them or a schema is outside the subset.
Result<OutputFormat> forced_tool_call_format(ToolCallSyntax syntax, std::string_view tools_json, const std::string& name);

// The calls in `text` (a call whose JSON does not parse, or that names no function, stays text).
ToolOutput parse_tool_calls(ToolCallSyntax syntax, std::string_view text);

// Streaming: how much of `text` (the output so far) is content whatever follows (no call can
// start inside it), to be sent now; the rest waits for more text or the end.
size_t tool_call_free_prefix(ToolCallSyntax syntax, std::string_view text);

}  // namespace baton
