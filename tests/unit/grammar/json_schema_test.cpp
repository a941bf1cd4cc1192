#include "grammar/json_schema.h"

#include <catch2/catch.hpp>
#include <cctype>
#include <random>

#include "grammar/token_constraint.h"
#include "tests/unit/grammar/random_schema.h"

using namespace baton;
using namespace baton::grammar;
using baton::grammar::testing::accepts;
using baton::grammar::testing::byte_vocabulary;
using baton::grammar::testing::ojson;

namespace {

TokenConstraint constraint(std::string_view schema) {
  auto g = compile_json_schema(schema);
  REQUIRE(g.ok());
  return TokenConstraint(std::move(g).value(), byte_vocabulary());
}

}  // namespace

TEST_CASE("repetition rules match their bounds", "[grammar]") {
  for (auto [min, max] : {std::pair{0, 0}, {0, 1}, {2, 4}, {3, -1}, {0, -1}}) {
    GrammarBuilder b;
    const int32_t r = b.repeat("a", b.lit("a"), min, max);
    TokenConstraint c(std::move(b).build(r), byte_vocabulary());
    for (int n = 0; n <= 7; ++n) {
      INFO("{" << min << "," << max << "} on " << n);
      CHECK(accepts(c, std::string(static_cast<size_t>(n), 'a')) == (n >= min && (max < 0 || n <= max)));
    }
    CHECK(c.advance_bytes(c.start(), "b") == TokenConstraint::kDead);
  }
}

TEST_CASE("JSON-schema grammars accept random instances and reject broken ones", "[grammar]") {
  std::mt19937 rng(std::random_device{}());
  for (int round = 0; round < 200; ++round) {
    const ojson schema = testing::random_document_schema(rng, 3);
    INFO(schema.dump());
    TokenConstraint c = constraint(schema.dump());
    for (int i = 0; i < 10; ++i) {
      const std::string text = testing::random_instance(rng, schema, schema);
      INFO(text);
      REQUIRE(testing::validates(schema, schema, ojson::parse(text)));  // the generator's own check
      CHECK(accepts(c, text));
      CHECK(accepts(c, " " + text + "\n"));
      // A document cut short is a prefix, not a whole one; one with a stray byte after it is neither.
      // (A number cut short is another number.)
      if (text.size() > 1 && !std::isdigit(static_cast<unsigned char>(text.back()))) {
        CHECK_FALSE(accepts(c, text.substr(0, text.size() - 1)));
      }
      CHECK(c.advance_bytes(c.start(), text + "x") == TokenConstraint::kDead);
    }
  }
}

TEST_CASE("schema grammars follow the schema's keywords", "[grammar]") {
  TokenConstraint obj = constraint(
      R"({"type":"object","properties":{"name":{"type":"string","maxLength":3},"age":{"type":"integer"},)"
      R"("tags":{"type":"array","items":{"enum":["a","b"]},"minItems":1,"maxItems":2}},"required":["age"],"additionalProperties":false})");
  CHECK(accepts(obj, R"({"name": "abc", "age": 3, "tags": ["a"]})"));
  CHECK(accepts(obj, R"({"age":-12})"));
  CHECK(accepts(obj, "{\n  \"age\": 0,\n  \"tags\": [\"b\", \"a\"]\n}"));
  CHECK_FALSE(accepts(obj, R"({"name":"abcd","age":1})"));          // maxLength
  CHECK_FALSE(accepts(obj, R"({"name":"ab"})"));                    // required
  CHECK_FALSE(accepts(obj, R"({"age":1,"name":"ab"})"));            // schema order
  CHECK_FALSE(accepts(obj, R"({"age":1,"tags":[]})"));              // minItems
  CHECK_FALSE(accepts(obj, R"({"age":1,"tags":["a","a","a"]})"));   // maxItems
  CHECK_FALSE(accepts(obj, R"({"age":1,"tags":["c"]})"));           // enum
  CHECK_FALSE(accepts(obj, R"({"age":1.5})"));                      // integer
  CHECK_FALSE(accepts(obj, R"({"age":01})"));                       // JSON numbers
  CHECK_FALSE(accepts(obj, R"({"age":1,"other":2})"));              // additionalProperties
  CHECK_FALSE(accepts(obj, "{\"age\":1}          \n"));            // blank space has bounded forms
  CHECK(accepts(obj, "{\"age\":1} "));

  TokenConstraint tree = constraint(
      R"({"$ref":"#/$defs/node","$defs":{"node":{"type":"object","properties":{"v":{"type":"number"},)"
      R"("kids":{"type":"array","items":{"$ref":"#/$defs/node"}}},"required":["v","kids"]}}})");
  CHECK(accepts(tree, R"({"v":1,"kids":[{"v":2.5e-3,"kids":[]},{"v":-0,"kids":[{"v":3,"kids":[]}]}]})"));
  CHECK_FALSE(accepts(tree, R"({"v":1,"kids":[{"v":2}]})"));

  TokenConstraint str = constraint(R"({"type":"string","minLength":2,"maxLength":2})");
  CHECK(accepts(str, "\"é\\u00e9\""));   // a multi-byte character and an escape count one each
  CHECK(accepts(str, "\"😀\\\"\""));
  CHECK_FALSE(accepts(str, "\"a\""));
  CHECK(str.advance_bytes(str.start(), "\"\xc3\x28") == TokenConstraint::kDead);  // invalid UTF-8
  CHECK(str.advance_bytes(str.start(), "\"\n") == TokenConstraint::kDead);        // a raw control byte

  TokenConstraint any = TokenConstraint(json_object_grammar(), byte_vocabulary());
  CHECK(accepts(any, R"({"a":[1,{"b":null}],"c":"d","e":true})"));
  CHECK(accepts(any, "{}"));
  CHECK_FALSE(accepts(any, "[1]"));
  CHECK_FALSE(accepts(any, "\"text\""));
}

TEST_CASE("unsupported and malformed schemas are refused naming the keyword", "[grammar]") {
  struct Case {
    const char* schema;
    const char* says;
  };
  for (const Case& c : {Case{R"({"type":"string","pattern":"^a"})", "'pattern'"},
                        Case{R"({"type":"object","properties":{"x":{"type":"integer","minimum":0}}})", "/properties/x"},
                        Case{R"({"oneOf":[{"type":"string"}]})", "'oneOf'"},
                        Case{R"({"allOf":[{"type":"string"}]})", "'allOf'"},
                        Case{R"({"type":"string","format":"date"})", "'format'"},
                        Case{R"({"type":"thing"})", "'thing'"},
                        Case{R"({"$ref":"#/$defs/missing"})", "points to nothing"},
                        Case{R"({"$ref":"https://example.com/s.json"})", "outside the schema"},
                        Case{R"({"type":"object","properties":{"a":{}},"required":["b"]})", "\"b\""},
                        Case{R"({"type":"array","maxItems":100000})", "at most 1024"},
                        Case{R"({"type":"string","minLength":3,"maxLength":2})", "'maxLength' < 'minLength'"},
                        Case{R"({"type":"array","items":[{"type":"string"}]})", "tuple"},
                        Case{R"({"type":"string",)", "not valid JSON"},
                        Case{"false", "no value validates"},
                        Case{R"({"$ref":"#/$defs/a","$defs":{"a":{"anyOf":[{"$ref":"#/$defs/a"}]}}})", "no finite value"}}) {
    INFO(c.schema);
    auto g = compile_json_schema(c.schema);
    REQUIRE_FALSE(g.ok());
    CHECK(g.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(g.status().message(), Catch::Contains(c.says));
  }
}
