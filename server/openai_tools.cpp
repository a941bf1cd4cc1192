#include "server/openai_tools.h"

#include "common/json_bounds.h"
#include "common/json_parse.h"
#include "server/request_validation.h"

namespace baton::openai_internal {
namespace {

bool valid_function_name(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') return false;
  }
  return true;
}

}  // namespace

Result<ToolRequest> read_tools(const Json& body) {
  ToolRequest r;
  const Json* tools = member(body, "tools");
  std::vector<std::string> names;
  if (tools != nullptr) {
    if (!tools->is_array()) return wrong_type("tools", "an array", *tools);
    if (tools->size() > 128) return invalid_argument("tools: at most 128 functions");
    for (size_t i = 0; i < tools->size(); ++i) {
      const std::string at = "tools[" + std::to_string(i) + "]";
      const Json& t = (*tools)[i];
      if (!t.is_object()) return wrong_type(at, "an object", t);
      const Json* type = member(t, "type");
      if (type == nullptr || *type != "function") return invalid_argument(at + ".type must be 'function'");
      const Json* f = member(t, "function");
      if (f == nullptr || !f->is_object()) return invalid_argument(at + ".function must be an object with a name");
      const Json* name = member(*f, "name");
      if (name == nullptr) return invalid_argument(at + ".function.name is missing");
      BATON_ASSIGN_OR_RETURN(std::string n, as_string(*name, at + ".function.name"));
      if (!valid_function_name(n)) {
        return invalid_argument(at + ".function.name must be 1 to 64 letters, digits, '_' or '-', got " + quote_input(n));
      }
      if (const Json* p = member(*f, "parameters"); p != nullptr && !p->is_object()) {
        return wrong_type(at + ".function.parameters", "an object (a JSON Schema)", *p);
      }
      names.push_back(std::move(n));
    }
    if (!tools->empty()) r.tools_json = tools->dump();
  }
  if (const Json* p = member(body, "parallel_tool_calls")) {
    BATON_RETURN_IF_ERROR(as_bool(*p, "parallel_tool_calls").status());
  }
  r.choice = r.tools_json.empty() ? ToolRequest::Choice::kNone : ToolRequest::Choice::kAuto;
  const Json* choice = member(body, "tool_choice");
  if (choice == nullptr) return r;
  if (choice->is_string()) {
    const std::string c = choice->get<std::string>();
    if (c == "none") {
      r.choice = ToolRequest::Choice::kNone;
    } else if (c == "auto" || c == "required") {
      if (r.tools_json.empty()) return invalid_argument("tool_choice " + quote_input(c) + " needs tools");
      r.choice = c == "auto" ? ToolRequest::Choice::kAuto : ToolRequest::Choice::kRequired;
    } else {
      return invalid_argument("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}, got " + quote_input(c));
    }
    return r;
  }
  if (!choice->is_object()) return wrong_type("tool_choice", "a string or an object", *choice);
  const Json* f = member(*choice, "function");
  const Json* name = f != nullptr && f->is_object() ? member(*f, "name") : nullptr;
  if (name == nullptr || !name->is_string()) return invalid_argument("tool_choice.function.name is missing");
  r.name = name->get<std::string>();
  if (std::find(names.begin(), names.end(), r.name) == names.end()) {
    return invalid_argument("tool_choice names function " + quote_input(r.name) + ", which is not in tools");
  }
  r.choice = ToolRequest::Choice::kNamed;
  return r;
}

Status read_message_tools(const Json& m, const std::string& at, ChatMessage* message) {
  if (const Json* calls = member(m, "tool_calls")) {
    if (message->role != "assistant") return invalid_argument(at + ".tool_calls: only assistant messages make calls");
    if (!calls->is_array()) return wrong_type(at + ".tool_calls", "an array", *calls);
    for (size_t i = 0; i < calls->size(); ++i) {
      const std::string c_at = at + ".tool_calls[" + std::to_string(i) + "]";
      const Json& c = (*calls)[i];
      const Json* f = c.is_object() ? member(c, "function") : nullptr;
      if (f == nullptr || !f->is_object()) return invalid_argument(c_at + ".function must be an object");
      ToolCall call;
      if (const Json* id = member(c, "id")) {
        BATON_ASSIGN_OR_RETURN(call.id, as_string(*id, c_at + ".id"));
      }
      const Json* name = member(*f, "name");
      if (name == nullptr) return invalid_argument(c_at + ".function.name is missing");
      BATON_ASSIGN_OR_RETURN(call.name, as_string(*name, c_at + ".function.name"));
      const Json* args = member(*f, "arguments");
      if (args == nullptr) return invalid_argument(c_at + ".function.arguments is missing");
      BATON_ASSIGN_OR_RETURN(call.arguments, as_string(*args, c_at + ".function.arguments"));
      BATON_RETURN_IF_ERROR(check_json_bounds(call.arguments, c_at + ".function.arguments"));
      Json parsed;
      if (!parse_ordered_json(call.arguments, &parsed) || !parsed.is_object()) {
        return invalid_argument(c_at + ".function.arguments must be a JSON object, as text");
      }
      message->tool_calls.push_back(std::move(call));
    }
  }
  if (const Json* id = member(m, "tool_call_id")) {
    BATON_ASSIGN_OR_RETURN(message->tool_call_id, as_string(*id, at + ".tool_call_id"));
  }
  if (message->role == "tool" && message->tool_call_id.empty()) {
    return invalid_argument(at + ".tool_call_id is missing: a tool message answers a call");
  }
  return {};
}

}  // namespace baton::openai_internal
