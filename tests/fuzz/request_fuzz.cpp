// libFuzzer target: a request as a hostile client sends it, through everything the frontend and a
// worker do with it in process — the OpenAI body parser and the RequestBuilder (every field), the
// chat template's render of messages, tools and tool calls, the tokenizer, the JSON-schema
// compiler, the worker's constraint (OutputConstraints::resolve) and a walk of its token masks,
// and the tool-call parser over text. The first byte picks the surface: 'c' a chat completions
// body, 'p' a completions body, 'g' a GenerateRequest's fields (as JSON: read_request in
// server/generate_call.cpp hands them to the builder the same way).
//
// The mutator is structure-aware: an input that parses as JSON is changed as a tree — a node
// nested hundreds or thousands of levels deep, an object widened past the member bound, a $ref
// chain, a subtree turned into a string (JSON inside tool-call arguments), schema and tool
// fragments spliced in — and written back; anything else gets libFuzzer's own byte mutations.
//
// Checked: no crash, no sanitizer report, no input over -rss_limit_mb or -timeout (scripts/fuzz.sh),
// every refusal small enough to travel as a status, and every token a mask allows keeps the
// output alive (unless the automaton's memory budget ran out).
//
// BATON_FUZZ_MODEL: a GGUF whose tokenizer and chat template to use (the real model in CI);
// without it, the random test model's.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/json_bounds.h"
#include "model/chat_template.h"
#include "model/config.h"
#include "model/gguf.h"
#include "model/output_constraints.h"
#include "model/test_model.h"
#include "model/tokenizer.h"
#include "model/tool_calls.h"
#include "server/openai_json.h"
#include "server/request_validation.h"

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

namespace baton {
namespace {

using Json = nlohmann::ordered_json;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "request_fuzz: %s\n", what.c_str());
  std::abort();
}

struct Served {
  Served() {
    const char* path = std::getenv("BATON_FUZZ_MODEL");
    auto f = path != nullptr && *path ? GgufFile::open(path) : GgufFile::parse(make_test_model({}).to_bytes());
    if (!f.ok()) fail("cannot load the model: " + f.status().to_string());
    file = std::move(*f);
    auto t = Tokenizer::from_gguf(*file);
    if (!t.ok()) fail(t.status().to_string());
    tokenizer = std::move(*t);
    auto c = model_config_from_gguf(*file);
    if (!c.ok()) fail(c.status().to_string());
    model.name = "fuzz-model";
    model.config = *c;
    model.fingerprint = model_fingerprint(*c, *file);
    model.tokenizer = tokenizer.get();
    auto tmpl = chat_template_from_gguf(*file);
    model.chat_template = tmpl.ok() ? std::optional<ChatTemplate>(*tmpl) : ChatTemplate::builtin("chatml", {}).value();
    model.max_prompt_bytes = max_prompt_bytes(*tokenizer, c->n_ctx);
    // The worker's automata over the random test model's 275 byte-level tokens: the grammar's
    // states are the vocabulary's business only through the masks, and a mask over SmolLM2's
    // 49,152 tokens cost each new schema a second under ASan (3 inputs a second).
    auto small = GgufFile::parse(make_test_model({}).to_bytes());
    if (!small.ok()) fail(small.status().to_string());
    walk_file = std::move(*small);
    auto wt = Tokenizer::from_gguf(*walk_file);
    if (!wt.ok()) fail(wt.status().to_string());
    walk_tokenizer = std::move(*wt);
    constraints = std::make_unique<OutputConstraints>(*walk_tokenizer, walk_tokenizer->n_vocab());
  }
  std::unique_ptr<GgufFile> file, walk_file;
  std::unique_ptr<Tokenizer> tokenizer, walk_tokenizer;
  ServedModel model;
  std::unique_ptr<OutputConstraints> constraints;
};

Served& served() {
  static Served s;
  return s;
}

void check_refusal(const Status& s) {
  if (s.ok()) return;
  if (s.message().empty()) fail("a refusal without a message");
  if (s.message().size() > 4096) fail("a " + std::to_string(s.message().size()) + "-byte refusal");
}

// The worker's side of a request that passed the frontend: its format resolved against a
// vocabulary (the test model's), then a walk of up to 16 tokens, each drawn from the mask by the
// input's bytes.
void decode_walk(SamplingParams sampling, const uint8_t* walk, size_t n) {
  if (sampling.format.kind == OutputFormat::Kind::kText) return;
  const Status st = served().constraints->resolve(&sampling);
  check_refusal(st);
  if (!st.ok()) return;
  grammar::TokenConstraint& c = *sampling.constraint;
  grammar::TokenConstraint::State state = c.start();
  const auto& vocab = c.vocabulary();
  for (size_t step = 0; step < 16 && state != grammar::TokenConstraint::kDead; ++step) {
    const uint32_t* mask = c.mask(state);
    std::vector<int32_t> allowed;
    for (int32_t t = 0; t < vocab.n_tokens() && allowed.size() < 4096; ++t) {
      if ((mask[t / 32] >> (t % 32)) & 1u) allowed.push_back(t);
    }
    if (allowed.empty()) break;
    const size_t pick = n > 0 ? (walk[step % n] * 131u + step) % allowed.size() : 0;
    const int32_t token = allowed[pick];
    const auto next = c.advance(state, token);
    if (next == grammar::TokenConstraint::kDead && !vocab.is_stop(token) && !c.exhausted()) {
      fail("token " + std::to_string(token) + " allowed by the mask leaves the grammar");
    }
    if (vocab.is_stop(token)) break;
    state = next;
  }
}

// What a text becomes when a model writes it: the tool-call parser, in every syntax.
void parse_output(std::string_view text) {
  for (ToolCallSyntax s : {ToolCallSyntax::kTagged, ToolCallSyntax::kJson, ToolCallSyntax::kMistral}) {
    (void)parse_tool_calls(s, text);
  }
}

// The surface of a GenerateRequest: fields of the JSON description, handed to the builder in the
// order read_request does. A field of the wrong JSON type is left unset (proto3 has no such case).
Result<ValidRequest> read_generate(const Json& r, RequestBuilder b) {
  auto str = [&](const Json& o, const char* k) -> std::string {
    const auto it = o.find(k);
    return it != o.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  auto num = [&](const Json& o, const char* k, double fallback) -> double {
    const auto it = o.find(k);
    return it != o.end() && it->is_number() ? it->get<double>() : fallback;
  };
  auto i32 = [&](const Json& o, const char* k) -> int32_t {
    const double v = num(o, k, 0);
    return v >= -2147483648.0 && v <= 2147483647.0 ? static_cast<int32_t>(v) : 0;
  };
  if (!r.is_object()) return invalid_argument("not an object");
  if (!str(r, "request_id").empty()) BATON_RETURN_IF_ERROR(b.request_id(str(r, "request_id")));
  if (!str(r, "prompt").empty()) BATON_RETURN_IF_ERROR(b.prompt_text(str(r, "prompt")));
  if (r.contains("prompt_token_ids") && r["prompt_token_ids"].is_array()) {
    std::vector<int32_t> ids;
    for (const Json& x : r["prompt_token_ids"]) ids.push_back(x.is_number_integer() ? x.get<int32_t>() : 0);
    if (!ids.empty()) BATON_RETURN_IF_ERROR(b.prompt_ids(ids, "prompt_token_ids"));
  }
  if (r.contains("messages") && r["messages"].is_array() && !r["messages"].empty()) {
    std::vector<ChatMessage> messages;
    for (const Json& m : r["messages"]) {
      if (m.is_object()) messages.push_back({str(m, "role"), str(m, "content")});
    }
    BATON_RETURN_IF_ERROR(b.messages(messages));
  }
  b.max_tokens(i32(r, "max_tokens"));
  SamplingParams s;
  const Json empty = Json::object();
  const Json& sp = r.contains("sampling") && r["sampling"].is_object() ? r["sampling"] : empty;
  s.temperature = static_cast<float>(num(sp, "temperature", 0));
  s.top_k = i32(sp, "top_k");
  s.top_p = static_cast<float>(num(sp, "top_p", 1));
  s.seed = static_cast<uint64_t>(i32(sp, "seed"));
  s.presence_penalty = static_cast<float>(num(sp, "presence_penalty", 0));
  s.frequency_penalty = static_cast<float>(num(sp, "frequency_penalty", 0));
  s.repetition_penalty = static_cast<float>(num(sp, "repetition_penalty", 1));
  if (sp.contains("top_logprobs")) s.top_logprobs = i32(sp, "top_logprobs");
  const Json& rf = sp.contains("response_format") && sp["response_format"].is_object() ? sp["response_format"] : empty;
  const int type = i32(rf, "type");
  s.format.kind = type == 1 ? OutputFormat::Kind::kJsonObject : type == 2 ? OutputFormat::Kind::kJsonSchema : OutputFormat::Kind::kText;
  s.format.schema = str(rf, "json_schema");
  s.format.prefix = str(rf, "prefix");
  s.format.suffix = str(rf, "suffix");
  BATON_RETURN_IF_ERROR(b.sampling(s, "sampling."));
  std::vector<std::string> stop;
  if (r.contains("stop") && r["stop"].is_array()) {
    for (const Json& x : r["stop"]) stop.push_back(x.is_string() ? x.get<std::string>() : std::string());
  }
  BATON_RETURN_IF_ERROR(b.stop(stop));
  BATON_RETURN_IF_ERROR(b.priority(i32(r, "priority")));
  BATON_RETURN_IF_ERROR(b.ttft_slo(num(r, "ttft_slo_seconds", 0), "ttft_slo_seconds"));
  return std::move(b).build();
}

// ---- the mutator ---------------------------------------------------------------------------------

// Schema and request fragments the mutator splices in.
const std::vector<Json>& fragments() {
  static const std::vector<Json> k = [] {
    std::vector<Json> f;
    for (const char* text : {
             R"({"type":"object","properties":{"a":{"type":"string","maxLength":8},"b":{"type":"integer"}},"required":["a"]})",
             R"({"type":"array","items":{"type":"number"},"minItems":1,"maxItems":1024})",
             R"({"anyOf":[{"type":"null"},{"$ref":"#"}]})",
             R"({"$ref":"#/$defs/x"})",
             R"({"enum":["a","b",1,null,{"k":[1]}]})",
             R"({"const":{"k":[1,2,{"z":null}]}})",
             R"({"type":"string","minLength":1000,"maxLength":1024})",
             R"({"additionalProperties":{"type":"boolean"}})",
             R"({"type":["string","null","object"]})",
             R"({"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object"}}})",
             R"({"type":"json_object"})",
             R"([{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"q":{"type":"string"}}}}}])",
             R"({"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"q\":\"x\"}"}}]})",
             R"({"role":"tool","tool_call_id":"c1","content":"ok"})",
             R"({"type":"function","function":{"name":"f"}})",
             R"([{"type":"text","text":"hi"}])",
             R"("<tool_call>\n{\"name\":\"f\",\"arguments\":{\"q\":1}}\n</tool_call>")",
             R"("[TOOL_CALLS] [{\"name\":\"f\",\"arguments\":{}}]")",
             "2147483648", "-1", "1e308", "0", "\"\\u00e9\\n\"", "null", "true", "[]", "{}"}) {
      f.push_back(Json::parse(text));
    }
    return f;
  }();
  return k;
}

const char* const kKeys[] = {"type", "properties", "required", "items", "anyOf", "$ref", "$defs", "enum", "const",
                             "minLength", "maxLength", "minItems", "maxItems", "additionalProperties",
                             "response_format", "json_schema", "schema", "tools", "tool_choice", "tool_calls",
                             "arguments", "messages", "content", "n", "logprobs", "top_logprobs", "stop",
                             "max_tokens", "prompt", "sampling", "prefix", "suffix", "cache_salt"};

// Every node's JSON pointer (a bounded number, by an explicit stack).
std::vector<Json::json_pointer> nodes(const Json& root) {
  std::vector<Json::json_pointer> out;
  std::vector<Json::json_pointer> todo{Json::json_pointer()};
  while (!todo.empty() && out.size() < 4096) {
    const Json::json_pointer p = todo.back();
    todo.pop_back();
    out.push_back(p);
    const Json& j = root.at(p);
    if (j.is_object()) {
      for (const auto& [k, _] : j.items()) todo.push_back(p / k);
    } else if (j.is_array()) {
      for (size_t i = 0; i < j.size(); ++i) todo.push_back(p / i);
    }
  }
  return out;
}

// `root` written with `text` in place of the node at `at` (which the mutation set to a marker).
std::string splice(const Json& root, const std::string& marker, const std::string& text) {
  std::string s = root.dump();
  const size_t at = s.find("\"" + marker + "\"");
  if (at == std::string::npos) return s;
  return s.replace(at, marker.size() + 2, text);
}

std::string mutate_tree(Json root, std::mt19937& rng) {
  auto all = nodes(root);
  auto pick = [&]() { return all[std::uniform_int_distribution<size_t>(0, all.size() - 1)(rng)]; };
  auto one_of = [&](std::initializer_list<int> xs) { return *(xs.begin() + std::uniform_int_distribution<size_t>(0, xs.size() - 1)(rng)); };
  const std::string marker = "@@MARK@@";
  const Json::json_pointer at = pick();
  switch (std::uniform_int_distribution<int>(0, 8)(rng)) {
    case 0: {  // a node nested many levels deep, written as text (no recursion over it)
      const int depth = one_of({3, 40, 250, 300, 5000});
      static const char* const kWraps[][2] = {{"[", "]"}, {"{\"items\":", "}"}, {"{\"anyOf\":[", "]}"}, {"{\"a\":", "}"}};
      const auto& w = kWraps[std::uniform_int_distribution<int>(0, 3)(rng)];
      std::string text = root.at(at).dump();
      std::string open, close;
      for (int i = 0; i < depth; ++i) {
        open += w[0];
        close += w[1];
      }
      if (at.empty()) return open + text + close;
      root.at(at) = marker;
      return splice(root, marker, open + text + close);
    }
    case 1: {  // an object widened, past the member bound sometimes
      const int n = one_of({5, 300, 2000, static_cast<int>(kMaxJsonObjectMembers) + 1});
      std::string text = "{";
      for (int i = 0; i < n; ++i) text += (i ? ",\"p" : "\"p") + std::to_string(i) + "\":{\"type\":\"string\"}";
      text += "}";
      if (at.empty()) return text;
      root.at(at) = marker;
      return splice(root, marker, text);
    }
    case 2: {  // a $ref chain under $defs, the node pointing at its start
      const int n = one_of({2, 100, 130, 5000});
      std::string defs = "{";
      for (int i = 0; i < n; ++i) defs += "\"d" + std::to_string(i) + "\":{\"$ref\":\"#/$defs/d" + std::to_string(i + 1) + "\"},";
      defs += "\"d" + std::to_string(n) + "\":{\"type\":\"string\"}}";
      Json& node = root.at(at);
      if (!node.is_object()) node = Json::object();
      node["$ref"] = "#/$defs/d0";
      node["$defs"] = marker;
      return splice(root, marker, defs);
    }
    case 3:  // a subtree as a string (JSON inside a string field: tool-call arguments)
      root.at(at) = root.at(pick()).dump();
      break;
    case 4: {  // a fragment spliced in
      const auto& f = fragments();
      root.at(at) = f[std::uniform_int_distribution<size_t>(0, f.size() - 1)(rng)];
      break;
    }
    case 5: {  // a member added under a known key
      Json& node = root.at(at);
      if (!node.is_object()) node = Json::object();
      const auto& f = fragments();
      node[kKeys[std::uniform_int_distribution<size_t>(0, std::size(kKeys) - 1)(rng)]] =
          f[std::uniform_int_distribution<size_t>(0, f.size() - 1)(rng)];
      break;
    }
    case 6:  // one subtree copied over another
      root.at(at) = Json(root.at(pick()));
      break;
    case 7:  // a node removed
      if (!at.empty()) {
        Json& parent = root.at(at.parent_pointer());
        if (parent.is_object()) parent.erase(at.back());
        else if (parent.is_array() && !parent.empty()) parent.erase(parent.begin());
      }
      break;
    default: {  // a number at an edge
      static const char* const kEdges[] = {"2147483647", "-2147483649", "1e400", "-0", "65", "1025", "4294967296"};
      root.at(at) = marker;
      return splice(root, marker, kEdges[std::uniform_int_distribution<int>(0, 6)(rng)]);
    }
  }
  return root.dump();
}

}  // namespace
}  // namespace baton

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size, unsigned int seed) {
  using namespace baton;
  std::mt19937 rng(seed);
  if (size >= 2 && rng() % 4 != 0) {
    const std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
    // Deep or wide inputs are not walked as trees (nlohmann's dump recurses; ordered_json's
    // parse of a wide object is quadratic): they get byte mutations.
    const JsonShape shape = json_shape(body, 512);
    if (shape.depth <= 512 && shape.widest_object <= 4 * kMaxJsonObjectMembers) {
      const Json root = Json::parse(body, nullptr, /*allow_exceptions=*/false);
      if (!root.is_discarded()) {
        const std::string out = mutate_tree(root, rng);
        if (out.size() + 1 <= max_size) {
          std::memcpy(data + 1, out.data(), out.size());
          return out.size() + 1;
        }
      }
    }
  }
  return LLVMFuzzerMutate(data, size, max_size);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace baton;
  if (size < 1) return 0;
  Served& s = served();
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  const uint8_t* walk = data;
  const size_t walk_n = std::min<size_t>(size, 64);
  std::vector<SamplingParams> accepted;
  switch (data[0] % 3) {
    case 0:
    case 1: {
      const auto endpoint = data[0] % 3 == 0 ? OpenAiEndpoint::kChat : OpenAiEndpoint::kCompletions;
      auto r = parse_openai_request(endpoint, body, s.model, RequestBuilder(s.model, std::nullopt));
      check_refusal(r.status());
      if (r.ok()) {
        for (size_t i = 0; i < r->choices.size() && i < 2; ++i) accepted.push_back(r->choices[i].pipeline.sampling);
      }
      break;
    }
    default: {
      if (!check_json_bounds(body, "the fuzz input").ok()) return 0;  // the gRPC message's own bound
      const Json j = Json::parse(body, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) return 0;
      auto r = read_generate(j, RequestBuilder(s.model, std::nullopt));
      check_refusal(r.status());
      if (r.ok()) accepted.push_back(r->pipeline.sampling);
      break;
    }
  }
  for (const SamplingParams& p : accepted) decode_walk(p, walk, walk_n);
  parse_output(body);
  return 0;
}
