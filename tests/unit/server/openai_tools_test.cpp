// The OpenAI API's response_format and tools (server/openai_request.cpp, server/openai_tools.cpp):
// request bodies read into the validated request, and the shapes calls come back in. The calls'
// grammar and parsing are model/tool_calls.h's (tests/unit/model/tool_calls_test.cpp); the served
// round trip is tests/integration/test_openai_structured_output.py.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cctype>
#include <set>
#include <string>

#include "server/openai_json.h"
#include "tests/unit/server/openai_test_support.h"

namespace baton {
namespace {

using namespace openai_test;

const Json kTools = Json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "description": "Weather",
   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
  {"type": "function", "function": {"name": "now"}}])");

Json chat(Json extra) {
  Json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  for (auto& [k, v] : extra.items()) body[k] = v;
  return body;
}

}  // namespace

TEST_CASE("response_format: json_object, json_schema in its own member order, the subset's refusals", "[openai]") {
  const Json base = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  Json body = base;
  body["response_format"] = {{"type", "json_object"}};
  auto obj = parse(OpenAiEndpoint::kChat, body);
  REQUIRE(obj.ok());
  CHECK(obj->choices.front().pipeline.sampling.format.kind == OutputFormat::Kind::kJsonObject);
  // The schema's text keeps the order the client wrote (properties are generated in it).
  const std::string schema = R"({"type":"object","properties":{"zeta":{"type":"string"},"alpha":{"type":"integer"}}})";
  const std::string with_schema = R"({"prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"t","strict":true,"schema":)" + schema + "}}}";
  auto js = parse_openai_request(OpenAiEndpoint::kCompletions, with_schema, served().model, builder());
  REQUIRE(js.ok());
  CHECK(js->choices.front().pipeline.sampling.format.kind == OutputFormat::Kind::kJsonSchema);
  CHECK(js->choices.front().pipeline.sampling.format.schema == schema);
  for (const auto& [format, says] : std::vector<std::pair<Json, const char*>>{
           {{{"type", "json_schema"}, {"json_schema", {{"name", "t"}, {"schema", {{"type", "string"}, {"pattern", "a+"}}}}}}, "'pattern'"},
           {{{"type", "json_schema"}, {"json_schema", {{"name", "t"}}}}, "schema is missing"},
           {{{"type", "json_schema"}}, "json_schema is missing"},
           {{{"type", "xml"}}, "text, json_object or json_schema"},
           {"json", "must be an object"}}) {
    Json bad = base;
    bad["response_format"] = format;
    INFO(bad.dump());
    const Status st = parse(OpenAiEndpoint::kChat, bad).status();
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(error_of(st)["param"] == "response_format");
    CHECK_THAT(st.message(), Catch::Contains(says));
  }
}

TEST_CASE("tools and tool_choice: which calls are read back and which are forced", "[openai]") {
  auto none = parse(OpenAiEndpoint::kChat, chat({}));
  REQUIRE(none.ok());
  CHECK_FALSE(none->tool_calls);
  auto autos = parse(OpenAiEndpoint::kChat, chat({{"tools", kTools}}));
  REQUIRE(autos.ok());
  CHECK(autos->tool_calls);
  CHECK(autos->choices.front().pipeline.sampling.format.kind == OutputFormat::Kind::kText);
  auto off = parse(OpenAiEndpoint::kChat, chat({{"tools", kTools}, {"tool_choice", "none"}}));
  REQUIRE(off.ok());
  CHECK_FALSE(off->tool_calls);
  // Forced: decoded under the call's grammar, in the template's syntax (ChatML: tagged).
  auto required = parse(OpenAiEndpoint::kChat, chat({{"tools", kTools}, {"tool_choice", "required"}, {"parallel_tool_calls", false}}));
  REQUIRE(required.ok());
  const OutputFormat& f = required->choices.front().pipeline.sampling.format;
  CHECK(f.kind == OutputFormat::Kind::kJsonSchema);
  CHECK(f.prefix == "<tool_call>\n");
  CHECK(f.suffix == "\n</tool_call>");
  CHECK_THAT(f.schema, Catch::Contains("get_weather") && Catch::Contains("now"));
  auto named = parse(OpenAiEndpoint::kChat, chat({{"tools", kTools}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "now"}}}}}}));
  REQUIRE(named.ok());
  CHECK_THAT(named->choices.front().pipeline.sampling.format.schema, !Catch::Contains("get_weather"));
  struct Bad {
    Json extra;
    const char* param;
    const char* says;
  };
  for (const Bad& b : {Bad{{{"tools", kTools}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "x"}}}}}}, "tool_choice", "not in tools"},
                       Bad{{{"tool_choice", "required"}}, "tool_choice", "needs tools"},
                       Bad{{{"tools", kTools}, {"tool_choice", "sometimes"}}, "tool_choice", "none, auto, required"},
                       Bad{{{"tools", {{{"type", "retrieval"}}}}}, "tools", "'function'"},
                       Bad{{{"tools", {{{"type", "function"}, {"function", {{"name", "a b"}}}}}}}, "tools", "letters, digits"},
                       Bad{{{"tools", kTools}, {"parallel_tool_calls", "yes"}}, "parallel_tool_calls", "a boolean"}}) {
    INFO(b.extra.dump());
    const Status st = parse(OpenAiEndpoint::kChat, chat(b.extra)).status();
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(error_of(st)["param"] == b.param);
    CHECK_THAT(st.message(), Catch::Contains(b.says));
  }
}

TEST_CASE("a conversation with calls and their results is read, and refused where it is malformed", "[openai]") {
  const Json call = {{"id", "call_1"}, {"type", "function"},
                     {"function", {{"name", "get_weather"}, {"arguments", R"({"city": "Oslo"})"}}}};
  const Json messages = {{{"role", "user"}, {"content", "weather?"}},
                         {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", {call}}},
                         {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "18 C"}}};
  auto ok = parse(OpenAiEndpoint::kChat, {{"messages", messages}, {"tools", kTools}});
  REQUIRE(ok.ok());
  // ChatML renders each message's role and content: the tool's result is in the prompt.
  const std::string prompt = served().tokenizer->decode(ok->choices.front().pipeline.prompt_ids);
  CHECK_THAT(prompt, Catch::Contains("tool\n18 C"));
  Json no_id = messages;
  no_id[2].erase("tool_call_id");
  Json bad_args = messages;
  bad_args[1]["tool_calls"][0]["function"]["arguments"] = "{not json";
  Json user_calls = messages;
  user_calls[0]["tool_calls"] = {call};
  for (const auto& [body, says] : {std::pair{no_id, "messages[2].tool_call_id is missing"},
                                   std::pair{bad_args, "messages[1].tool_calls[0].function.arguments must be a JSON object"},
                                   std::pair{user_calls, "only assistant messages make calls"}}) {
    const Status st = parse(OpenAiEndpoint::kChat, {{"messages", body}}).status();
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(st.message(), Catch::Contains(says));
    CHECK(error_of(st)["param"] == "messages");
  }
}

TEST_CASE("calls come back in OpenAI's shapes, whole and streamed", "[openai]") {
  std::set<std::string> ids;
  for (int i = 0; i < 100; ++i) {
    const std::string id = tool_call_id(ToolCallSyntax::kTagged);
    CHECK(id.size() == 29);
    CHECK(id.rfind("call_", 0) == 0);
    ids.insert(id);
    // Mistral's templates take back only 9 letters and digits.
    const std::string mistral = tool_call_id(ToolCallSyntax::kMistral);
    CHECK(mistral.size() == 9);
    CHECK(std::all_of(mistral.begin(), mistral.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)); }));
    ids.insert(mistral);
  }
  CHECK(ids.size() == 200);
  const std::vector<ToolCall> calls = {{"call_a", "get_weather", R"({"city":"Oslo"})"}, {"call_b", "now", "{}"}};
  ResponseHeader h{OpenAiEndpoint::kChat, response_id(OpenAiEndpoint::kChat, "r"), 1, "test-model"};
  PipelineOutcome o;
  o.finish_reason = "tool_calls";
  const Json whole = Json::parse(completion_body(h, {ChoiceOut{"", o, nullptr, &calls}}, o));
  const Json& message = whole["choices"][0]["message"];
  CHECK(message["content"].is_null());
  REQUIRE(message["tool_calls"].size() == 2);
  CHECK(message["tool_calls"][0] == Json{{"id", "call_a"}, {"type", "function"},
                                         {"function", {{"name", "get_weather"}, {"arguments", R"({"city":"Oslo"})"}}}});
  CHECK(whole["choices"][0]["finish_reason"] == "tool_calls");
  // Text beside the calls stays the content.
  const Json both = Json::parse(completion_body(h, {ChoiceOut{"Checking.", o, nullptr, &calls}}, o));
  CHECK(both["choices"][0]["message"]["content"] == "Checking.");
  const Json chunk = Json::parse(chunk_body(h, 0, "", false, &o, false, nullptr, &calls));
  const Json& delta = chunk["choices"][0]["delta"];
  REQUIRE(delta["tool_calls"].size() == 2);
  CHECK(delta["tool_calls"][1]["index"] == 1);
  CHECK(delta["tool_calls"][1]["function"]["name"] == "now");
  CHECK_FALSE(delta.contains("content"));
}

}  // namespace baton
