// What the OpenAI API's unit tests share: the random test model as the frontend serves it, a
// body parsed as the HTTP API parses it, the error a client would see.
#pragma once

#include <nlohmann/json.hpp>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "model/gguf.h"
#include "model/test_model.h"
#include "server/openai_json.h"

namespace baton::openai_test {

using Json = nlohmann::json;

inline uint32_t test_seed() {
  const char* env = std::getenv("BATON_TEST_SEED");
  const uint32_t seed = env != nullptr ? static_cast<uint32_t>(std::strtoul(env, nullptr, 10)) : std::random_device{}();
  std::printf("openai_json_test seed %u (rerun with BATON_TEST_SEED=%u)\n", seed, seed);
  return seed;
}

// The random test model as the frontend serves it (tokenizer, ChatML template, context 1024).
struct Served {
  Served() {
    auto f = GgufFile::parse(make_test_model({}).to_bytes());
    REQUIRE(f.ok());
    file = std::move(*f);
    auto t = Tokenizer::from_gguf(*file);
    REQUIRE(t.ok());
    tokenizer = std::move(*t);
    auto c = model_config_from_gguf(*file);
    REQUIRE(c.ok());
    model.name = "test-model";
    model.config = *c;
    model.fingerprint = model_fingerprint(*c, *file);
    model.tokenizer = tokenizer.get();
    auto tmpl = chat_template_from_gguf(*file);
    REQUIRE(tmpl.ok());
    model.chat_template = *tmpl;
    model.max_prompt_bytes = max_prompt_bytes(*tokenizer, c->n_ctx);
  }
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Tokenizer> tokenizer;
  ServedModel model;
};

inline const Served& served() {
  static const Served s;
  return s;
}

inline RequestBuilder builder() { return RequestBuilder(served().model, std::nullopt); }

inline Result<OpenAiRequest> parse(OpenAiEndpoint e, const Json& body) {
  return parse_openai_request(e, body.dump(), served().model, builder());
}

// What a prompt's text becomes (the tokenizer's ids, after BOS when the model adds one).
inline std::vector<int32_t> encoded(const std::string& text) {
  const Tokenizer& t = *served().tokenizer;
  auto ids = t.encode(text, /*parse_special=*/true);
  REQUIRE(ids.ok());
  if (t.add_bos()) ids->insert(ids->begin(), t.bos_id());
  return *ids;
}

// The error a client would see for `status`: the JSON object under "error".
inline Json error_of(const Status& status) {
  const Json j = Json::parse(error_body(http_status_of(status.code()), status));
  REQUIRE(j.contains("error"));
  return j["error"];
}

inline std::string random_text(std::mt19937& rng, size_t max_len) {
  static const std::string alphabet = "abcdefghij klmnop.,!?";
  std::string s(1 + rng() % max_len, ' ');
  for (char& c : s) c = alphabet[rng() % alphabet.size()];
  return s;
}


}  // namespace baton::openai_test
