#include "client/bench_command.h"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "baton/v1/generate.grpc.pb.h"
#include "client/bench_report.h"
#include "client/channel.h"

namespace baton::ctl {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// Prompt token ids are drawn from [kMinPromptId, vocab): low ids are where vocabularies keep
// their special and byte tokens, which would make some prompts unrepresentative.
constexpr int kMinPromptId = 100;

struct BenchArgs {
  Connection connection;
  std::string model;  // "": the served model
  int n_requests = 64;
  int concurrency = 0;
  double rate = 0;
  int max_in_flight = 256;
  int prompt_tokens = 128;
  int output_tokens = 64;
  uint64_t seed = 0;
  int warmup = 0;
  double timeout = 0;
  std::string json_path;
};

class LoadRunner;

// One Generate call, owned by itself: created by the runner, deleted in OnDone (only there).
// It timestamps every token-carrying message on the gRPC callback thread that delivers it.
class BenchCall final : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  BenchCall(LoadRunner* runner, const v1::GenerateRequest* request, RequestSample* sample, double timeout,
            const Connection& connection)
      : runner_(runner), request_(request), sample_(sample) {
    set_timeout(context_, timeout);
    authorize(context_, connection);
  }

  void start(v1::Generation::Stub* stub) {
    stub->async()->Generate(&context_, request_, this);
    StartRead(&response_);
    start_ = Clock::now();
    StartCall();
  }

  // Thread-safe; the call still ends through OnDone.
  void cancel() { context_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream is over: OnDone follows with the status
    const Clock::time_point now = Clock::now();
    if (response_.token_ids_size() > 0) {
      if (sample_->ttft < 0) {
        sample_->ttft = seconds_between(start_, now);
      } else {
        sample_->itl.push_back(seconds_between(last_token_, now));
      }
      last_token_ = now;
      sample_->n_output += response_.token_ids_size();
    }
    if (response_.has_final()) {
      const v1::FinalInfo& f = response_.final();
      sample_->has_final = true;
      sample_->n_prompt = f.usage().prompt_tokens();
      sample_->server_queue = f.timing().queue_seconds();
      sample_->server_prefill = f.timing().prefill_seconds();
      sample_->server_kv_transfer = f.timing().kv_transfer_seconds();
      sample_->server_decode_queue = f.timing().decode_queue_seconds();
      sample_->server_ttft = f.timing().ttft_seconds();
      sample_->server_e2e = f.timing().e2e_seconds();
    }
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override;

 private:
  LoadRunner* runner_;
  const v1::GenerateRequest* request_;  // owned by the caller of LoadRunner::run
  RequestSample* sample_;               // written only by this call's callbacks
  grpc::ClientContext context_;
  v1::GenerateResponse response_;
  Clock::time_point start_;
  Clock::time_point last_token_;
};

// Issues requests with a bound on how many are in flight, either as fast as that allows
// (closed loop) or at Poisson arrival times (open loop), and waits for all of them.
class LoadRunner {
 public:
  struct Load {
    int concurrency = 0;    // > 0: closed loop
    double rate = 0;        // > 0: open loop, arrivals per second
    int max_in_flight = 0;  // open loop's bound
    uint64_t seed = 0;      // arrival times
  };

  // `connection` (its API key) must outlive the runner.
  LoadRunner(v1::Generation::Stub* stub, double timeout, const Connection& connection)
      : stub_(stub), timeout_(timeout), connection_(connection) {}

  // Sends requests[i] and records it into (*samples)[i]. Returns when every sent request has
  // finished; `samples` then holds the sent ones only (fewer after cancel_all()).
  void run(const std::vector<v1::GenerateRequest>& requests, const Load& load, std::vector<RequestSample>* samples) {
    samples->assign(requests.size(), RequestSample{});
    std::mt19937_64 rng(load.seed ^ 0x9e3779b97f4a7c15ULL);
    std::exponential_distribution<double> gap(load.rate > 0 ? load.rate : 1.0);
    const int bound = load.concurrency > 0 ? load.concurrency : load.max_in_flight;

    std::unique_lock lock(mu_);
    Clock::time_point arrival = Clock::now();
    size_t n_sent = 0;
    for (size_t i = 0; i < requests.size() && !stopping_; ++i) {
      if (load.rate > 0 && i > 0) {
        arrival += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(rng)));
        cv_.wait_until(lock, arrival, [&] { return stopping_; });
      }
      if (n_in_flight_ >= bound) {
        if (load.rate > 0) ++n_delayed_;
        cv_.wait(lock, [&] { return stopping_ || n_in_flight_ < bound; });
      }
      if (stopping_) break;
      auto* call = new BenchCall(this, &requests[i], &(*samples)[i], timeout_, connection_);
      calls_.insert(call);
      ++n_in_flight_;
      if (n_sent++ == 0) first_sent_ = Clock::now();
      lock.unlock();
      call->start(stub_);
      lock.lock();
    }
    cv_.wait(lock, [&] { return n_in_flight_ == 0; });
    samples->resize(n_sent);
    wall_seconds_ = n_sent > 0 ? seconds_between(first_sent_, last_done_) : 0;
  }

  // Stops issuing and cancels the calls in flight (from the interrupt watcher's thread).
  void cancel_all() {
    std::lock_guard lock(mu_);
    stopping_ = true;
    for (BenchCall* call : calls_) call->cancel();
    cv_.notify_all();
  }

  // First request sent → last one finished, of the latest run().
  double wall_seconds() const { return wall_seconds_; }
  int n_delayed() const { return n_delayed_; }

  // A call's OnDone reports in two steps around deleting itself: detach() before (so that
  // cancel_all() no longer reaches it), finished() after (so that when run() returns no reactor
  // or ClientContext is still alive, and the process may tear gRPC down).
  void detach(BenchCall* call) {
    std::lock_guard lock(mu_);
    calls_.erase(call);
  }
  void finished() {
    std::lock_guard lock(mu_);
    --n_in_flight_;
    last_done_ = Clock::now();
    cv_.notify_all();  // under the lock: run() may return, and the runner go, right after
  }

 private:
  v1::Generation::Stub* stub_;
  double timeout_;
  const Connection& connection_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::set<BenchCall*> calls_;  // in flight; guarded by mu_
  int n_in_flight_ = 0;         // guarded by mu_
  bool stopping_ = false;       // guarded by mu_
  int n_delayed_ = 0;           // guarded by mu_
  Clock::time_point first_sent_;
  Clock::time_point last_done_;  // guarded by mu_
  double wall_seconds_ = 0;
};

void BenchCall::OnDone(const grpc::Status& status) {
  sample_->e2e = seconds_between(start_, Clock::now());
  sample_->code = status_code_name(status.error_code());
  sample_->ok = status.ok();
  if (!status.ok()) {
    sample_->error = status.error_message();
  } else if (!sample_->has_final) {
    sample_->ok = false;
    sample_->code = "NO_FINAL_MESSAGE";
    sample_->error = "the stream ended without a final message";
  }
  LoadRunner* runner = runner_;
  runner->detach(this);
  delete this;
  runner->finished();
}

// `n` requests, each a prompt of exactly a.prompt_tokens random ids in [kMinPromptId, vocab).
std::vector<v1::GenerateRequest> make_requests(int n, const BenchArgs& a, const v1::ModelInfo& model,
                                               std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> id(kMinPromptId, model.vocab_size() - 1);
  std::vector<v1::GenerateRequest> requests(n);
  for (v1::GenerateRequest& r : requests) {
    r.set_model(model.name());
    for (int t = 0; t < a.prompt_tokens; ++t) r.add_prompt_token_ids(id(rng));
    r.set_max_tokens(a.output_tokens);
    r.set_ignore_eos(true);
  }
  return requests;
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
    if (!status.ok()) return fail(kExitFailure, "ListModels on " + a.connection.address + ": " + status_to_string(status));
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
  if (model->context_length() > 0 && a.prompt_tokens + a.output_tokens > model->context_length()) {
    return fail(kExitUsage, "--prompt-tokens + --output-tokens = " + std::to_string(a.prompt_tokens + a.output_tokens) +
                                " exceeds the context of model '" + model->name() + "' (" +
                                std::to_string(model->context_length()) + ")");
  }

  std::mt19937_64 rng(a.seed);
  const std::vector<v1::GenerateRequest> warmup = make_requests(a.warmup, a, *model, rng);
  const std::vector<v1::GenerateRequest> measured = make_requests(a.n_requests, a, *model, rng);

  LoadRunner::Load load{a.concurrency, a.rate, a.max_in_flight, a.seed};
  std::vector<RequestSample> samples;
  if (!warmup.empty()) {
    LoadRunner runner(stub.get(), a.timeout, a.connection);
    interrupts.on_interrupt([&runner] { runner.cancel_all(); });
    runner.run(warmup, load, &samples);
    interrupts.on_interrupt(nullptr);
    if (interrupts.interrupted()) return fail(kExitInterrupted, "interrupted during warm-up");
  }
  LoadRunner runner(stub.get(), a.timeout, a.connection);
  interrupts.on_interrupt([&runner] { runner.cancel_all(); });
  runner.run(measured, load, &samples);
  interrupts.on_interrupt(nullptr);

  BenchConfig config;
  config.address = a.connection.address;
  config.model = model->name();
  config.n_requests = a.n_requests;
  config.concurrency = a.concurrency;
  config.rate = a.rate;
  config.max_in_flight = a.rate > 0 ? a.max_in_flight : 0;
  config.prompt_tokens = a.prompt_tokens;
  config.output_tokens = a.output_tokens;
  config.seed = a.seed;
  config.warmup = a.warmup;
  config.timeout = a.timeout;
  BenchReport report = make_report(config, samples, runner.wall_seconds());
  report.n_delayed = runner.n_delayed();

  std::fputs(format_report(report).c_str(), stdout);
  std::fflush(stdout);
  if (!a.json_path.empty()) {
    std::ofstream out(a.json_path);
    out << report_to_json(report).dump(2) << "\n";
    out.close();
    if (!out) return fail(kExitFailure, "cannot write --json " + a.json_path);
  }
  if (interrupts.interrupted()) {
    return fail(kExitInterrupted, "interrupted after " + std::to_string(samples.size()) + " of " +
                                      std::to_string(a.n_requests) + " requests (the report covers those)");
  }
  if (report.n_failed > 0) {
    return fail(kExitFailure, std::to_string(report.n_failed) + " of " + std::to_string(samples.size()) +
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
  b->add_option("--requests", a->n_requests, "Measured requests")->capture_default_str()->check(CLI::PositiveNumber);
  auto* concurrency = b->add_option("--concurrency", a->concurrency, "Closed loop: requests kept in flight")
                          ->check(CLI::PositiveNumber);
  auto* rate =
      b->add_option("--rate", a->rate, "Open loop: Poisson arrivals, requests per second")->check(CLI::PositiveNumber);
  concurrency->excludes(rate);
  b->add_option("--max-in-flight", a->max_in_flight, "With --rate: most requests in flight (later arrivals wait)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber)
      ->needs(rate);
  b->add_option("--prompt-tokens", a->prompt_tokens, "Prompt length (random token ids)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  b->add_option("--output-tokens", a->output_tokens, "Tokens generated per request (ignore_eos)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  b->add_option("--seed", a->seed, "Seed of the prompt ids and arrival times")->capture_default_str();
  b->add_option("--warmup", a->warmup, "Requests run first and left out of the results")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  b->add_option("--timeout", a->timeout, "Per-request deadline in seconds (0: none)")
      ->check(CLI::NonNegativeNumber)
      ->envname("BATONCTL_TIMEOUT");
  b->add_option("--json", a->json_path, "Also write the results as JSON to this file");
  b->callback([b, a, run] {
    if (b->count("--concurrency") + b->count("--rate") != 1) {
      throw CLI::ValidationError("bench", "give one of --concurrency or --rate");
    }
    *run = [a](InterruptWatcher& interrupts) { return run_bench(*a, interrupts); };
  });
}

}  // namespace baton::ctl
