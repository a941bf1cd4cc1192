// The OpenAI-compatible API's JSON (server/openai_json.h): request bodies → the validated
// request (read into a RequestBuilder, as the HTTP API does), response objects and errors → JSON, parsed
// back here with nlohmann-json and compared field by field. Values are random, fresh each run
// (BATON_TEST_SEED replays one). The HTTP server itself runs in tests/integration/test_openai_api.py.
#include <nlohmann/json.hpp>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <set>
#include <string>
#include <tuple>

#include "server/openai_json.h"
#include "tests/unit/server/openai_test_support.h"

namespace baton {
namespace {

using namespace openai_test;

}  // namespace

TEST_CASE("a completions body becomes the request it asks for", "[openai]") {
  std::mt19937 rng(test_seed());
  for (int round = 0; round < 50; ++round) {
    const std::string prompt = random_text(rng, 40);
    const int max_tokens = 1 + static_cast<int>(rng() % 500);
    const double temperature = std::uniform_real_distribution<double>(0, 2)(rng);
    const double top_p = std::uniform_real_distribution<double>(0.01, 1)(rng);
    const int top_k = static_cast<int>(rng() % 100);
    const uint64_t seed = (static_cast<uint64_t>(rng()) << 32) | rng();
    std::vector<std::string> stop;
    for (int i = 0, n = static_cast<int>(rng() % 4); i < n; ++i) stop.push_back(random_text(rng, 6));
    Json body = {{"model", "test-model"}, {"prompt", prompt},   {"max_tokens", max_tokens},
                 {"temperature", temperature}, {"top_p", top_p}, {"top_k", top_k},
                 {"seed", seed},           {"stream", round % 2 == 0}, {"user", "someone"}};
    if (stop.size() == 1 && round % 3 == 0) {
      body["stop"] = stop[0];  // a single string
    } else {
      body["stop"] = stop;
    }
    if (round % 4 == 0) body["stream_options"] = {{"include_usage", true}};
    auto r = parse(OpenAiEndpoint::kCompletions, body);
    REQUIRE(r.ok());
    const PipelineRequest& g = r->choices.front().pipeline;
    CHECK(g.prompt_ids == encoded(prompt));
    CHECK(g.max_tokens == max_tokens);
    CHECK(g.sampling.temperature == static_cast<float>(temperature));
    CHECK(g.sampling.top_p == static_cast<float>(top_p));
    CHECK(g.sampling.top_k == top_k);
    CHECK(g.sampling.seed == seed);
    CHECK(r->choices.front().stop == stop);
    CHECK(r->stream == (round % 2 == 0));
    CHECK(r->include_usage == (round % 4 == 0));
    CHECK(g.model_fingerprint == served().model.fingerprint);
    CHECK_THAT(g.label, Catch::StartsWith("req-"));  // made up: the body names no request
  }
}

TEST_CASE("OpenAI's defaults: 16 tokens for completions, the rest of the context for chat, temperature 1, a random seed",
          "[openai]") {
  auto c = parse(OpenAiEndpoint::kCompletions, {{"prompt", "hi"}});
  REQUIRE(c.ok());
  CHECK(c->choices.front().pipeline.max_tokens == 16);
  CHECK(c->choices.front().pipeline.sampling.temperature == 1.0f);
  CHECK(c->choices.front().pipeline.sampling.top_p == 1.0f);
  CHECK_FALSE(c->stream);
  // 64 random bits each time: two requests without a seed draw different text.
  auto again = parse(OpenAiEndpoint::kCompletions, {{"prompt", "hi"}});
  REQUIRE(again.ok());
  CHECK(again->choices.front().pipeline.sampling.seed != c->choices.front().pipeline.sampling.seed);

  const Json chat_body = {{"messages", {{{"role", "user"}, {"content", "hello there"}}}}};
  auto chat = parse(OpenAiEndpoint::kChat, chat_body);
  REQUIRE(chat.ok());
  const PipelineRequest& pr = chat->choices.front().pipeline;
  CHECK(pr.max_tokens + static_cast<int64_t>(pr.prompt_ids.size()) == served().model.config.n_ctx);
  // Sent explicitly, 0 is the client's mistake, not the default.
  Json zero = chat_body;
  zero["max_tokens"] = 0;
  const Status z = parse(OpenAiEndpoint::kChat, zero).status();
  CHECK(z.code() == StatusCode::kInvalidArgument);
  CHECK(error_of(z)["param"] == "max_tokens");
  // max_completion_tokens is chat's newer name for it.
  Json newer = chat_body;
  newer["max_completion_tokens"] = 7;
  auto n = parse(OpenAiEndpoint::kChat, newer);
  REQUIRE(n.ok());
  CHECK(n->choices.front().pipeline.max_tokens == 7);
  newer["max_tokens"] = 8;
  CHECK(parse(OpenAiEndpoint::kChat, newer).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("every prompt form OpenAI allows, one prompt or several", "[openai]") {
  std::mt19937 rng(test_seed());
  std::vector<int32_t> ids;
  for (int i = 0, n = 1 + static_cast<int>(rng() % 30); i < n; ++i) ids.push_back(static_cast<int32_t>(rng() % 275));
  for (const Json& prompt : {Json(ids), Json::array({Json(ids)})}) {
    auto r = parse(OpenAiEndpoint::kCompletions, {{"prompt", prompt}});
    REQUIRE(r.ok());
    CHECK(r->choices.front().pipeline.prompt_ids == ids);
  }
  auto one = parse(OpenAiEndpoint::kCompletions, {{"prompt", {"just one"}}});
  REQUIRE(one.ok());
  CHECK(one->choices.front().pipeline.prompt_ids == encoded("just one"));
  auto several = parse(OpenAiEndpoint::kCompletions, {{"prompt", Json::array({Json("a b"), Json(ids)})}});
  REQUIRE(several.ok());
  REQUIRE(several->choices.size() == 2);
  CHECK(several->choices[0].pipeline.prompt_ids == encoded("a b"));
  CHECK(several->choices[1].pipeline.prompt_ids == ids);
  // An id outside the vocabulary: validation names it, in OpenAI's name for the field.
  ids.push_back(275 + static_cast<int32_t>(rng() % 1000));
  const Status st = parse(OpenAiEndpoint::kCompletions, {{"prompt", ids}}).status();
  REQUIRE(st.code() == StatusCode::kInvalidArgument);
  const Json e = error_of(st);
  CHECK(e["param"] == "prompt");
  CHECK_THAT(e["message"].get<std::string>(), Catch::StartsWith("prompt[" + std::to_string(ids.size() - 1) + "]"));
  Json huge = ids;
  huge.back() = int64_t{1} << 40;  // not even an int32
  const Status not_int32 = parse(OpenAiEndpoint::kCompletions, {{"prompt", huge}}).status();
  CHECK(not_int32.code() == StatusCode::kInvalidArgument);
  CHECK(error_of(not_int32)["param"] == "prompt");
}

TEST_CASE("chat messages: text content in any of OpenAI's forms, other parts are refused by name", "[openai]") {
  std::mt19937 rng(test_seed());
  const std::string a = random_text(rng, 30), b = random_text(rng, 30), sys = random_text(rng, 30);
  const Json messages = {{{"role", "developer"}, {"content", sys}},
                         {{"role", "user"}, {"content", {{{"type", "text"}, {"text", a}}, {{"type", "text"}, {"text", b}}}}},
                         {{"role", "assistant"}, {"content", nullptr}}};
  auto r = parse(OpenAiEndpoint::kChat, {{"messages", messages}, {"name", "ignored"}});
  REQUIRE(r.ok());
  // The prompt is these messages, rendered by the model's template and tokenised.
  const std::vector<ChatMessage> expected = {{"system", sys}, {"user", a + b}, {"assistant", ""}};
  auto text = served().model.chat_template->render(expected, /*add_generation_prompt=*/true);
  REQUIRE(text.ok());
  auto ids = served().tokenizer->encode(*text, /*parse_special=*/true);
  REQUIRE(ids.ok());
  CHECK(r->choices.front().pipeline.prompt_ids == *ids);

  const Json image = {{{"role", "user"},
                       {"content", {{{"type", "text"}, {"text", a}}, {{"type", "image_url"}, {"image_url", "x"}}}}}};
  const Status st = parse(OpenAiEndpoint::kChat, {{"messages", image}}).status();
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(st.message(), Catch::StartsWith("messages[0].content[1].type"));
  CHECK(error_of(st)["param"] == "messages");
  // A role the template does not know: validation refuses it, naming the message.
  CHECK_THAT(parse(OpenAiEndpoint::kChat, {{"messages", {{{"role", "function"}, {"content", "x"}}}}}).status().message(),
             Catch::StartsWith("messages[0].role"));
  CHECK(parse(OpenAiEndpoint::kChat, {{"messages", Json::array()}}).status().code() == StatusCode::kInvalidArgument);
  CHECK(parse(OpenAiEndpoint::kChat, {{"prompt", "no messages"}}).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("a field of the wrong JSON type is named, in the message and as the error's param", "[openai]") {
  struct Case {
    OpenAiEndpoint endpoint;
    const char* field;
    Json value;
  };
  const Json msgs = {{{"role", "user"}, {"content", "hi"}}};
  const std::vector<Case> cases = {
      {OpenAiEndpoint::kCompletions, "prompt", 5},
      {OpenAiEndpoint::kCompletions, "prompt", {{"text", "x"}}},
      {OpenAiEndpoint::kCompletions, "max_tokens", "16"},
      {OpenAiEndpoint::kCompletions, "max_tokens", 16.5},
      {OpenAiEndpoint::kCompletions, "temperature", "hot"},
      {OpenAiEndpoint::kCompletions, "top_p", true},
      {OpenAiEndpoint::kCompletions, "top_k", 2.5},
      {OpenAiEndpoint::kCompletions, "seed", "42"},
      {OpenAiEndpoint::kCompletions, "stop", 3},
      {OpenAiEndpoint::kCompletions, "stop", {"ok", 3}},
      {OpenAiEndpoint::kCompletions, "stream", "yes"},
      {OpenAiEndpoint::kCompletions, "stream_options", "usage"},
      {OpenAiEndpoint::kCompletions, "model", 7},
      {OpenAiEndpoint::kCompletions, "priority", "high"},
      {OpenAiEndpoint::kCompletions, "ignore_eos", 1},
      {OpenAiEndpoint::kChat, "messages", "hi"},
      {OpenAiEndpoint::kChat, "messages", {"hi"}},
      {OpenAiEndpoint::kChat, "messages", {{{"role", 1}, {"content", "hi"}}}},
      {OpenAiEndpoint::kChat, "messages", {{{"role", "user"}, {"content", 5}}}},
      {OpenAiEndpoint::kChat, "max_completion_tokens", "3"},
  };
  for (const Case& c : cases) {
    Json body = c.endpoint == OpenAiEndpoint::kChat ? Json{{"messages", msgs}} : Json{{"prompt", "hi"}};
    body[c.field] = c.value;
    INFO(body.dump());
    const Status st = parse(c.endpoint, body).status();
    REQUIRE(st.code() == StatusCode::kInvalidArgument);
    const Json e = error_of(st);
    CHECK(e["param"] == c.field);
    CHECK(e["type"] == "invalid_request_error");
    CHECK_THAT(e["message"].get<std::string>(), Catch::Contains("must be"));
  }
  // null is "not set", as in OpenAI's API.
  CHECK(parse(OpenAiEndpoint::kCompletions, {{"prompt", "hi"}, {"temperature", nullptr}, {"stop", nullptr}}).ok());
}

TEST_CASE("features baton does not have are refused by name unless off", "[openai]") {
  const Json base = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  const std::vector<std::pair<const char*, Json>> refused = {
      {"best_of", 2}, {"logit_bias", {{"50256", -100}}}, {"functions", {{{"name", "f"}}}}};
  for (const auto& [field, value] : refused) {
    Json body = base;
    body[field] = value;
    const Status st = parse(OpenAiEndpoint::kChat, body).status();
    INFO(body.dump());
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(error_of(st)["param"] == field);
    CHECK_THAT(st.message(), Catch::Contains("not supported"));
  }
  const std::vector<std::pair<const char*, Json>> off = {
      {"n", 1}, {"logprobs", false}, {"presence_penalty", 0}, {"frequency_penalty", 0.0}, {"logit_bias", Json::object()},
      {"tools", Json::array()}, {"response_format", {{"type", "text"}}}};
  for (const auto& [field, value] : off) {
    Json body = base;
    body[field] = value;
    INFO(body.dump());
    CHECK(parse(OpenAiEndpoint::kChat, body).ok());
  }
  CHECK(parse(OpenAiEndpoint::kCompletions, {{"prompt", "x"}, {"echo", true}}).status().code() ==
        StatusCode::kInvalidArgument);
  CHECK(parse(OpenAiEndpoint::kCompletions, {{"prompt", "x"}, {"best_of", 3}}).status().code() ==
        StatusCode::kInvalidArgument);
  CHECK(parse(OpenAiEndpoint::kCompletions, {{"prompt", "x"}, {"suffix", "end"}}).status().code() ==
        StatusCode::kInvalidArgument);
}

TEST_CASE("logprobs and the penalties reach the sampling parameters, and out of range is refused by name", "[openai]") {
  std::mt19937 rng(test_seed());
  const Json chat = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  const Json completion = {{"prompt", "hi"}};
  auto sampling = [](OpenAiEndpoint e, const Json& body) {
    auto r = parse(e, body);
    REQUIRE(r.ok());
    return r->choices.front().pipeline.sampling;
  };
  // Unset: no log-probabilities, no penalties.
  CHECK(sampling(OpenAiEndpoint::kChat, chat).top_logprobs == -1);
  CHECK(sampling(OpenAiEndpoint::kCompletions, completion).top_logprobs == -1);
  CHECK(sampling(OpenAiEndpoint::kCompletions, completion).repetition_penalty == 1.0f);
  // Chat: logprobs true alone is 0 alternatives; with top_logprobs k, k.
  const int k = std::uniform_int_distribution<int>(0, 20)(rng);
  Json c = chat;
  c["logprobs"] = true;
  CHECK(sampling(OpenAiEndpoint::kChat, c).top_logprobs == 0);
  c["top_logprobs"] = k;
  CHECK(sampling(OpenAiEndpoint::kChat, c).top_logprobs == k);
  c["logprobs"] = false;
  CHECK(parse(OpenAiEndpoint::kChat, c).status().code() == StatusCode::kInvalidArgument);  // top_logprobs needs logprobs
  // Completions: logprobs k in [0, 5].
  const int k5 = std::uniform_int_distribution<int>(0, 5)(rng);
  Json p = completion;
  p["logprobs"] = k5;
  CHECK(sampling(OpenAiEndpoint::kCompletions, p).top_logprobs == k5);
  // Penalties, drawn in range, arrive as sent.
  std::uniform_real_distribution<float> pen(-2.0f, 2.0f), rep(0.5f, 3.0f);
  const float pp = pen(rng), fp = pen(rng), rp = rep(rng);
  Json q = completion;
  q["presence_penalty"] = pp;
  q["frequency_penalty"] = fp;
  q["repetition_penalty"] = rp;
  const SamplingParams s = sampling(OpenAiEndpoint::kCompletions, q);
  CHECK(s.presence_penalty == pp);
  CHECK(s.frequency_penalty == fp);
  CHECK(s.repetition_penalty == rp);
  // Out of range: 400 naming the field.
  const std::vector<std::tuple<OpenAiEndpoint, const char*, Json>> bad = {
      {OpenAiEndpoint::kCompletions, "logprobs", 6},         {OpenAiEndpoint::kCompletions, "logprobs", -1},
      {OpenAiEndpoint::kChat, "top_logprobs", 21},           {OpenAiEndpoint::kChat, "logprobs", 3},
      {OpenAiEndpoint::kChat, "presence_penalty", 2.5},      {OpenAiEndpoint::kCompletions, "frequency_penalty", -2.01},
      {OpenAiEndpoint::kCompletions, "repetition_penalty", 0}, {OpenAiEndpoint::kChat, "repetition_penalty", "high"}};
  for (const auto& [endpoint, field, value] : bad) {
    Json body = endpoint == OpenAiEndpoint::kChat ? chat : completion;
    body[field] = value;
    if (std::string(field) == "top_logprobs") body["logprobs"] = true;
    INFO(body.dump());
    const Status st = parse(endpoint, body).status();
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(error_of(st)["param"] == field);
  }
}

TEST_CASE("a prompt list and n make a choice each, in OpenAI's order, with seeds derived per choice", "[openai]") {
  std::mt19937 rng(test_seed());
  const int n_prompts = 1 + static_cast<int>(rng() % 4), n = 1 + static_cast<int>(rng() % 4);
  Json prompts = Json::array();
  for (int i = 0; i < n_prompts; ++i) prompts.push_back(i % 2 == 0 ? Json(random_text(rng, 5)) : Json({5 + i, 6, 7}));
  const uint64_t seed = rng();
  auto r = parse(OpenAiEndpoint::kCompletions, {{"prompt", prompts}, {"n", n}, {"seed", seed}, {"max_tokens", 3}});
  REQUIRE(r.ok());
  REQUIRE(r->choices.size() == static_cast<size_t>(n_prompts * n));
  CHECK(r->n == n);
  std::set<uint64_t> seeds;
  for (int i = 0; i < n_prompts; ++i) {
    for (int j = 0; j < n; ++j) {
      const PipelineRequest& c = r->choices[static_cast<size_t>(i * n + j)].pipeline;
      // A prompt's choices share its ids; choice 0 keeps the request's seed, the others differ.
      CHECK(c.prompt_ids == r->choices[static_cast<size_t>(i * n)].pipeline.prompt_ids);
      if (j == 0) CHECK(c.sampling.seed == seed);
      seeds.insert(c.sampling.seed);
      CHECK(c.label.rfind(r->label, 0) == 0);
    }
  }
  CHECK(seeds.size() == static_cast<size_t>(n));
  // The same request derives the same seeds.
  auto again = parse(OpenAiEndpoint::kCompletions, {{"prompt", prompts}, {"n", n}, {"seed", seed}, {"max_tokens", 3}});
  REQUIRE(again.ok());
  for (size_t i = 0; i < r->choices.size(); ++i) CHECK(again->choices[i].pipeline.sampling.seed == r->choices[i].pipeline.sampling.seed);
  // Bounds, and a bad prompt named by its place.
  CHECK(parse(OpenAiEndpoint::kChat, {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"n", 0}}).status().code() ==
        StatusCode::kInvalidArgument);
  CHECK(parse(OpenAiEndpoint::kCompletions, {{"prompt", "x"}, {"n", kMaxChoices + 1}}).status().code() ==
        StatusCode::kInvalidArgument);
  const Status many = parse(OpenAiEndpoint::kCompletions, {{"prompt", {"a", "b", "c"}}, {"n", kMaxChoices / 2}}).status();
  CHECK(many.code() == StatusCode::kInvalidArgument);
  CHECK(error_of(many)["param"] == "n");
  const Status bad = parse(OpenAiEndpoint::kCompletions, {{"prompt", Json::array({Json("ok"), Json::array()})}}).status();
  CHECK(bad.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(bad.message(), Catch::StartsWith("prompt[1]"));
  CHECK(error_of(bad)["param"] == "prompt");
}

TEST_CASE("another model is NOT_FOUND (404, model_not_found) with the served one named", "[openai]") {
  std::mt19937 rng(test_seed());
  const std::string other = "gpt-" + random_text(rng, 10);
  const Status st = parse(OpenAiEndpoint::kChat, {{"model", other}, {"messages", {{{"role", "user"}, {"content", "hi"}}}}})
                        .status();
  REQUIRE(st.code() == StatusCode::kNotFound);
  CHECK(http_status_of(st.code()) == 404);
  const Json e = error_of(st);
  CHECK(e["code"] == "model_not_found");
  CHECK(e["param"] == "model");
  CHECK_THAT(e["message"].get<std::string>(), Catch::Contains("'test-model'"));
  // A long name is quoted cut short.
  const Status long_name = parse(OpenAiEndpoint::kCompletions, {{"model", std::string(100000, 'm')}, {"prompt", "x"}}).status();
  CHECK(long_name.message().size() < 300);
}

TEST_CASE("bodies that are not JSON objects get INVALID_ARGUMENT with a short message", "[openai]") {
  std::mt19937 rng(test_seed());
  const std::string valid = Json{{"prompt", random_text(rng, 50)}, {"max_tokens", 4}, {"stop", {"a", "b"}}}.dump();
  for (size_t cut = 0; cut < valid.size(); ++cut) {  // every truncation
    const Status st = parse_openai_request(OpenAiEndpoint::kCompletions, valid.substr(0, cut), served().model, builder()).status();
    INFO(valid.substr(0, cut));
    CHECK(st.code() == StatusCode::kInvalidArgument);
  }
  for (int round = 0; round < 200; ++round) {  // random bytes, and random damage to a valid body
    std::string body = valid;
    if (round % 2 == 0) {
      body.assign(rng() % 64, ' ');
      for (char& c : body) c = static_cast<char>(rng() % 256);
    } else {
      for (int i = 0; i < 3; ++i) body[rng() % body.size()] = static_cast<char>(rng() % 256);
    }
    const auto r = parse_openai_request(OpenAiEndpoint::kCompletions, body, served().model, builder());
    if (!r.ok()) {
      CHECK(r.status().code() == StatusCode::kInvalidArgument);
      CHECK(r.status().message().size() < 300);
      CHECK(Json::parse(error_body(400, r.status()))["error"]["message"].is_string());
    }
  }
  // nlohmann quotes what it read last: an unterminated string of megabytes must not come back.
  const Status unterminated =
      parse_openai_request(OpenAiEndpoint::kCompletions, "{\"prompt\": \"" + std::string(1 << 20, 'x'), served().model,
                           builder())
          .status();
  CHECK(unterminated.code() == StatusCode::kInvalidArgument);
  CHECK(unterminated.message().size() < 300);
  CHECK_THAT(unterminated.message(), Catch::StartsWith("the body is not valid JSON"));
  const Status not_utf8 = parse_openai_request(OpenAiEndpoint::kCompletions, "{\"prompt\": \"\xff\xfe\"}", served().model, builder()).status();
  CHECK(not_utf8.code() == StatusCode::kInvalidArgument);
  // Deeper than kMaxJsonDepth: refused whatever the field.
  const std::string deep = "{\"prompt\": \"x\", \"user\": " + std::string(kMaxJsonDepth + 5, '[') +
                           std::string(kMaxJsonDepth + 5, ']') + "}";
  CHECK_THAT(parse_openai_request(OpenAiEndpoint::kCompletions, deep, served().model, builder()).status().message(),
             Catch::Contains("nests deeper"));
  const std::string shallow = "{\"prompt\": \"x\", \"user\": " + std::string(kMaxJsonDepth - 2, '[') +
                              std::string(kMaxJsonDepth - 2, ']') + "}";
  CHECK(parse_openai_request(OpenAiEndpoint::kCompletions, shallow, served().model, builder()).ok());
  CHECK(parse_openai_request(OpenAiEndpoint::kCompletions, "[1, 2]", served().model, builder()).status().message() ==
        "the body must be a JSON object, got an array");
  CHECK(parse_openai_request(OpenAiEndpoint::kCompletions, "", served().model, builder()).status().code() ==
        StatusCode::kInvalidArgument);
}

TEST_CASE("validation's range checks reach the client under OpenAI's field names", "[openai]") {
  struct Case {
    Json body;
    const char* param;
    int http_status;
  };
  const std::vector<Case> cases = {
      {{{"prompt", "x"}, {"temperature", -0.5}}, "temperature", 400},
      {{{"prompt", "x"}, {"temperature", 1e300}}, "temperature", 400},  // inf as a float
      {{{"prompt", "x"}, {"top_p", 0}}, "top_p", 400},
      {{{"prompt", "x"}, {"top_p", 1.5}}, "top_p", 400},
      {{{"prompt", "x"}, {"top_k", -1}}, "top_k", 400},
      {{{"prompt", "x"}, {"max_tokens", 0}}, "max_tokens", 400},
      {{{"prompt", "x"}, {"max_tokens", 5000}}, "max_tokens", 400},
      {{{"prompt", "x"}, {"stop", {""}}}, "stop", 400},
      {{{"prompt", "x"}, {"priority", 5}}, "priority", 403},
      {{{"prompt", ""}}, "", 400},
  };
  for (const Case& c : cases) {
    INFO(c.body.dump());
    const Status st = parse(OpenAiEndpoint::kCompletions, c.body).status();
    REQUIRE_FALSE(st.ok());
    CHECK(http_status_of(st.code()) == c.http_status);
    const Json e = error_of(st);
    if (*c.param == 0) {
      CHECK(e["param"].is_null());
    } else {
      CHECK(e["param"] == c.param);
      CHECK_THAT(e["message"].get<std::string>(), Catch::StartsWith(c.param));
    }
  }
}

TEST_CASE("errors have OpenAI's shape and each baton status its HTTP code", "[openai]") {
  const std::vector<std::tuple<Status, int, const char*, const char*>> cases = {
      {invalid_argument("temperature must be a finite number"), 400, "invalid_request_error", "invalid_argument"},
      {failed_precondition("x"), 400, "invalid_request_error", "failed_precondition"},
      {unauthenticated("no API key"), 401, "authentication_error", "invalid_api_key"},
      {permission_denied("priority 5 is above 0"), 403, "permission_error", "permission_denied"},
      {not_found("model 'x' does not exist"), 404, "invalid_request_error", "model_not_found"},
      {resource_exhausted("the queue is full"), 429, "rate_limit_error", "rate_limit_exceeded"},
      {cancelled("gone"), 499, "server_error", "cancelled"},
      {internal_error("bug"), 500, "server_error", "internal"},
      {unimplemented("no"), 501, "server_error", "unimplemented"},
      {unavailable("no healthy decode worker"), 503, "server_error", "unavailable"},
      {deadline_exceeded("late"), 504, "server_error", "deadline_exceeded"},
  };
  for (const auto& [status, http, type, code] : cases) {
    INFO(status.to_string());
    CHECK(http_status_of(status.code()) == http);
    const Json j = Json::parse(error_body(http, status));
    REQUIRE(j.size() == 1);
    const Json& e = j["error"];
    CHECK(e["message"] == status.message());
    CHECK(e["type"] == type);
    CHECK(e["code"] == code);
    CHECK(e.contains("param"));
  }
  const Json too_large = Json::parse(error_body(413, resource_exhausted("the request body is larger than 1024 bytes")));
  CHECK(too_large["error"]["code"] == "request_too_large");
  CHECK(too_large["error"]["type"] == "invalid_request_error");
}

TEST_CASE("responses: the whole body, streamed chunks and the usage chunk carry the text, usage and timing",
          "[openai]") {
  std::mt19937 rng(test_seed());
  std::uniform_real_distribution<double> secs(0, 3);
  PipelineOutcome o;
  o.finish_reason = rng() % 2 ? "stop" : "length";
  o.n_prompt_tokens = static_cast<int32_t>(1 + rng() % 1000);
  o.cached_prompt_tokens = static_cast<int32_t>(rng() % o.n_prompt_tokens);
  o.n_generated = static_cast<int32_t>(1 + rng() % 1000);
  o.queue_seconds = secs(rng);
  o.prefill_seconds = secs(rng);
  o.kv_transfer_seconds = secs(rng);
  o.decode_queue_seconds = secs(rng);
  o.ttft_seconds = secs(rng);
  o.e2e_seconds = secs(rng);
  o.failovers = static_cast<int32_t>(rng() % 3);
  o.prefill_address = "10.0.0." + std::to_string(rng() % 256) + ":50051";
  o.decode_address = "10.0.1." + std::to_string(rng() % 256) + ":50051";
  const std::string text = random_text(rng, 80) + "\xc3\xa9";  // and a two-byte character
  auto check_baton = [&](const Json& b) {
    const Json& t = b["timing"];
    CHECK(t["queue_seconds"].get<double>() == o.queue_seconds);
    CHECK(t["prefill_seconds"].get<double>() == o.prefill_seconds);
    CHECK(t["kv_transfer_seconds"].get<double>() == o.kv_transfer_seconds);
    CHECK(t["decode_queue_seconds"].get<double>() == o.decode_queue_seconds);
    CHECK(t["ttft_seconds"].get<double>() == o.ttft_seconds);
    CHECK(t["e2e_seconds"].get<double>() == o.e2e_seconds);
    CHECK(t["failovers"].get<int>() == o.failovers);
    CHECK(b["prefill_worker"] == o.prefill_address);
    CHECK(b["decode_worker"] == o.decode_address);
  };
  auto check_usage = [&](const Json& u) {
    CHECK(u["prompt_tokens"].get<int>() == o.n_prompt_tokens);
    CHECK(u["completion_tokens"].get<int>() == o.n_generated);
    CHECK(u["total_tokens"].get<int>() == o.n_prompt_tokens + o.n_generated);
    CHECK(u["prompt_tokens_details"]["cached_tokens"].get<int>() == o.cached_prompt_tokens);
  };
  for (OpenAiEndpoint e : {OpenAiEndpoint::kCompletions, OpenAiEndpoint::kChat}) {
    const bool chat = e == OpenAiEndpoint::kChat;
    ResponseHeader h{e, response_id(e, "req-42"), static_cast<int64_t>(rng() % 2000000000), "test-model"};
    CHECK(h.id == (chat ? "chatcmpl-req-42" : "cmpl-req-42"));

    const Json whole = Json::parse(completion_body(h, {ChoiceOut{text, o, nullptr}}, o));
    CHECK(whole["id"] == h.id);
    CHECK(whole["object"] == (chat ? "chat.completion" : "text_completion"));
    CHECK(whole["created"].get<int64_t>() == h.created);
    CHECK(whole["model"] == "test-model");
    REQUIRE(whole["choices"].size() == 1);
    const Json& choice = whole["choices"][0];
    CHECK(choice["index"] == 0);
    CHECK(choice["finish_reason"] == o.finish_reason);
    CHECK((chat ? choice["message"]["content"] : choice["text"]) == text);
    if (chat) CHECK(choice["message"]["role"] == "assistant");
    check_usage(whole["usage"]);
    check_baton(whole["baton"]);

    for (bool include_usage : {false, true}) {
      const Json first = Json::parse(chunk_body(h, 0, text, /*first=*/true, nullptr, include_usage, nullptr));
      CHECK(first["object"] == (chat ? "chat.completion.chunk" : "text_completion"));
      CHECK(first["choices"][0]["finish_reason"].is_null());
      CHECK(first.contains("usage") == include_usage);
      CHECK_FALSE(first.contains("baton"));
      if (chat) {
        CHECK(first["choices"][0]["delta"]["role"] == "assistant");
        CHECK(first["choices"][0]["delta"]["content"] == text);
      } else {
        CHECK(first["choices"][0]["text"] == text);
      }
      const Json middle = Json::parse(chunk_body(h, 0, "", /*first=*/false, nullptr, include_usage, nullptr));
      if (chat) CHECK(middle["choices"][0]["delta"] == Json::object());  // nothing new
      const Json last = Json::parse(chunk_body(h, 0, "", /*first=*/false, &o, include_usage, nullptr));
      CHECK(last["choices"][0]["finish_reason"] == o.finish_reason);
      // The extension rides on the last chunk: this one, or the usage chunk after it.
      CHECK(last.contains("baton") == !include_usage);
      if (!include_usage) check_baton(last["baton"]);
    }
    const Json usage = Json::parse(usage_chunk_body(h, o));
    CHECK(usage["choices"] == Json::array());
    check_usage(usage["usage"]);
    check_baton(usage["baton"]);
  }
  CHECK(sse_event("{}") == "data: {}\n\n");

  const auto headers = timing_headers(o);
  std::map<std::string, std::string> by_name(headers.begin(), headers.end());
  CHECK(std::abs(std::stod(by_name.at("X-Baton-Queue-Seconds")) - o.queue_seconds) < 1e-6);
  CHECK(std::abs(std::stod(by_name.at("X-Baton-Prefill-Seconds")) - o.prefill_seconds) < 1e-6);
  CHECK(std::abs(std::stod(by_name.at("X-Baton-Kv-Transfer-Seconds")) - o.kv_transfer_seconds) < 1e-6);
  CHECK(std::abs(std::stod(by_name.at("X-Baton-Ttft-Seconds")) - o.ttft_seconds) < 1e-6);
  CHECK(std::abs(std::stod(by_name.at("X-Baton-E2e-Seconds")) - o.e2e_seconds) < 1e-6);
  CHECK(std::stoi(by_name.at("X-Baton-Failovers")) == o.failovers);
}

TEST_CASE("the model list names the served model with its context and template", "[openai]") {
  const Json list = Json::parse(models_body(served().model, 1234));
  CHECK(list["object"] == "list");
  REQUIRE(list["data"].size() == 1);
  const Json& m = list["data"][0];
  CHECK(m == Json::parse(model_body(served().model, 1234)));
  CHECK(m["id"] == "test-model");
  CHECK(m["object"] == "model");
  CHECK(m["created"] == 1234);
  CHECK(m["baton"]["context_length"] == served().model.config.n_ctx);
  CHECK(m["baton"]["vocab_size"] == served().model.config.n_vocab);
  CHECK(m["baton"]["chat_template"] == "model");  // the model's own template
}

TEST_CASE("cache_salt and the API key's tenant make the request's cache scope", "[openai][limits]") {
  const Json body = {{"prompt", "hi"}, {"cache_salt", "s1"}};
  auto scope = [&](const Json& b, const std::string& tenant) {
    auto r = parse_openai_request(OpenAiEndpoint::kCompletions, b.dump(), served().model,
                                  RequestBuilder(served().model, std::nullopt, tenant));
    REQUIRE(r.ok());
    return r->choices.front().pipeline.sampling.cache_scope;
  };
  const Json plain = {{"prompt", "hi"}};
  CHECK(scope(plain, "").empty());  // neither: shared with every request that has neither
  CHECK(scope(body, "") == ":s1");
  CHECK(scope(plain, "aaaa") == "aaaa:");
  CHECK(scope(body, "aaaa") == "aaaa:s1");
  // No salt reaches another key's scope: every scope under a key starts with that key's tenant.
  CHECK(scope(Json{{"prompt", "hi"}, {"cache_salt", "aaaa:"}}, "bbbb") == "bbbb:aaaa:");
  // A client's own sampling scope (gRPC's SamplingParams.cache_scope) is replaced by the builder's.
  RequestBuilder b(served().model, std::nullopt, "cccc");
  REQUIRE(b.prompt_text("hi").ok());
  SamplingParams sp;
  sp.cache_scope = "aaaa:";
  REQUIRE(b.sampling(sp, "sampling.").ok());
  auto built = std::move(b).build();
  REQUIRE(built.ok());
  CHECK(built->pipeline.sampling.cache_scope == "cccc:");
  const Status long_salt = parse_openai_request(OpenAiEndpoint::kCompletions,
                                                Json{{"prompt", "hi"}, {"cache_salt", std::string(257, 's')}}.dump(),
                                                served().model, builder())
                               .status();
  CHECK(long_salt.code() == StatusCode::kInvalidArgument);
  CHECK(error_of(long_salt)["param"] == "cache_salt");
}

}  // namespace baton
