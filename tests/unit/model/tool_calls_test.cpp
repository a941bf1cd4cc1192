#include "model/tool_calls.h"

#include <catch2/catch.hpp>
#include <random>

#include "grammar/json_schema.h"
#include "grammar/token_constraint.h"

using namespace baton;

namespace {

const char* kTools = R"([{"type":"function","function":{"name":"get_weather","parameters":{"type":"object",)"
                     R"("properties":{"city":{"type":"string"},"unit":{"enum":["c","f"]}},"required":["city"]}}},)"
                     R"({"type":"function","function":{"name":"now"}}])";

// Whether `text` is a whole sentence of the format's grammar (one token per byte).
bool accepts(const OutputFormat& f, std::string_view text) {
  auto g = grammar::compile_json_schema(f.schema, f.prefix, f.suffix);
  REQUIRE(g.ok());
  std::vector<std::string> bytes;
  for (int b = 0; b < 256; ++b) bytes.emplace_back(1, static_cast<char>(b));
  grammar::TokenConstraint c(std::move(g).value(), grammar::TokenVocabulary::create(std::move(bytes), {}));
  return c.complete(c.advance_bytes(c.start(), text));
}

// Each of `texts` reads back as no call, all of it content.
void check_stays_text(ToolCallSyntax syntax, std::initializer_list<const char*> texts) {
  for (const char* text : texts) {
    INFO(text);
    auto t = parse_tool_calls(syntax, text);
    CHECK(t.calls.empty());
    CHECK(t.content == text);
  }
}

}  // namespace

TEST_CASE("tagged tool calls are read out of the text, the rest is content", "[tools]") {
  auto out = parse_tool_calls(ToolCallSyntax::kTagged,
                              "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n"
                              "</tool_call>\n<tool_call>{\"name\":\"now\",\"arguments\":\"{}\"}</tool_call>");
  REQUIRE(out.calls.size() == 2);
  CHECK(out.calls[0].name == "get_weather");
  CHECK(out.calls[0].arguments == R"({"city":"Oslo"})");
  CHECK(out.calls[1].name == "now");
  CHECK(out.calls[1].arguments == "{}");
  CHECK(out.content == "Let me check.");
  CHECK_FALSE(out.content_null);
  // Only a call: content null. Cut short before its closing tag: still a call when the JSON is whole.
  for (const char* cut : {"", "\n</tool_", "\n\n</tool_c"}) {
    auto only = parse_tool_calls(ToolCallSyntax::kTagged, std::string("<tool_call>\n{\"name\": \"now\", \"arguments\": {}}") + cut);
    REQUIRE(only.calls.size() == 1);
    CHECK(only.content_null);
  }
  // Not a call: broken JSON, or no name, stays text.
  check_stays_text(ToolCallSyntax::kTagged,
                   {"<tool_call>{\"name\": \"now\", \"argu", "<tool_call>{\"arguments\": {}}</tool_call>", "plain"});
}

TEST_CASE("bare JSON tool calls (Llama 3.1) take the whole output", "[tools]") {
  auto call = parse_tool_calls(ToolCallSyntax::kJson, " {\"name\": \"now\", \"parameters\": {\"tz\": \"UTC\"}}");
  REQUIRE(call.calls.size() == 1);
  CHECK(call.calls[0].arguments == R"({"tz":"UTC"})");
  CHECK(parse_tool_calls(ToolCallSyntax::kJson, "It is {noon}.").calls.empty());
}

TEST_CASE("Mistral tool calls: [TOOL_CALLS] and a JSON list of calls", "[tools]") {
  auto two = parse_tool_calls(ToolCallSyntax::kMistral,
                              "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"[Oslo]\"}}, "
                              "{\"name\": \"now\", \"arguments\": {}}]");
  REQUIRE(two.calls.size() == 2);
  CHECK(two.calls[0].name == "get_weather");
  CHECK(two.calls[0].arguments == R"({"city":"[Oslo]"})");  // brackets inside strings do not end the list
  CHECK(two.calls[1].name == "now");
  CHECK(two.content_null);
  // Text before and after the list is content; one object instead of a list is a call too.
  auto around = parse_tool_calls(ToolCallSyntax::kMistral, "Checking.[TOOL_CALLS]{\"name\": \"now\", \"arguments\": {}} ok");
  REQUIRE(around.calls.size() == 1);
  CHECK(around.content == "Checking. ok");
  // Not calls: cut short, an item without a name, broken JSON, no list after the marker.
  check_stays_text(ToolCallSyntax::kMistral,
                   {"[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}}", "[TOOL_CALLS] [{\"arguments\": {}}]",
                    "[TOOL_CALLS] [{\"name\": now}]", "[TOOL_CALLS] sure", "plain [text]"});
  const std::string marker = "[TOOL_CALLS]";
  for (size_t n = 1; n < marker.size(); ++n) {
    INFO(n);
    CHECK(tool_call_free_prefix(ToolCallSyntax::kMistral, "Hi " + marker.substr(0, n)) == 3);
  }
  CHECK(tool_call_free_prefix(ToolCallSyntax::kMistral, "Hi [TOOL_CALLS] [{") == 3);
  CHECK(tool_call_free_prefix(ToolCallSyntax::kMistral, "a [b] c") == 7);
  // A forced call: the marker, a list of one call; what the constraint lets through reads back.
  auto forced = forced_tool_call_format(ToolCallSyntax::kMistral, kTools, "get_weather");
  REQUIRE(forced.ok());
  const std::string sample = "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}]";
  CHECK(accepts(*forced, sample));
  CHECK_FALSE(accepts(*forced, "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}}]"));
  auto back = parse_tool_calls(ToolCallSyntax::kMistral, sample);
  REQUIRE(back.calls.size() == 1);
  CHECK(back.calls[0].arguments == R"({"city":"Oslo"})");
}

TEST_CASE("streamed text is held back only where a call may start", "[tools]") {
  const std::string call = "<tool_call>";
  CHECK(tool_call_free_prefix(ToolCallSyntax::kTagged, "Hello there") == 11);
  for (size_t n = 1; n < call.size(); ++n) {
    INFO(n);
    CHECK(tool_call_free_prefix(ToolCallSyntax::kTagged, "Hi " + call.substr(0, n)) == 3);
  }
  CHECK(tool_call_free_prefix(ToolCallSyntax::kTagged, "Hi <tool_call>{\"na") == 3);
  CHECK(tool_call_free_prefix(ToolCallSyntax::kTagged, "a < b") == 5);
  CHECK(tool_call_free_prefix(ToolCallSyntax::kJson, "  ") == 0);
  CHECK(tool_call_free_prefix(ToolCallSyntax::kJson, " {\"name\"") == 0);
  CHECK(tool_call_free_prefix(ToolCallSyntax::kJson, "Sure") == 4);
}

TEST_CASE("a forced call is constrained to the function's schema, in the template's syntax", "[tools]") {
  auto any = forced_tool_call_format(ToolCallSyntax::kTagged, kTools, "");
  REQUIRE(any.ok());
  CHECK(accepts(*any, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"c\"}}\n</tool_call>"));
  CHECK(accepts(*any, "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>"));
  CHECK_FALSE(accepts(*any, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"unit\": \"c\"}}\n</tool_call>"));
  CHECK_FALSE(accepts(*any, "<tool_call>\n{\"name\": \"other\", \"arguments\": {}}\n</tool_call>"));
  auto named = forced_tool_call_format(ToolCallSyntax::kTagged, kTools, "now");
  REQUIRE(named.ok());
  CHECK_FALSE(accepts(*named, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"x\"}}\n</tool_call>"));
  auto llama = forced_tool_call_format(ToolCallSyntax::kJson, kTools, "get_weather");
  REQUIRE(llama.ok());
  CHECK(accepts(*llama, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}"));
  // Whatever the constraint lets through reads back as the call.
  auto back = parse_tool_calls(ToolCallSyntax::kJson, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}");
  REQUIRE(back.calls.size() == 1);
  CHECK(back.calls[0].name == "get_weather");
  auto unknown = forced_tool_call_format(ToolCallSyntax::kTagged, kTools, "missing");
  CHECK(unknown.status().code() == StatusCode::kInvalidArgument);
  auto bad = forced_tool_call_format(
      ToolCallSyntax::kTagged, R"([{"type":"function","function":{"name":"f","parameters":{"type":"string","pattern":"x"}}}])", "");
  CHECK_THAT(bad.status().message(), Catch::Contains("'pattern'"));
}
