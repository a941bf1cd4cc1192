#include "client/bench_command.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "baton/v1/generate.grpc.pb.h"
#include "client/bench_plot.h"
#include "client/bench_report.h"
#include "client/bench_workload.h"
#include "client/channel.h"
#include "client/load_runner.h"

namespace baton::ctl {
namespace {

struct BenchArgs {
  Connection connection;
  std::string model;  // "": the served model
  std::string workload = "random";
  int n_requests = 64;
  double duration = 0;
  int concurrency = 0;
  double rate = 0;
  int max_in_flight = 256;
  int prompt_tokens = 128;
  int long_prompt_tokens = 0;
  double long_fraction = 0;
  int output_tokens = 64;
  int conversations = 8;
  int turns = 4;
  int system_prompt_tokens = 128;
  uint64_t seed = 0;
  int warmup = 0;
  double timeout = 0;
  std::string json_path;
  std::vector<std::string> plot_paths;
  Slo slo;
};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool write_file(const std::string& path, const std::string& content) {
  std::ofstream out(path, std::ios::binary);
  out << content;
  out.close();
  return static_cast<bool>(out);
}

int run_bench(const BenchArgs& a, InterruptWatcher& interrupts) {
  std::string error;
  auto channel = make_channel(a.connection, &error);
  if (!channel) return fail(kExitUsage, error);
  auto stub = v1::Generation::NewStub(channel);

  v1::ListModelsResponse models;
  {
    grpc::ClientContext context;
    set_timeout(context, a.timeout > 0 ? a.timeout : 30);
    authorize(context, a.connection);
    interrupts.on_interrupt([&context] { context.TryCancel(); });
    const grpc::Status status = stub->ListModels(&context, v1::ListModelsRequest{}, &models);
    interrupts.on_interrupt(nullptr);
    if (interrupts.interrupted()) return fail(kExitInterrupted, "interrupted");
    if (!status.ok())
      return fail(kExitFailure, "ListModels on " + a.connection.address + ": " + status_to_string(status));
  }
  const v1::ModelInfo* model = nullptr;
  std::string served;
  for (const v1::ModelInfo& m : models.models()) {
    served += (served.empty() ? "" : ", ") + m.name();
    if (a.model.empty() ? model == nullptr : m.name() == a.model) model = &m;
  }
  if (model == nullptr) {
    return fail(kExitFailure, a.model.empty() ? "the server lists no models"
                                              : "model '" + a.model + "' is not served here (served: " + served + ")");
  }
  if (model->vocab_size() <= kMinPromptId) {
    return fail(kExitFailure, "model '" + model->name() + "' has " + std::to_string(model->vocab_size()) +
                                  " tokens; bench draws prompt ids from [100, vocab)");
  }
  const bool chat = a.workload == "chat";
  const ChatWorkloadConfig chat_config{a.conversations,     a.turns, a.system_prompt_tokens, a.prompt_tokens,
                                       model->vocab_size(), a.seed};
  const int64_t longest_prompt =
      chat ? chat_longest_prompt(chat_config, a.output_tokens) : std::max(a.prompt_tokens, a.long_prompt_tokens);
  if (model->context_length() > 0 && longest_prompt + a.output_tokens > model->context_length()) {
    const std::string what = chat ? "the last chat turn's prompt (--system-prompt-tokens + --turns x --prompt-tokens + "
                                    "(--turns - 1) x --output-tokens) + --output-tokens"
                                  : "the longest of --prompt-tokens and --long-prompt-tokens, + --output-tokens";
    return fail(kExitUsage, what + " = " + std::to_string(longest_prompt + a.output_tokens) +
                                " exceeds the context of model '" + model->name() + "' (" +
                                std::to_string(model->context_length()) + ")");
  }

  const RequestShape shape{model->name(), a.output_tokens};
  Load load{a.concurrency, a.rate, a.max_in_flight, a.seed, 0};
  if (a.warmup > 0) {
    // Warm-up: random prompts as long as a first turn, under the same load.
    auto warmup = make_random_workload(
        RandomWorkloadConfig{a.warmup, chat ? a.system_prompt_tokens + a.prompt_tokens : a.prompt_tokens,
                             model->vocab_size(), a.seed ^ 0x5bd1e995ULL});
    LoadRunner runner(stub.get(), a.timeout, a.connection);
    interrupts.on_interrupt([&runner] { runner.cancel_all(); });
    runner.run(*warmup, shape, load);
    interrupts.on_interrupt(nullptr);
    if (interrupts.interrupted()) return fail(kExitInterrupted, "interrupted during warm-up");
  }
  std::unique_ptr<Workload> workload =
      chat ? make_chat_workload(chat_config)
           : make_random_workload(RandomWorkloadConfig{a.duration > 0 ? -1 : a.n_requests, a.prompt_tokens,
                                                       model->vocab_size(), a.seed, a.long_prompt_tokens,
                                                       a.long_fraction});
  load.duration = a.duration;
  LoadRunner runner(stub.get(), a.timeout, a.connection);
  interrupts.on_interrupt([&runner] { runner.cancel_all(); });
  std::vector<RequestSample> samples = runner.run(*workload, shape, load);
  interrupts.on_interrupt(nullptr);
  const size_t n_sent = samples.size();
  const int n_planned = chat ? a.conversations * a.turns : a.n_requests;

  BenchConfig config;
  config.address = a.connection.address;
  config.model = model->name();
  config.workload = a.workload;
  config.n_requests = a.duration > 0 ? static_cast<int>(n_sent) : n_planned;
  config.duration = a.duration;
  config.concurrency = a.concurrency;
  config.rate = a.rate;
  config.max_in_flight = a.rate > 0 ? a.max_in_flight : 0;
  config.prompt_tokens = a.prompt_tokens;
  config.long_prompt_tokens = chat ? 0 : a.long_prompt_tokens;
  config.long_fraction = chat ? 0 : a.long_fraction;
  config.output_tokens = a.output_tokens;
  if (chat) {
    config.conversations = a.conversations;
    config.turns = a.turns;
    config.system_prompt_tokens = a.system_prompt_tokens;
  }
  config.seed = a.seed;
  config.warmup = a.warmup;
  config.timeout = a.timeout;
  config.slo = a.slo;
  BenchReport report = make_report(config, std::move(samples), runner.wall_seconds());
  report.n_delayed = runner.n_delayed();

  std::fputs(format_report(report).c_str(), stdout);
  std::fflush(stdout);
  if (!a.json_path.empty() && !write_file(a.json_path, report_to_json(report).dump(2) + "\n")) {
    return fail(kExitFailure, "cannot write --json " + a.json_path);
  }
  for (const std::string& path : a.plot_paths) {
    const std::string content = ends_with(path, ".html") ? bench_plot_html(report) : bench_plot_svg(report);
    if (!write_file(path, content)) return fail(kExitFailure, "cannot write --plot " + path);
  }
  if (interrupts.interrupted()) {
    return fail(kExitInterrupted, "interrupted after " + std::to_string(n_sent) + " of " +
                                      (a.duration > 0 ? std::string("the") : std::to_string(n_planned)) +
                                      " requests (the report covers those)");
  }
  if (report.n_failed > 0) {
    return fail(kExitFailure, std::to_string(report.n_failed) + " of " + std::to_string(n_sent) +
                                  " requests failed; first: " + report.first_error);
  }
  return kExitOk;
}

}  // namespace

void add_bench_command(CLI::App& app, std::function<int(InterruptWatcher&)>* run) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* b = app.add_subcommand("bench", "Load-test a baton frontend and summarise latencies");
  add_connection_flags(b, a->connection);
  b->add_option("--model", a->model, "Model name as ListModels reports it (default: the served model)")
      ->envname("BATONCTL_MODEL");
  b->add_option("--workload", a->workload,
                "random: one-turn requests of random ids; chat: multi-turn conversations sharing a system prompt")
      ->capture_default_str()
      ->check(CLI::IsMember({"random", "chat"}));
  auto* requests = b->add_option("--requests", a->n_requests, "Measured requests (random)")
                       ->capture_default_str()
                       ->check(CLI::PositiveNumber);
  auto* duration =
      b->add_option("--duration", a->duration,
                    "Instead of --requests: send for this many seconds, then wait for those in flight (random)")
          ->check(CLI::PositiveNumber);
  requests->excludes(duration);
  auto* concurrency =
      b->add_option("--concurrency", a->concurrency, "Closed loop: requests (chat: conversations) kept in flight")
          ->check(CLI::PositiveNumber);
  auto* rate = b->add_option("--rate", a->rate,
                             "Open loop: Poisson arrivals (exponential gaps, seeded by --seed) of requests (chat: "
                             "conversations) per second")
                   ->check(CLI::PositiveNumber);
  concurrency->excludes(rate);
  b->add_option("--max-in-flight", a->max_in_flight, "With --rate: most requests in flight (later arrivals wait)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber)
      ->needs(rate);
  b->add_option("--prompt-tokens", a->prompt_tokens, "Prompt length (random ids); chat: each user message")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  auto* long_prompt = b->add_option("--long-prompt-tokens", a->long_prompt_tokens,
                                    "Random: a mixed workload, some prompts this long (see --long-fraction)")
                          ->check(CLI::PositiveNumber);
  b->add_option("--long-fraction", a->long_fraction,
                "Random: the share of prompts --long-prompt-tokens long (drawn per request from --seed)")
      ->check(CLI::Range(0.0, 1.0))
      ->needs(long_prompt);
  b->add_option("--output-tokens", a->output_tokens, "Tokens generated per request (ignore_eos)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  auto* conversations = b->add_option("--conversations", a->conversations, "Chat: conversations")
                            ->capture_default_str()
                            ->check(CLI::PositiveNumber);
  auto* turns = b->add_option("--turns", a->turns, "Chat: turns per conversation")
                    ->capture_default_str()
                    ->check(CLI::PositiveNumber);
  auto* system_prompt = b->add_option("--system-prompt-tokens", a->system_prompt_tokens,
                                      "Chat: system prompt length, the same ids in every conversation")
                            ->capture_default_str()
                            ->check(CLI::NonNegativeNumber);
  b->add_option("--seed", a->seed, "Seed of the prompt ids and arrival times")->capture_default_str();
  b->add_option("--warmup", a->warmup, "Requests run first and left out of the results")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  b->add_option("--timeout", a->timeout, "Per-request deadline in seconds (0: none)")
      ->check(CLI::NonNegativeNumber)
      ->envname("BATONCTL_TIMEOUT");
  auto slo_ttft = std::make_shared<double>(0);
  auto slo_itl = std::make_shared<double>(0);
  auto* ttft_option =
      b->add_option("--slo-ttft", *slo_ttft, "SLO: time to first token, seconds (goodput counts requests within it)")
          ->check(CLI::PositiveNumber);
  auto* itl_option =
      b->add_option("--slo-itl", *slo_itl, "SLO: a request's p99 inter-token gap (its max below 100 gaps), seconds")
          ->check(CLI::PositiveNumber);
  b->add_option("--json", a->json_path, "Also write the results as JSON to this file");
  b->add_option("--plot", a->plot_paths, "Also draw the run into this .svg (or .html) file; may be repeated")
      ->each([](const std::string& path) {
        if (!ends_with(path, ".svg") && !ends_with(path, ".html")) {
          throw CLI::ValidationError("--plot", "'" + path + "' must end in .svg or .html");
        }
      });
  b->callback([b, a, run, slo_ttft, slo_itl, ttft_option, itl_option, requests, conversations, turns, system_prompt] {
    if (b->count("--concurrency") + b->count("--rate") != 1) {
      throw CLI::ValidationError("bench", "give one of --concurrency or --rate");
    }
    if (a->workload == "chat") {
      if (requests->count() > 0 || b->count("--duration") > 0) {
        throw CLI::ValidationError("bench",
                                   "--workload chat sends --conversations x --turns requests: "
                                   "--requests and --duration do not apply");
      }
    } else if (conversations->count() + turns->count() + system_prompt->count() > 0) {
      throw CLI::ValidationError("bench", "--conversations, --turns and --system-prompt-tokens need --workload chat");
    }
    if (ttft_option->count() > 0) a->slo.ttft_seconds = *slo_ttft;
    if (itl_option->count() > 0) a->slo.itl_seconds = *slo_itl;
    *run = [a](InterruptWatcher& interrupts) { return run_bench(*a, interrupts); };
  });
}

}  // namespace baton::ctl
