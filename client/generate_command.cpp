#include "client/generate_command.h"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "baton/v1/generate.grpc.pb.h"
#include "client/channel.h"

namespace baton::ctl {
namespace {

using Clock = std::chrono::steady_clock;

struct GenerateArgs {
  Connection connection;
  std::string model;  // "": the served model
  std::string prompt;
  std::string chat;
  std::string system;
  std::string prompt_ids;  // "1,2,3"
  int max_tokens = 256;
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;  // sent only when given
  bool has_top_p = false;
  uint64_t seed = 0;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;
  int logprobs = -1;  // >= 0: print each token's log-probability and this many alternatives
  std::string json_schema;  // structured output: a JSON Schema file, or "object" (any JSON object)
  std::vector<std::string> stop;
  bool ignore_eos = false;
  int priority = 0;
  std::string request_id;
  double timeout = 0;  // seconds; 0: no deadline
  bool print_ids = false;
};

// "1, 2,3" → {1, 2, 3}; false on anything that is not a non-negative int32.
bool parse_ids(const std::string& text, std::vector<int32_t>* ids, std::string* error) {
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const size_t first = item.find_first_not_of(" \t");
    const size_t last = item.find_last_not_of(" \t");
    const std::string trimmed = first == std::string::npos ? "" : item.substr(first, last - first + 1);
    try {
      size_t used = 0;
      const long long v = std::stoll(trimmed, &used);
      if (used != trimmed.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument(trimmed);
      ids->push_back(static_cast<int32_t>(v));
    } catch (const std::exception&) {
      *error = "--prompt-ids: '" + item + "' is not a token id (expected e.g. 1,2,3)";
      return false;
    }
  }
  if (ids->empty()) {
    *error = "--prompt-ids: no token ids given (expected e.g. 1,2,3)";
    return false;
  }
  return true;
}

const char* finish_reason_name(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_STOP: return "stop";
    case v1::FINISH_REASON_LENGTH: return "length";
    default: return "unspecified";
  }
}

double ms(double seconds) {
  return seconds * 1e3;
}

// The final message's breakdown plus what the client saw, as one block on stderr.
void print_timing(const v1::FinalInfo& final, double client_ttft_s, double client_e2e_s, int n_tokens) {
  const v1::Timing& t = final.timing();
  std::fprintf(stderr, "finish: %s | prompt %d tokens, completion %d tokens\n",
               finish_reason_name(final.finish_reason()), final.usage().prompt_tokens(),
               final.usage().completion_tokens());
  std::fprintf(stderr,
               "queue %.1f ms | prefill %.1f ms | kv transfer %.1f ms | decode queue %.1f ms | ttft %.1f ms | "
               "e2e %.1f ms\n",
               ms(t.queue_seconds()), ms(t.prefill_seconds()), ms(t.kv_transfer_seconds()),
               ms(t.decode_queue_seconds()), ms(t.ttft_seconds()), ms(t.e2e_seconds()));
  std::fprintf(stderr, "prefill worker %s | decode worker %s\n",
               final.prefill_worker().empty() ? "-" : final.prefill_worker().c_str(),
               final.decode_worker().empty() ? "-" : final.decode_worker().c_str());
  // Decode rate over the tokens after the first: the first one's time is TTFT.
  const double decode_s = client_e2e_s - client_ttft_s;
  std::fprintf(stderr, "client: ttft %.1f ms | e2e %.1f ms | decode %.1f tok/s\n", ms(client_ttft_s), ms(client_e2e_s),
               n_tokens > 1 && decode_s > 0 ? (n_tokens - 1) / decode_s : 0.0);
}

int run_generate(const GenerateArgs& a, InterruptWatcher& interrupts) {
  v1::GenerateRequest request;
  request.set_request_id(a.request_id);
  request.set_model(a.model);
  if (!a.prompt_ids.empty()) {
    std::vector<int32_t> ids;
    std::string error;
    if (!parse_ids(a.prompt_ids, &ids, &error)) return fail(kExitUsage, error);
    request.mutable_prompt_token_ids()->Add(ids.begin(), ids.end());
  } else if (!a.chat.empty()) {
    if (!a.system.empty()) {
      v1::ChatMessage* m = request.add_messages();
      m->set_role("system");
      m->set_content(a.system);
    }
    v1::ChatMessage* m = request.add_messages();
    m->set_role("user");
    m->set_content(a.chat);
  } else {
    request.set_prompt(a.prompt);
  }
  v1::SamplingParams* sampling = request.mutable_sampling();
  sampling->set_temperature(a.temperature);
  sampling->set_top_k(a.top_k);
  if (a.has_top_p) sampling->set_top_p(a.top_p);
  sampling->set_seed(a.seed);
  sampling->set_presence_penalty(a.presence_penalty);
  sampling->set_frequency_penalty(a.frequency_penalty);
  if (a.repetition_penalty != 1.0f) sampling->set_repetition_penalty(a.repetition_penalty);
  if (a.logprobs >= 0) sampling->set_top_logprobs(a.logprobs);
  if (a.json_schema == "object") {
    sampling->mutable_response_format()->set_type(v1::ResponseFormat::JSON_OBJECT);
  } else if (!a.json_schema.empty()) {
    std::ifstream in(a.json_schema);
    std::stringstream text;
    text << in.rdbuf();
    if (!in) return fail(kExitUsage, "--json-schema: cannot read " + a.json_schema);
    sampling->mutable_response_format()->set_type(v1::ResponseFormat::JSON_SCHEMA);
    sampling->mutable_response_format()->set_json_schema(text.str());
  }
  request.set_max_tokens(a.max_tokens);
  for (const std::string& s : a.stop) request.add_stop(s);
  request.set_ignore_eos(a.ignore_eos);
  request.set_priority(a.priority);

  std::string error;
  auto channel = make_channel(a.connection, &error);
  if (!channel) return fail(kExitUsage, error);
  auto stub = v1::Generation::NewStub(channel);
  grpc::ClientContext context;
  set_timeout(context, a.timeout);
  authorize(context, a.connection);
  // Ctrl-C cancels the call: the frontend stops the workers and frees the request's KV.
  interrupts.on_interrupt([&context] { context.TryCancel(); });

  const Clock::time_point start = Clock::now();
  double ttft_s = 0;
  std::vector<int32_t> ids;
  std::vector<v1::TokenLogprob> logprobs;
  bool wrote_text = false;
  bool ends_with_newline = false;
  bool has_final = false;
  v1::FinalInfo final;

  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub->Generate(&context, request);
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    if (msg.token_ids_size() > 0 && ids.empty()) {
      ttft_s = std::chrono::duration<double>(Clock::now() - start).count();
    }
    ids.insert(ids.end(), msg.token_ids().begin(), msg.token_ids().end());
    logprobs.insert(logprobs.end(), msg.logprobs().begin(), msg.logprobs().end());
    if (!a.print_ids && !msg.text().empty()) {
      std::fwrite(msg.text().data(), 1, msg.text().size(), stdout);
      std::fflush(stdout);
      wrote_text = true;
      ends_with_newline = msg.text().back() == '\n';
    }
    if (msg.has_final()) {
      final = msg.final();
      has_final = true;
    }
  }
  const grpc::Status status = reader->Finish();
  const double e2e_s = std::chrono::duration<double>(Clock::now() - start).count();
  interrupts.on_interrupt(nullptr);

  // Finish the output line before anything goes to stderr.
  if (a.print_ids) {
    std::string line;
    for (size_t i = 0; i < ids.size(); ++i) line += (i ? "," : "") + std::to_string(ids[i]);
    if (status.ok() || !ids.empty()) std::printf("%s\n", line.c_str());
  } else if (status.ok() || (wrote_text && !ends_with_newline)) {
    std::printf("\n");
  }
  std::fflush(stdout);

  if (interrupts.interrupted()) return fail(kExitInterrupted, "interrupted: the request was cancelled");
  if (!status.ok()) return fail(kExitFailure, status_to_string(status));
  if (!has_final) return fail(kExitFailure, "the stream ended without a final message (server bug?)");
  // One line per token: its id and log-probability, then the alternatives as id:logprob.
  for (const v1::TokenLogprob& lp : logprobs) {
    std::fprintf(stderr, "token %d %.4f |", lp.token_id(), static_cast<double>(lp.logprob()));
    for (int k = 0; k < lp.top_token_ids_size() && k < lp.top_logprobs_size(); ++k) {
      std::fprintf(stderr, " %d:%.4f", lp.top_token_ids(k), static_cast<double>(lp.top_logprobs(k)));
    }
    std::fprintf(stderr, "\n");
  }
  print_timing(final, ttft_s, e2e_s, static_cast<int>(ids.size()));
  return kExitOk;
}

}  // namespace

void add_generate_command(CLI::App& app, std::function<int(InterruptWatcher&)>* run) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* g = app.add_subcommand("generate", "Stream one completion from a baton frontend");
  add_connection_flags(g, a->connection);
  g->add_option("--model", a->model, "Model name as ListModels reports it (default: the served model)")
      ->envname("BATONCTL_MODEL");
  auto* prompt = g->add_option("--prompt", a->prompt, "Raw prompt text");
  auto* chat = g->add_option("--chat", a->chat, "A user message, rendered with the model's chat template");
  auto* ids = g->add_option("--prompt-ids", a->prompt_ids, "Prompt as token ids, comma-separated (1,2,3)");
  prompt->excludes(chat)->excludes(ids);
  chat->excludes(ids);
  g->add_option("--system", a->system, "System message for --chat")->needs(chat);
  g->add_option("--max-tokens", a->max_tokens, "Tokens to generate")->capture_default_str()->check(CLI::PositiveNumber);
  g->add_option("--temperature", a->temperature, "0 = greedy")->check(CLI::NonNegativeNumber);
  g->add_option("--top-k", a->top_k, "Keep the k most likely tokens (0: all)")->check(CLI::NonNegativeNumber);
  g->add_option_function<float>(
       "--top-p",
       [a](float p) {
         a->top_p = p;
         a->has_top_p = true;
       },
       "Nucleus sampling mass in (0, 1]")
      ->check(CLI::Range(0.0f, 1.0f));
  g->add_option("--seed", a->seed, "Sampling seed: same seed, same prompt, same text");
  g->add_option("--presence-penalty", a->presence_penalty, "Subtracted from the logit of every token already generated")
      ->check(CLI::Range(-2.0f, 2.0f));
  g->add_option("--frequency-penalty", a->frequency_penalty,
                "Subtracted from a token's logit once per time it was generated")
      ->check(CLI::Range(-2.0f, 2.0f));
  g->add_option("--repetition-penalty", a->repetition_penalty,
                "Hugging Face's: divides the positive (multiplies the negative) logits of prompt and output tokens")
      ->check(CLI::Range(0.05f, 20.0f));
  g->add_option("--logprobs", a->logprobs, "Print each token's log-probability and this many alternatives (stderr)")
      ->check(CLI::Range(0, 20));
  g->add_option("--json-schema", a->json_schema,
                "Structured output: the text is a JSON document valid against this JSON Schema file (\"object\": any "
                "JSON object)");
  g->add_option("--stop", a->stop, "Stop when the text contains this string (repeatable)");
  g->add_flag("--ignore-eos", a->ignore_eos, "Keep generating past end-of-sequence tokens");
  g->add_option("--priority", a->priority, "Higher runs first when requests wait for capacity");
  g->add_option("--request-id", a->request_id, "Request id for the server's logs (default: generated)");
  g->add_option("--timeout", a->timeout, "Deadline for the whole request in seconds (0: none)")
      ->check(CLI::NonNegativeNumber)
      ->envname("BATONCTL_TIMEOUT");
  g->add_flag("--print-ids", a->print_ids, "Print the generated token ids (comma-separated) instead of text");
  g->callback([g, a, run] {
    if (g->count("--prompt") + g->count("--chat") + g->count("--prompt-ids") != 1) {
      throw CLI::ValidationError("generate", "give one of --prompt, --chat or --prompt-ids");
    }
    if (a->has_top_p && a->top_p <= 0) throw CLI::ValidationError("--top-p", "must be in (0, 1]");
    *run = [a](InterruptWatcher& interrupts) { return run_generate(*a, interrupts); };
  });
}

}  // namespace baton::ctl
