#include "app/engine_commands.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/npy.h"
#include "common/progress.h"
#include "kernels/backend.h"
#include "model/chat_template.h"
#include "model/generator.h"
#include "model/gguf.h"
#include "model/model.h"
#include "model/test_model.h"
#include "model/model_files.h"
#include "model/tokenizer.h"

namespace baton {
namespace {

// Bad input from the command line (prompt, flags) exits 2.
int fail(const Status& s) { return exit_with_error(s); }

// A model file that cannot be used (missing, truncated, corrupt, unsupported) exits 1.
int fail_model(const Status& s) {
  std::fprintf(stderr, "baton: error: %s\n", s.message().c_str());
  return kExitFailure;
}

// "1,2,3" -> ids; INVALID_ARGUMENT naming `flag` for anything else.
Result<std::vector<int32_t>> parse_ids(const std::string& text, const std::string& flag) {
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      long v = std::stol(item, &used);
      if (used != item.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument(item);
      ids.push_back(static_cast<int32_t>(v));
    } catch (const std::exception&) {
      return invalid_argument(flag + ": '" + item + "' is not a token id (expected e.g. 1,2,3)");
    }
  }
  return ids;
}

std::string join_ids(const std::vector<int32_t>& ids) {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? "," : "") + std::to_string(ids[i]);
  return out;
}

struct GenerateArgs {
  std::string model;
  std::string prompt;
  std::string chat;
  std::string prompt_ids;
  std::string chat_template;
  std::string system;
  int max_tokens = 256;
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  uint64_t seed = 0;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;
  int prefill_chunk = 0;
  bool print_ids = false;
  bool ignore_eos = false;
  std::string logits_out;
  std::string logits_all_out;
  int threads = 0;
  std::string device = "cpu";
  std::string dtype = "bf16";
  std::string kv_dtype;  // empty: bf16 under bf16 compute, else f32 (resolve_kv_dtype)
  int block_size = 16;
  std::string weights = "auto";
};

// Flags are checked against the dtype names by CLI11 before this runs.
DType parse_dtype(const std::string& s) { return dtype_from_name(s).value(); }

int run_generate(const GenerateArgs& a) {
  auto files = open_model_files(a.model);
  if (!files.ok()) return fail_model(files.status());
  const Tokenizer& tok = *files->tokenizer;

  std::vector<int32_t> prompt;
  if (!a.prompt_ids.empty()) {
    auto ids = parse_ids(a.prompt_ids, "--prompt-ids");
    if (!ids.ok()) return fail(ids.status());
    prompt = *ids;
  } else {
    std::string text = a.prompt;
    if (!a.chat.empty()) {
      Result<ChatTemplate> tmpl = files->chat_template_for(a.chat_template);
      if (!tmpl.ok()) return fail(tmpl.status());
      std::vector<ChatMessage> messages;
      if (!a.system.empty()) messages.push_back({"system", a.system});
      messages.push_back({"user", a.chat});
      auto rendered = tmpl->render(messages, /*add_generation_prompt=*/true);
      if (!rendered.ok()) return fail(rendered.status());
      text = std::move(*rendered);
    }
    if (text.empty()) return fail(invalid_argument("the prompt is empty: pass a non-empty --prompt or --chat"));
    auto ids = tok.encode(text, /*parse_special=*/!a.chat.empty());
    if (!ids.ok()) return fail(ids.status());
    prompt = *ids;
    if (tok.add_bos()) prompt.insert(prompt.begin(), tok.bos_id());
  }

  BackendOptions bo;
  bo.device = a.device;
  bo.dtype = parse_dtype(a.dtype);
  bo.n_threads = a.threads;
  std::string error;
  auto backend = make_backend(bo, &error);
  if (!backend) return fail(invalid_argument(error));
  const Result<DType> kv_dtype = resolve_kv_dtype(*backend, a.kv_dtype);
  if (!kv_dtype.ok()) return fail(kv_dtype.status());
  // A progress bar on a terminal only: stderr otherwise carries just the timing line (or one error).
  const auto load_start = std::chrono::steady_clock::now();
  auto model = Model::load(*files->source, *backend,
                           isatty(STDERR_FILENO) ? load_progress_reporter(a.model) : Model::LoadProgress{},
                           weights_plan(a.weights, *backend, /*decodes=*/true, /*prefills=*/true));
  if (!model.ok()) return fail_model(model.status());
  const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();

  GenerateOptions go;
  go.max_tokens = a.max_tokens;
  go.sampling.temperature = a.temperature;
  go.sampling.top_k = a.top_k;
  go.sampling.top_p = a.top_p;
  go.sampling.seed = a.seed;
  go.sampling.presence_penalty = a.presence_penalty;
  go.sampling.frequency_penalty = a.frequency_penalty;
  go.sampling.repetition_penalty = a.repetition_penalty;
  go.prefill_chunk = a.prefill_chunk;
  go.ignore_eos = a.ignore_eos;
  go.stop_ids = tok.stop_ids();
  go.block_size = a.block_size;
  go.kv_dtype = *kv_dtype;
  go.all_prompt_logits = !a.logits_all_out.empty();

  StreamDecoder decoder(tok);
  auto on_token = [&](int32_t id) {
    if (!a.print_ids && !tok.is_control(id)) {
      std::string piece = decoder.push(id);
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    }
    return true;
  };
  Generator gen(**model);
  auto res = gen.generate(prompt, go, on_token);
  if (!res.ok()) return fail(res.status());
  if (a.print_ids) {
    std::printf("%s\n", join_ids(res->tokens).c_str());
  } else {
    std::string rest = decoder.flush();
    std::printf("%s\n", rest.c_str());
  }
  const int n_vocab = (*model)->config().n_vocab;
  if (!a.logits_out.empty()) {
    if (Status s = write_npy_f32(a.logits_out, res->last_logits, {n_vocab}); !s.ok()) return fail(s);
  }
  if (!a.logits_all_out.empty()) {
    if (Status s = write_npy_f32(a.logits_all_out, res->prompt_logits, {res->n_prompt, n_vocab}); !s.ok()) return fail(s);
  }
  const int n_gen = static_cast<int>(res->tokens.size());
  std::fprintf(stderr,
               "baton: %s, %s | load %.1f ms (weights checked finite in %.1f ms) | prompt %d tokens, prefill %.1f ms "
               "(%.1f tok/s), decode %d tokens in %.1f ms (%.1f tok/s), finish %s\n",
               (*model)->config().name.c_str(), backend->name().c_str(), load_seconds * 1e3,
               (*model)->finite_check_seconds() * 1e3, res->n_prompt, res->prefill_seconds * 1e3,
               res->n_prompt / std::max(res->prefill_seconds, 1e-9), n_gen, res->decode_seconds * 1e3,
               n_gen > 1 ? (n_gen - 1) / std::max(res->decode_seconds, 1e-9) : 0.0, res->finish_reason.c_str());
  return 0;
}

// The tokenizer of a GGUF file, of a Hugging Face tokenizer.json, or of the tokenizer.json in a
// model directory (which need not hold weights).
Result<std::unique_ptr<Tokenizer>> load_tokenizer(const std::string& path) {
  if (std::filesystem::is_directory(path)) return Tokenizer::from_hf_json(path + "/tokenizer.json");
  if (path.ends_with(".json")) return Tokenizer::from_hf_json(path);
  BATON_ASSIGN_OR_RETURN(auto file, GgufFile::open(path));
  return Tokenizer::from_gguf(*file);
}

// `decode`: the ids of --decode (TEXT is not given then).
int run_tokenize(const std::string& model, const std::string& text, bool no_special,
                 const std::optional<std::string>& decode) {
  auto tokenizer = load_tokenizer(model);
  if (!tokenizer.ok()) return fail_model(tokenizer.status());
  if (decode) {
    auto ids = parse_ids(*decode, "--decode");
    if (!ids.ok()) return fail(ids.status());
    for (int32_t id : *ids) {
      if (id >= (*tokenizer)->n_vocab()) {
        return fail(invalid_argument("--decode: token id " + std::to_string(id) + " is outside the vocabulary of " +
                                     std::to_string((*tokenizer)->n_vocab())));
      }
    }
    const std::string out = (*tokenizer)->decode(*ids);
    std::fwrite(out.data(), 1, out.size(), stdout);  // exactly the text: no newline added
    return 0;
  }
  auto ids = (*tokenizer)->encode(text, !no_special);
  if (!ids.ok()) return fail(ids.status());
  std::printf("%s\n", join_ids(*ids).c_str());
  return 0;
}

struct ChatTemplateArgs {
  std::string model;
  std::string chat_template;
  std::string bos_token;
  std::string eos_token;
  std::string messages;       // one conversation, as JSON
  std::string conversations;  // a JSON file: [{"messages": [...], "add_generation_prompt": bool, "tools"?: [...]}, ...]
  bool no_generation_prompt = false;
};

Result<std::vector<ChatMessage>> parse_messages(const nlohmann::ordered_json& j, const std::string& what) {
  if (!j.is_array()) return invalid_argument(what + ": expected a JSON array of {\"role\", \"content\"} objects");
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < j.size(); ++i) {
    const auto& m = j[i];
    const bool content_ok = m.is_object() && m.contains("content") && (m["content"].is_string() || m["content"].is_null());
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !content_ok) {
      return invalid_argument(what + "[" + std::to_string(i) + "]: expected {\"role\": string, \"content\": string}");
    }
    ChatMessage& message = messages.emplace_back();
    message.role = m["role"].get<std::string>();
    if (m["content"].is_string()) message.content = m["content"].get<std::string>();
    // OpenAI's tool fields: an assistant's calls (arguments as JSON text or an object), a tool
    // message's call id.
    for (const auto& c : m.value("tool_calls", nlohmann::ordered_json::array())) {
      const auto& f = c.value("function", nlohmann::ordered_json::object());
      const auto& args = f.value("arguments", nlohmann::ordered_json::object());
      message.tool_calls.push_back({c.value("id", ""), f.value("name", ""), args.is_string() ? args.get<std::string>() : args.dump()});
    }
    message.tool_call_id = m.value("tool_call_id", "");
  }
  return messages;
}

// Prints the prompt a chat template makes of messages: one conversation's text exactly (no
// newline added), or for --conversations one JSON line per conversation, {"text": ...} or
// {"error": ...} (a template's refusal is an answer there, not a failure).
int run_chat_template(const ChatTemplateArgs& a) {
  Result<ChatTemplate> tmpl = not_found("give --model or --chat-template");
  if (!a.model.empty()) {
    auto files = open_model_files(a.model);
    if (!files.ok()) return fail_model(files.status());
    tmpl = files->chat_template_for(a.chat_template);
  } else if (!a.chat_template.empty()) {
    tmpl = ChatTemplate::from_flag(a.chat_template, {a.bos_token, a.eos_token});
  }
  if (!tmpl.ok()) return fail(tmpl.status());
  if (!a.messages.empty()) {
    const auto j = nlohmann::ordered_json::parse(a.messages, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return fail(invalid_argument("--messages is not valid JSON"));
    auto messages = parse_messages(j, "--messages");
    if (!messages.ok()) return fail(messages.status());
    auto text = tmpl->render(*messages, !a.no_generation_prompt);
    if (!text.ok()) return fail(text.status());
    std::fwrite(text->data(), 1, text->size(), stdout);
    return 0;
  }
  std::ifstream in(a.conversations);
  if (!in) return fail(not_found("--conversations: cannot read " + a.conversations));
  const auto j = nlohmann::ordered_json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_array()) return fail(invalid_argument("--conversations: expected a JSON array of conversations"));
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string what = "--conversations[" + std::to_string(i) + "]";
    if (!j[i].is_object() || !j[i].contains("messages")) {
      return fail(invalid_argument(what + ": expected {\"messages\": [...], \"add_generation_prompt\": bool}"));
    }
    auto messages = parse_messages(j[i]["messages"], what + ".messages");
    if (!messages.ok()) return fail(messages.status());
    const std::string tools = j[i].contains("tools") ? j[i]["tools"].dump() : "";
    auto text = tmpl->render(*messages, j[i].value("add_generation_prompt", true), tools);
    const nlohmann::ordered_json line = text.ok() ? nlohmann::ordered_json{{"text", *text}} : nlohmann::ordered_json{{"error", text.status().message()}};
    std::printf("%s\n", line.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace).c_str());
  }
  return 0;
}

}  // namespace

bool use_native_weights(const std::string& weights, const Backend& backend, bool decodes) {
  if (weights == "native") return true;
  if (weights == "dense") return false;
  return decodes && backend.native_weights_fast() && backend.compute_dtype() == DType::kBF16;
}

Model::Weights weights_plan(const std::string& weights, const Backend& backend, bool decodes, bool prefills) {
  if (!use_native_weights(weights, backend, decodes)) return Model::Weights::kDense;
  if (weights == "native") return Model::Weights::kNative;  // asked for: every step on native weights
  return prefills ? Model::Weights::kNativeAndDense : Model::Weights::kNative;
}

int exit_with_error(const Status& s) {
  std::fprintf(stderr, "baton: error: %s\n", s.message().c_str());
  return s.code() == StatusCode::kInvalidArgument ? kExitUsage : kExitFailure;
}

void add_engine_commands(CLI::App& app, std::function<int()>* run) {
  auto gen = std::make_shared<GenerateArgs>();
  CLI::App* g = app.add_subcommand("generate", "Generate text in one process (no serving)");
  g->add_option("--model", gen->model, "GGUF model file, or a Hugging Face model directory")->required();
  auto* prompt = g->add_option("--prompt", gen->prompt, "Raw prompt text");
  auto* chat = g->add_option("--chat", gen->chat, "A user message, rendered with the model's chat template");
  auto* ids = g->add_option("--prompt-ids", gen->prompt_ids, "Prompt as token ids, comma-separated");
  prompt->excludes(chat)->excludes(ids);
  chat->excludes(ids);
  g->add_option("--system", gen->system, "System message for --chat");
  g->add_option("--chat-template", gen->chat_template,
                "NAME (chatml, llama2, llama3, mistral, zephyr) or a Jinja FILE (default: the model's template)");
  g->add_option("--max-tokens", gen->max_tokens, "Tokens to generate (0: prefill only)")->check(CLI::NonNegativeNumber);
  g->add_option("--temperature", gen->temperature, "0 = greedy");
  g->add_option("--top-k", gen->top_k, "Keep the k most likely tokens (0: all)");
  g->add_option("--top-p", gen->top_p, "Nucleus sampling mass in (0, 1]");
  g->add_option("--seed", gen->seed, "Sampling seed");
  g->add_option("--presence-penalty", gen->presence_penalty, "Subtracted from the logit of every token already generated");
  g->add_option("--frequency-penalty", gen->frequency_penalty, "Subtracted once per time the token was generated");
  g->add_option("--repetition-penalty", gen->repetition_penalty,
                "Hugging Face's: divides the positive (multiplies the negative) logits of prompt and output tokens");
  g->add_option("--prefill-chunk", gen->prefill_chunk, "Prompt tokens per prefill step (0: whole prompt)")
      ->check(CLI::NonNegativeNumber);
  g->add_flag("--print-ids", gen->print_ids, "Print generated token ids instead of text");
  g->add_flag("--ignore-eos", gen->ignore_eos, "Do not stop at EOS / end-of-turn tokens");
  g->add_option("--logits-out", gen->logits_out, "Write the last prompt position's logits (.npy, float32)");
  g->add_option("--logits-all-out", gen->logits_all_out, "Write every prompt position's logits (.npy, [T, vocab])");
  g->add_option("--threads", gen->threads, "CPU threads (0: all cores)")->check(CLI::NonNegativeNumber);
  g->add_option("--device", gen->device, "cpu, or cuda[:N] for the CUDA backend (bf16)");
  g->add_option("--dtype", gen->dtype, "GEMM compute type: bf16 (default where supported) or f32 (exact, CPU only)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  g->add_option("--weights", gen->weights, kWeightsHelp)->check(CLI::IsMember({"auto", "native", "dense"}));
  g->add_option("--kv-dtype", gen->kv_dtype, "KV cache type: f32, bf16 or f16 (default: bf16 with --dtype bf16 where the device computes in bf16, else f32)")->check(CLI::IsMember({"f32", "bf16", "f16"}));
  g->add_option("--block-size", gen->block_size, "KV block size in tokens")->check(CLI::Range(1, 4096));
  g->callback([gen, run, g] {
    if (g->count("--prompt") + g->count("--chat") + g->count("--prompt-ids") == 0) {
      throw CLI::ValidationError("generate", "give one of --prompt, --chat or --prompt-ids");
    }
    *run = [gen] { return run_generate(*gen); };
  });

  auto tk_model = std::make_shared<std::string>();
  auto tk_text = std::make_shared<std::string>();
  auto tk_no_special = std::make_shared<bool>(false);
  auto tk_decode = std::make_shared<std::string>();
  CLI::App* t = app.add_subcommand("tokenize", "Print the token ids of TEXT, comma-separated (or --decode ids)");
  t->add_option("--model", *tk_model, "GGUF model file, Hugging Face tokenizer.json, or a model directory")->required();
  auto* text = t->add_option("text", *tk_text, "Text to tokenize");
  auto* dec = t->add_option("--decode", *tk_decode, "Print the text of these token ids (comma-separated) instead");
  text->excludes(dec);
  t->add_flag("--no-special", *tk_no_special, "Treat special-token text as plain text");
  t->callback([=] {
    if (t->count("text") + t->count("--decode") == 0)
      throw CLI::ValidationError("tokenize", "give TEXT or --decode IDS");
    const auto decode = t->count("--decode") ? std::optional<std::string>(*tk_decode) : std::nullopt;
    *run = [=] { return run_tokenize(*tk_model, *tk_text, *tk_no_special, decode); };
  });

  auto ct = std::make_shared<ChatTemplateArgs>();
  CLI::App* c = app.add_subcommand("chat-template", "Print the prompt a chat template makes of messages");
  c->add_option("--model", ct->model, "GGUF model file or model directory: its template and special tokens");
  c->add_option("--chat-template", ct->chat_template,
                "NAME (chatml, llama2, llama3, mistral, zephyr) or a Jinja FILE (default: the model's template)");
  c->add_option("--bos-token", ct->bos_token, "bos_token's text, without --model");
  c->add_option("--eos-token", ct->eos_token, "eos_token's text, without --model");
  auto* msgs = c->add_option("--messages", ct->messages, R"(A conversation as JSON: [{"role": "user", "content": "Hi"}])");
  auto* convs = c->add_option("--conversations", ct->conversations,
                              "A JSON file of conversations; prints one JSON line per conversation");
  msgs->excludes(convs);
  c->add_flag("--no-generation-prompt", ct->no_generation_prompt, "Render without the assistant turn's opening");
  c->callback([=] {
    if (c->count("--messages") + c->count("--conversations") == 0) {
      throw CLI::ValidationError("chat-template", "give --messages JSON or --conversations FILE");
    }
    if (c->count("--model") + c->count("--chat-template") == 0) {
      throw CLI::ValidationError("chat-template", "give --model or --chat-template");
    }
    *run = [=] { return run_chat_template(*ct); };
  });

  CLI::App* tools = app.add_subcommand("tools", "Developer tools");
  tools->require_subcommand(1);
  auto spec = std::make_shared<TestModelSpec>();
  auto out = std::make_shared<std::string>();
  CLI::App* mk = tools->add_subcommand("make-test-model", "Write a small random Llama GGUF (F32) for tests");
  mk->add_option("--out", *out, "Output path")->required();
  mk->add_option("--seed", spec->seed, "Random seed");
  mk->add_option("--arch", spec->arch, "llama, qwen2 or qwen3");
  mk->add_option("--layers", spec->n_layers, "Decoder layers");
  mk->add_option("--dim", spec->dim, "Embedding width");
  mk->add_option("--heads", spec->n_heads, "Attention heads");
  mk->add_option("--kv-heads", spec->n_kv_heads, "KV heads (GQA)");
  mk->add_option("--head-dim", spec->head_dim, "qwen3: the head dim (default dim / heads)");
  mk->add_option("--ffn", spec->ffn_dim, "Feed-forward width");
  mk->add_option("--ctx", spec->n_ctx, "Context length");
  mk->add_option("--rope-theta", spec->rope_theta, "RoPE base");
  mk->add_option("--gemm-type", spec->gemm_type, "The layers' GEMM weights: f32, q4_k, q5_k, q6_k or mixed");
  auto tied = std::make_shared<bool>(false);
  mk->add_flag("--tied", *tied, "LM head tied to the embeddings instead of a separate output.weight");
  mk->callback([=] {
    *run = [=] {
      spec->tied_output = *tied;
      if (Status s = validate_test_model_spec(*spec); !s.ok()) return fail(s);
      if (Status s = make_test_model(*spec).write(*out); !s.ok()) return fail(s);
      return 0;
    };
  });
}

}  // namespace baton
