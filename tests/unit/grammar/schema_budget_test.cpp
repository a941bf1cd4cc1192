// Hostile schemas and grammars: every bound refuses with a status (never an abort), within its
// budget of time and memory, and what stays under the bounds still compiles to the same language.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "common/json_bounds.h"
#include "common/json_parse.h"
#include "grammar/json_schema.h"
#include "grammar/token_constraint.h"
#include "tests/unit/grammar/random_schema.h"

using namespace baton;
using namespace baton::grammar;
using baton::grammar::testing::accepts;
using baton::grammar::testing::byte_vocabulary;

namespace {

std::string repeat(std::string_view s, size_t n) {
  std::string out;
  out.reserve(s.size() * n);
  for (size_t i = 0; i < n; ++i) out += s;
  return out;
}

// The depth of a parsed value, by an explicit stack: the reference json_shape is checked against
// (nlohmann parses any depth without recursion).
int parsed_depth(const nlohmann::json& root) {
  int deepest = 0;
  std::vector<std::pair<const nlohmann::json*, int>> todo{{&root, 0}};
  while (!todo.empty()) {
    const auto [j, d] = todo.back();
    todo.pop_back();
    if (!j->is_structured()) continue;
    deepest = std::max(deepest, d + 1);
    for (const auto& x : *j) todo.emplace_back(&x, d + 1);
  }
  return deepest;
}

int64_t widest_object(const nlohmann::json& root) {
  int64_t widest = 0;
  std::vector<const nlohmann::json*> todo{&root};
  while (!todo.empty()) {
    const nlohmann::json* j = todo.back();
    todo.pop_back();
    if (j->is_object()) widest = std::max<int64_t>(widest, static_cast<int64_t>(j->size()));
    if (j->is_structured()) {
      for (const auto& x : *j) todo.push_back(&x);
    }
  }
  return widest;
}

// A random JSON text: nested arrays and objects, strings holding brackets, quotes and escapes.
std::string random_json(std::mt19937& rng, int max_depth) {
  std::string out;
  std::vector<char> open;  // the closers owed
  std::uniform_int_distribution<int> pick(0, 9);
  const char* strings[] = {R"("[")", R"("{\"")", R"("\\")", R"("]}]}")", R"("a\"[b")", R"("\u005b")"};
  auto scalar = [&]() -> std::string {
    switch (pick(rng) % 4) {
      case 0: return strings[static_cast<size_t>(pick(rng)) % 6];
      case 1: return std::to_string(pick(rng));
      case 2: return "null";
      default: return "true";
    }
  };
  bool need_value = true;
  for (int steps = 0; steps < 400; ++steps) {
    const bool in_object = !open.empty() && open.back() == '}';
    if (need_value) {
      if (in_object) out += "\"[{\\\"k" + std::to_string(out.size()) + "\":";  // unique, with brackets
      if (static_cast<int>(open.size()) < max_depth && pick(rng) < 4) {
        const bool obj = pick(rng) < 5;
        out += obj ? '{' : '[';
        open.push_back(obj ? '}' : ']');
        continue;
      }
      out += scalar();
      need_value = false;
      continue;
    }
    if (open.empty()) break;
    if (pick(rng) < 5) {
      out += ',';
      need_value = true;
    } else {
      out += open.back();
      open.pop_back();
    }
  }
  if (need_value) {  // the step limit came where a value is owed (in an object: a member)
    if (!open.empty() && open.back() == '}') out += "\"last\":";
    out += "0";
  }
  while (!open.empty()) {
    out += open.back();
    open.pop_back();
  }
  return out;
}

}  // namespace

TEST_CASE("json_shape agrees with a parse, skipping strings", "[grammar][limits]") {
  std::mt19937 rng(std::random_device{}());
  int checked = 0;
  for (int round = 0; round < 300; ++round) {
    const std::string text = random_json(rng, 1 + round % 40);
    const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    INFO(text);
    REQUIRE_FALSE(j.is_discarded());
    CHECK(json_shape(text, 1000).depth == parsed_depth(j));
    CHECK(json_shape(text, 1000).widest_object == widest_object(j));
    ++checked;
  }
  CHECK(checked == 300);
  // Counting stops past the limit, whatever follows.
  const std::string deep = repeat("[", 1'000'000) + repeat("]", 1'000'000);
  CHECK(json_shape(deep, 32).depth == 33);
  CHECK(json_shape(deep, 2'000'000).depth == 1'000'000);
  CHECK(check_json_bounds(deep, "x").code() == StatusCode::kInvalidArgument);
  CHECK_THAT(check_json_bounds(deep, "messages[1].tool_calls[0].function.arguments").message(),
             Catch::Contains("arguments") && Catch::Contains(std::to_string(kMaxJsonDepth)));
  CHECK(check_json_bounds(repeat("[", kMaxJsonDepth) + repeat("]", kMaxJsonDepth), "x").ok());
  CHECK(json_shape(R"(["[[[", "\"[[", {"a": "}}}"}])").depth == 2);
  // An object of more members than the bound (ordered_json would parse it in quadratic time).
  std::string wide = "{\"x\":{";
  for (int i = 0; i <= kMaxJsonObjectMembers; ++i) wide += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":\"a:b\"";
  wide += "}}";
  CHECK(json_shape(wide).widest_object == kMaxJsonObjectMembers + 1);
  CHECK_THAT(check_json_bounds(wide, "the body").message(), Catch::Contains("members"));
}

TEST_CASE("parse_ordered_json equals nlohmann's ordered parse", "[grammar][limits]") {
  std::mt19937 rng(std::random_device{}());
  for (int round = 0; round < 300; ++round) {
    std::string text = random_json(rng, 1 + round % 20);
    // Duplicate keys now and then: the last one wins in both.
    if (round % 3 == 0 && text.front() == '{' && text.size() > 2) text = "{\"d\":1,\"d\":[2]," + text.substr(1);
    INFO(text);
    nlohmann::ordered_json ours;
    REQUIRE(parse_ordered_json(text, &ours));
    const auto theirs = nlohmann::ordered_json::parse(text);
    CHECK(ours == theirs);
    CHECK(ours.dump() == theirs.dump());  // member order too
  }
  std::string error;
  nlohmann::ordered_json j;
  CHECK_FALSE(parse_ordered_json(R"({"a": [1, 2)", &j, &error));
  CHECK_THAT(error, Catch::Contains("parse error"));
  // 10,000 members (the bound) of one object: nlohmann's ordered parse is quadratic in them.
  std::string wide = "{";
  for (int i = 0; i < kMaxJsonObjectMembers; ++i) wide += (i ? ",\"p" : "\"p") + std::to_string(i) + "\":{\"type\":\"string\"}";
  wide += "}";
  REQUIRE(parse_ordered_json(wide, &j));  // (its time: bench/RESULTS.md, "Hostile input")
  CHECK(j.size() == static_cast<size_t>(kMaxJsonObjectMembers));
  CHECK(j.begin().key() == "p0");
}

TEST_CASE("hostile schemas are refused with a status naming the bound", "[grammar][limits]") {
  struct Case {
    std::string name, schema, says;
  };
  const int n = 4500;
  std::string chain = R"({"$ref":"#/$defs/d0","$defs":{)";
  for (int i = 0; i < n; ++i) chain += "\"d" + std::to_string(i) + "\":{\"$ref\":\"#/$defs/d" + std::to_string(i + 1) + "\"},";
  chain += "\"d" + std::to_string(n) + "\":{\"type\":\"string\"}}}";
  std::string big_enum = R"({"enum":[)";
  for (int i = 0; i < 300'000; ++i) big_enum += (i ? ",\"" : "\"") + std::to_string(int64_t{i} * 7919) + "\"";
  big_enum += "]}";
  std::string lengths = R"({"type":"object","properties":{)";
  for (int i = 0; i < 400; ++i) {
    lengths += (i ? ",\"p" : "\"p") + std::to_string(i) + "\":{\"type\":\"string\",\"minLength\":" + std::to_string(i) +
               ",\"maxLength\":1024}";
  }
  lengths += "}}";
  std::string wide = R"({"type":"object","properties":{)";
  for (int i = 0; i < 20'000; ++i) wide += (i ? ",\"p" : "\"p") + std::to_string(i) + "\":{\"type\":\"string\"}";
  wide += "}}";
  const Case cases[] = {
      {"20,000 optional properties", wide, "members"},
      {"a $ref chain 4,500 deep", chain, "deeper than 256"},
      {"items nested 200,000 deep", repeat(R"({"items":)", 200'000) + "{}" + repeat("}", 200'000), "nests deeper"},
      {"a const nested 200,000 deep", R"({"const":)" + repeat("[", 200'000) + repeat("]", 200'000) + "}", "nests deeper"},
      {"an enum of 300,000 values", big_enum, "elements"},
      {"400 distinct counted repeats", lengths, "rules"},
      // The client's names in a refusal are cut: a status travels in 16 KiB of metadata.
      {"a 100,000-byte property name in an error's path", R"({"properties":{")" + std::string(100'000, 'n') +
                                                              R"(":{"type":"thing"}}})", "-byte path"},
      {"a 100,000-byte unknown keyword", R"({")" + std::string(100'000, 'k') + R"(":1})", "(cut, 100000 bytes)"},
      {"a 100,000-byte $ref", R"({"$ref":"#/)" + std::string(100'000, 'r') + R"("})", "points to nothing"},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    auto g = compile_json_schema(c.schema);
    REQUIRE_FALSE(g.ok());
    CHECK(g.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(g.status().message(), Catch::Contains(c.says));
    CHECK(g.status().message().size() < 400);
  }
  // A budget of the caller's: the same schema within and past it.
  SchemaBudget tight;
  tight.max_depth = 3;
  CHECK(compile_json_schema(R"({"items":{"items":{"items":{}}}})", {}, {}, tight).ok());
  CHECK_FALSE(compile_json_schema(R"({"items":{"items":{"items":{"items":{}}}}})", {}, {}, tight).ok());
  tight.max_seconds = 0;
  CHECK_THAT(compile_json_schema(R"({"type":"string"})", {}, {}, tight).status().message(),
             Catch::Contains("compile time"));
}

TEST_CASE("many optional properties compile to a linear grammar with the same language", "[grammar][limits]") {
  std::mt19937 rng(std::random_device{}());
  // 9,000 optional properties, under the members bound (the quadratic encoding made 40 million
  // alternatives of them).
  std::string schema = R"({"type":"object","properties":{)";
  const int n = 9'000;
  for (int i = 0; i < n; ++i) schema += (i ? ",\"p" : "\"p") + std::to_string(i) + "\":{\"type\":\"integer\"}";
  schema += "}}";
  auto g = compile_json_schema(schema);
  REQUIRE(g.ok());
  CHECK(g->elements.size() < 40u * n);
  TokenConstraint c(std::move(g).value(), byte_vocabulary());
  // Random subsets in schema order are accepted; a pair out of order, or twice, is not.
  for (int round = 0; round < 20; ++round) {
    std::string doc = "{";
    int last = -1;
    std::vector<int> picked;
    for (int i = 0; i < n; ++i) {
      if (std::uniform_int_distribution<int>(0, 999)(rng) < 2) picked.push_back(i);
    }
    for (int i : picked) {
      doc += (doc.size() > 1 ? "," : "") + std::string("\"p") + std::to_string(i) + "\":" + std::to_string(i);
      last = i;
    }
    INFO(doc);
    CHECK(accepts(c, doc + "}"));
    if (last >= 0) {
      CHECK_FALSE(accepts(c, doc + ",\"p" + std::to_string(last) + "\":1}"));
      if (picked.size() >= 2) CHECK_FALSE(accepts(c, "{\"p" + std::to_string(last) + "\":1,\"p" + std::to_string(picked[0]) + "\":1}"));
    }
  }
  CHECK_FALSE(c.exhausted());

  // Required properties among optional ones: a required one may not be skipped.
  auto r = compile_json_schema(
      R"({"type":"object","properties":{"a":{"type":"null"},"b":{"type":"null"},"c":{"type":"null"},"d":{"type":"null"}},"required":["b","d"]})");
  REQUIRE(r.ok());
  TokenConstraint req(std::move(r).value(), byte_vocabulary());
  for (const char* ok : {R"({"b":null,"d":null})", R"({"a":null,"b":null,"c":null,"d":null})", R"({"b":null,"c":null,"d":null})"}) {
    CHECK(accepts(req, ok));
  }
  for (const char* bad : {R"({"d":null})", R"({"b":null})", R"({"a":null,"d":null})", R"({})", R"({,"b":null,"d":null})"}) {
    CHECK_FALSE(accepts(req, bad));
  }
}

TEST_CASE("left-recursive and cyclic grammars end in a dead state, never an abort", "[grammar][limits]") {
  // r ::= r "a" | "b": left recursion, which the builder's helpers never make but a hand-made
  // grammar can. Expanding it makes stack nodes without end: the memory budget stops it.
  GrammarBuilder b;
  const int32_t r = b.declare("r");
  b.add_alt(r, {b.ref(r), b.byte('a')});
  b.add_alt(r, b.lit("b"));
  TokenConstraint left(std::move(b).build(r), byte_vocabulary());
  CHECK(left.start() == TokenConstraint::kDead);
  CHECK(left.exhausted());
  // Schemas that refer to themselves before any byte: refused, or compiled to what they mean.
  auto cyc = compile_json_schema(R"({"anyOf":[{"$ref":"#"},{"type":"null"}]})");
  REQUIRE(cyc.ok());
  TokenConstraint c(std::move(cyc).value(), byte_vocabulary());
  CHECK(accepts(c, "null"));
  CHECK_FALSE(accepts(c, "nul"));
  CHECK_FALSE(compile_json_schema(R"({"$ref":"#"})").ok());
  // A chain of 100 $refs (well inside the depth bound) works as its target.
  std::string chain = R"({"$ref":"#/$defs/d0","$defs":{)";
  for (int i = 0; i < 100; ++i) chain += "\"d" + std::to_string(i) + "\":{\"$ref\":\"#/$defs/d" + std::to_string(i + 1) + "\"},";
  chain += R"("d100":{"type":"boolean"}}})";
  auto g = compile_json_schema(chain);
  REQUIRE(g.ok());
  TokenConstraint ch(std::move(g).value(), byte_vocabulary());
  CHECK(accepts(ch, "true"));
  CHECK_FALSE(accepts(ch, "1"));
}

TEST_CASE("output nested past the automaton's memory ends the output, bounded", "[grammar][limits]") {
  // json_object's automaton gains states with every level of nesting; a sequence nesting without
  // end reaches the budget and is dead there instead of growing the process.
  TokenConstraint any(json_object_grammar(), byte_vocabulary());
  TokenConstraint::State s = any.advance_bytes(any.start(), "{\"a\":");
  int levels = 0;
  while (s != TokenConstraint::kDead && levels < 2'000'000) {
    s = any.advance_bytes(s, "[");
    ++levels;
  }
  CHECK(s == TokenConstraint::kDead);
  CHECK(any.exhausted());
  CHECK(any.n_states() <= TokenConstraint::kMaxStates);
  INFO("levels " << levels);
  CHECK(levels > 1000);  // real output never comes near
}
