// The OpenAI API's tools, read from a chat request (not a public interface: server/openai_json.h
// is): the functions offered, tool_choice, and the tool fields of messages.
#pragma once

#include <string>

#include "common/status.h"
#include "model/chat_template.h"
#include "server/openai_json_util.h"

namespace baton::openai_internal {

struct ToolRequest {
  enum class Choice { kNone, kAuto, kRequired, kNamed };
  std::string tools_json;  // the tools array as the template gets it; empty: no tools
  Choice choice = Choice::kNone;
  std::string name;        // kNamed: the function
};

// `tools` (each {"type": "function", "function": {"name", "description"?, "parameters"?,
// "strict"?}}), `tool_choice` ("none", "auto", "required", {"type": "function", "function":
// {"name"}}; default auto with tools, none without) and `parallel_tool_calls` (a boolean).
Result<ToolRequest> read_tools(const Json& body);

// A message's tool fields: an assistant's tool_calls ([{id, type: "function", function: {name,
// arguments (a JSON object as a string)}}]) and a tool message's tool_call_id. `at` names it.
Status read_message_tools(const Json& m, const std::string& at, ChatMessage* message);

}  // namespace baton::openai_internal
