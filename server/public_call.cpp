#include "server/public_call.h"

#include <spdlog/spdlog.h>

#include <openssl/evp.h>

#include <chrono>
#include <random>

namespace baton {

PublicCall::PublicCall(FrontendContext& fc) : fc_(fc), arrival_(fc.pipeline.clock->now()) {
  if (fc_.live_calls != nullptr) fc_.live_calls->fetch_add(1);
}

PublicCall::~PublicCall() {
  if (fc_.live_calls != nullptr) fc_.live_calls->fetch_sub(1);
}

Status PublicCall::authorize(std::string_view authorization) {
  if (fc_.api_keys == nullptr) return {};
  return fc_.api_keys->check_authorization(authorization, &key_max_priority_, nullptr, &tenant_);
}

RequestBuilder PublicCall::request_builder() const { return RequestBuilder(*fc_.model, key_max_priority_, tenant_); }

void PublicCall::start(Result<ValidRequest> valid, CallDeadline deadline) {
  // No request runs longer than --max-request-seconds, whatever it asked (or did not ask) for.
  deadline = std::min(deadline, std::chrono::system_clock::now() + fc_.max_request);
  if (fc_.draining != nullptr && fc_.draining->load()) {
    refuse(unavailable("this frontend is shutting down; retry on another replica"));
    return;
  }
  if (!valid.ok()) {
    refuse(valid.status());
    return;
  }
  request_id_ = valid->pipeline.label;
  text_.emplace(*fc_.model->tokenizer, std::move(valid->stop));
  PipelineRequest& pr = valid->pipeline;
  pr.arrival = arrival_;
  pr.call_deadline = deadline;
  if (deadline != CallDeadline::max()) {
    pr.deadline = arrival_ + std::chrono::duration_cast<TimePoint::duration>(deadline - std::chrono::system_clock::now());
  }
  if (fc_.metrics) fc_.metrics->prompt_tokens_total.Add({}).Increment(static_cast<double>(pr.prompt_ids.size()));
  spdlog::info("req={}: {} prompt tokens, max_tokens {}", pr.label, pr.prompt_ids.size(), pr.max_tokens);
  auto pipeline = RequestPipeline::create(fc_.pipeline, std::move(pr), shared_from_this());
  {
    std::lock_guard<std::mutex> lock(mu_);
    pipeline_ = pipeline;
  }
  pipeline->start();
}

void PublicCall::refuse(const Status& status) {
  spdlog::info("req={} refused: {}", request_id_.empty() ? "-" : request_id_, status.to_string());
  count_end(status);
  emit_end(status, PipelineOutcome{}, std::string());
}

void PublicCall::cancel(const Status& why) {
  std::shared_ptr<RequestPipeline> pipeline;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pipeline = pipeline_;
  }
  if (pipeline != nullptr) pipeline->cancel(why);
}

void PublicCall::count_end(const Status& status) {
  if (fc_.metrics) fc_.metrics->requests_total.Add({{"code", status_code_name(status.code())}}).Increment();
}

ResponseSink::Accepted PublicCall::on_tokens(std::span<const int32_t> ids, std::span<const TokenLogprobs> logprobs) {
  Accepted a;
  std::string text;
  for (int32_t id : ids) {
    if (text_->stopped()) break;
    ++a.n;
    text += text_->push(id);
  }
  a.stop = text_->stopped();
  if (!first_token_seen_ && a.n > 0) {
    first_token_seen_ = true;
    if (fc_.metrics) {
      const auto labels = Metrics::role_labels("frontend", fc_.name);
      fc_.metrics->histogram(fc_.metrics->ttft_seconds, labels)
          .Observe(std::chrono::duration<double>(fc_.pipeline.clock->now() - arrival_).count());
    }
  }
  emit_tokens(ids.first(a.n), logprobs.empty() ? logprobs : logprobs.first(a.n), text);
  return a;
}

void PublicCall::on_failover(const std::string& reason, const Status&) {
  if (fc_.metrics) fc_.metrics->request_failovers_total.Add({{"reason", reason}}).Increment();
}

namespace {

// What a client is told of a worker: "prefill-" or "decode-" and 8 hex digits of SHA-256 over a
// salt drawn once per process and the address. The same worker gets the same label for the
// frontend's life (clients can tell which requests shared one), and the label gives nothing of
// the address away; the logs (req=..., attempt ...) name the addresses for operators.
std::string worker_label(const char* role, const std::string& address) {
  if (address.empty()) return "";  // no such worker (a decode worker prefilled locally)
  static const uint64_t salt = std::random_device()() * (uint64_t{1} << 32) ^ std::random_device()();
  std::string input(reinterpret_cast<const char*>(&salt), sizeof salt);
  input += address;
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_Digest(input.data(), input.size(), digest, &n, EVP_sha256(), nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string label = std::string(role) + "-";
  for (int i = 0; i < 4; ++i) label += {kHex[digest[i] >> 4], kHex[digest[i] & 15]};
  return label;
}

}  // namespace

void PublicCall::on_end(const Status& status, const PipelineOutcome& outcome) {
  // Responses name workers by label, never by address (Timing, the OpenAI `baton` extension).
  PipelineOutcome o = outcome;
  o.prefill_address = worker_label("prefill", outcome.prefill_address);
  o.decode_address = worker_label("decode", outcome.decode_address);
  count_end(status);
  if (!status.ok()) {
    spdlog::info("req={} ended: {}", request_id_, status.to_string());
    emit_end(status, o, std::string());
    return;
  }
  spdlog::info("req={} done: {} tokens, finish {}, ttft {:.3f}s, e2e {:.3f}s{}", request_id_, o.n_generated,
               o.finish_reason, o.ttft_seconds, o.e2e_seconds,
               o.failovers > 0 ? ", failovers " + std::to_string(o.failovers) : std::string());
  if (fc_.metrics) {
    const auto labels = Metrics::role_labels("frontend", fc_.name);
    fc_.metrics->histogram(fc_.metrics->queue_seconds, labels).Observe(o.queue_seconds);
    fc_.metrics->generation_tokens_total.Add({}).Increment(o.n_generated);
    fc_.metrics->histogram(fc_.metrics->e2e_seconds, labels).Observe(o.e2e_seconds);
    if (o.n_generated > 1) {
      fc_.metrics->histogram(fc_.metrics->tpot_seconds, labels)
          .Observe((o.e2e_seconds - o.ttft_seconds) / (o.n_generated - 1));
    }
  }
  emit_end(status, o, text_->finish());
}

}  // namespace baton
