#include "grammar/token_constraint.h"

#include <catch2/catch.hpp>
#include <random>

#include "grammar/json_schema.h"
#include "tests/unit/grammar/random_schema.h"

using namespace baton;
using namespace baton::grammar;
using baton::grammar::testing::ojson;

namespace {

// A vocabulary shaped like a BPE one: every single byte, JSON-ish pieces, random multi-byte
// strings, duplicates, an empty (control) token and two stop tokens.
std::shared_ptr<const TokenVocabulary> random_vocabulary(std::mt19937& rng, std::vector<int32_t>* stops) {
  std::vector<std::string> bytes;
  for (int b = 0; b < 256; ++b) bytes.emplace_back(1, static_cast<char>(b));
  for (const char* piece : {"{\"", "\":", "\": \"", "\",", ", \"", "}", "},", "]}", "[\"", "true", "false", "null",
                            "\n  ", "\n    \"", "  ", "é", "\\u", "\\\"", "00", "12", "-1", ".5", "e+", "\"}"}) {
    bytes.emplace_back(piece);
  }
  const std::string alphabet = "abcp0123{}[]\":, \n.-eE\\u\xc3\xa9";
  for (int i = 0; i < 2000; ++i) {
    std::string t;
    for (size_t n = 2 + rng() % 6; t.size() < n;) t += alphabet[rng() % alphabet.size()];
    bytes.push_back(t);
  }
  bytes.push_back("{\"");  // a duplicate spelling
  bytes.emplace_back();    // a control token
  const auto stop = static_cast<int32_t>(bytes.size());
  bytes.emplace_back();
  bytes.emplace_back();
  *stops = {stop, stop + 1};
  return TokenVocabulary::create(std::move(bytes), *stops);
}

bool allowed(const uint32_t* mask, int32_t id) { return (mask[id / 32] >> (id % 32)) & 1u; }

}  // namespace

TEST_CASE("token masks equal a token-by-token check, and sampled outputs validate", "[grammar]") {
  std::mt19937 rng(std::random_device{}());
  std::vector<int32_t> stops;
  auto vocab = random_vocabulary(rng, &stops);
  int n_complete = 0;
  for (int round = 0; round < 60; ++round) {
    const ojson schema = testing::random_document_schema(rng, 2);
    INFO(schema.dump());
    auto g = compile_json_schema(schema.dump());
    REQUIRE(g.ok());
    TokenConstraint c(std::move(g).value(), vocab);
    TokenConstraint::State s = c.start();
    std::string text;
    for (int step = 0; step < 400; ++step) {
      const uint32_t* mask = c.mask(s);
      // The brute-force reference: each token's bytes run through the automaton one by one.
      std::vector<int32_t> ok;
      for (int32_t id = 0; id < vocab->n_tokens(); ++id) {
        bool expect = vocab->is_stop(id) ? c.complete(s) : !vocab->bytes(id).empty() && c.advance(s, id) != TokenConstraint::kDead;
        REQUIRE(allowed(mask, id) == expect);
        if (expect) ok.push_back(id);
      }
      REQUIRE_FALSE(ok.empty());  // a live state always has a way on
      // Prefer stopping once complete (the sampled documents stay small), else draw uniformly.
      const int32_t id = c.complete(s) && rng() % 3 == 0 ? stops[0] : ok[rng() % ok.size()];
      if (vocab->is_stop(id)) break;
      text += vocab->bytes(id);
      s = c.advance(s, id);
      REQUIRE(s != TokenConstraint::kDead);
    }
    if (!c.complete(s)) continue;  // ran out of steps inside a long string
    ++n_complete;
    INFO(text);
    const ojson value = ojson::parse(text, nullptr, false);
    REQUIRE_FALSE(value.is_discarded());
    CHECK(testing::validates(schema, schema, value));
  }
  CHECK(n_complete >= 30);
}

TEST_CASE("a dead state allows only the stop tokens, and masks are kept per state", "[grammar]") {
  std::mt19937 rng(std::random_device{}());
  std::vector<int32_t> stops;
  auto vocab = random_vocabulary(rng, &stops);
  TokenConstraint c(json_object_grammar(), vocab);
  const uint32_t* dead = c.mask(TokenConstraint::kDead);
  for (int32_t id = 0; id < vocab->n_tokens(); ++id) CHECK(allowed(dead, id) == vocab->is_stop(id));
  // Inside a string every state after a plain character is the same: one mask serves them all.
  TokenConstraint::State s = c.advance_bytes(c.start(), "{\"key");
  const uint32_t* first = c.mask(s);
  const int n_masks = c.n_masks();
  s = c.advance_bytes(s, "more");
  CHECK(c.mask(s) == first);
  CHECK(c.n_masks() == n_masks);
  CHECK_FALSE(allowed(first, stops[0]));
  s = c.advance_bytes(s, "\": 1}");
  CHECK(allowed(c.mask(s), stops[0]));
  CHECK(c.advance(s, stops[1]) == s);
}
