// What real JSON schemas cost structured output, against the bounds that refuse hostile ones
// (grammar/json_schema.h SchemaBudget, common/json_bounds.h, TokenConstraint::kMaxBytes): for each
// schema file, its JSON shape, the compile's depth (subschemas and $refs followed), grammar
// elements and rules and time, and the automaton's memory once the start mask and a walk of 64
// sampled tokens are made against a real vocabulary. Compiled with an unbounded budget, so that
// the numbers say how far each is from the bound, then the defaults' verdict.
//
//   baton_bench_schema [--model GGUF] [--json] FILE...
// Without --model, a vocabulary of the 256 bytes. bench/RESULTS.md "Schema budget" has the run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/json_bounds.h"
#include "grammar/json_schema.h"
#include "grammar/token_constraint.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

using namespace baton;

namespace {

std::shared_ptr<const grammar::TokenVocabulary> vocabulary(const std::string& model_path) {
  std::vector<std::string> bytes;
  std::vector<int32_t> stops;
  if (model_path.empty()) {
    for (int b = 0; b < 256; ++b) bytes.emplace_back(1, static_cast<char>(b));
    bytes.emplace_back();
    stops.push_back(256);
  } else {
    auto f = GgufFile::open(model_path);
    if (!f.ok()) {
      std::fprintf(stderr, "%s\n", f.status().to_string().c_str());
      std::exit(1);
    }
    auto t = Tokenizer::from_gguf(**f);
    if (!t.ok()) {
      std::fprintf(stderr, "%s\n", t.status().to_string().c_str());
      std::exit(1);
    }
    for (int32_t id = 0; id < (*t)->n_vocab(); ++id) {
      const TokenType type = (*t)->type(id);
      bytes.push_back(type == TokenType::kControl || type == TokenType::kUnknown || type == TokenType::kUnused
                          ? std::string()
                          : (*t)->token_bytes(id));
    }
    stops = (*t)->stop_ids();
  }
  return grammar::TokenVocabulary::create(std::move(bytes), std::move(stops));
}

}  // namespace

int main(int argc, char** argv) {
  std::string model;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model" && i + 1 < argc) {
      model = argv[++i];
    } else {
      files.push_back(a);
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "usage: baton_bench_schema [--model GGUF] FILE...\n");
    return 2;
  }
  const auto vocab = vocabulary(model);
  grammar::SchemaBudget unbounded;
  unbounded.max_depth = 1 << 20;
  unbounded.max_elements = int64_t{1} << 40;
  unbounded.max_rules = 1 << 30;
  unbounded.max_seconds = 1e9;
  const grammar::SchemaBudget defaults;
  std::printf("| schema | bytes | JSON depth | widest object | schema depth | elements | rules | compile ms | automaton KiB | defaults |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  grammar::SchemaStats most;
  JsonShape widest;
  size_t most_bytes = 0;
  int n_compiled = 0;
  for (const std::string& path : files) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    const JsonShape shape = json_shape(text, 1 << 20);
    grammar::SchemaStats st;
    auto g = grammar::compile_json_schema(text, {}, {}, unbounded, &st);
    const std::string name = path.substr(path.find_last_of('/') + 1);
    if (!g.ok()) {
      std::printf("| %s | %zu | %d | %lld | - | - | - | - | - | not compiled: %.80s |\n", name.c_str(), text.size(),
                  shape.depth, static_cast<long long>(shape.widest_object), g.status().message().c_str());
      continue;
    }
    ++n_compiled;
    grammar::TokenConstraint c(std::move(g).value(), vocab);
    std::mt19937 rng(1);
    auto state = c.start();
    for (int step = 0; step < 64 && state != grammar::TokenConstraint::kDead; ++step) {
      const uint32_t* mask = c.mask(state);
      std::vector<int32_t> allowed;
      for (int32_t t = 0; t < vocab->n_tokens(); ++t) {
        if ((mask[t / 32] >> (t % 32)) & 1u) allowed.push_back(t);
      }
      if (allowed.empty()) break;
      const int32_t t = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
      if (vocab->is_stop(t)) break;
      state = c.advance(state, t);
    }
    const Status verdict = grammar::compile_json_schema(text, {}, {}, defaults).status();
    std::printf("| %s | %zu | %d | %lld | %d | %lld | %d | %.1f | %zu | %s |\n", name.c_str(), text.size(), shape.depth,
                static_cast<long long>(shape.widest_object), st.depth, static_cast<long long>(st.elements), st.rules,
                st.seconds * 1e3, c.bytes() >> 10, verdict.ok() ? "ok" : verdict.message().substr(0, 60).c_str());
    most.depth = std::max(most.depth, st.depth);
    most.elements = std::max(most.elements, st.elements);
    most.rules = std::max(most.rules, st.rules);
    most.seconds = std::max(most.seconds, st.seconds);
    most_bytes = std::max(most_bytes, c.bytes());
    widest.depth = std::max(widest.depth, shape.depth);
    widest.widest_object = std::max(widest.widest_object, shape.widest_object);
  }
  std::printf("| **largest of %d compiled** | | %d | %lld | %d | %lld | %d | %.1f | %zu | |\n", n_compiled, widest.depth,
              static_cast<long long>(widest.widest_object), most.depth, static_cast<long long>(most.elements), most.rules,
              most.seconds * 1e3, most_bytes >> 10);
  std::printf("| **bound (default)** | | %d | %lld | %d | %lld | %d | %.0f | %zu | |\n", kMaxJsonDepth,
              static_cast<long long>(kMaxJsonObjectMembers), defaults.max_depth, static_cast<long long>(defaults.max_elements),
              defaults.max_rules, defaults.max_seconds * 1e3, grammar::TokenConstraint::kMaxBytes >> 10);
  return 0;
}
