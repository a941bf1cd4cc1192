#include "server/generate_call.h"

#include <grpcpp/impl/codegen/proto_utils.h>
#include <spdlog/spdlog.h>

#include "common/check.h"
#include "common/grpc_status.h"
#include "proto/utf8_fields.h"
#include "server/text_stream.h"

namespace baton {
namespace {

using SteadyTime = std::chrono::steady_clock;

// Why a GenerateRequest did not parse: the field that is not UTF-8, when that is it.
std::string malformed_request_message(const grpc::ByteBuffer& bytes) {
  grpc::Slice slice;
  std::string raw;
  if (bytes.DumpToSingleSlice(&slice).ok()) raw.assign(reinterpret_cast<const char*>(slice.begin()), slice.size());
  if (auto field = first_non_utf8_field(*v1::GenerateRequest::descriptor(), raw)) {
    return "field '" + *field + "' is not valid UTF-8: send text as UTF-8";
  }
  return "the request is not a valid baton.v1.GenerateRequest (malformed protobuf bytes)";
}

grpc::ByteBuffer serialize(const v1::GenerateResponse& msg) {
  grpc::ByteBuffer bytes;
  bool own = false;
  const grpc::Status s = grpc::SerializationTraits<v1::GenerateResponse>::Serialize(msg, &bytes, &own);
  BATON_CHECK(s.ok(), "serializing a GenerateResponse failed: %s", s.error_message().c_str());
  return bytes;
}

}  // namespace

class GenerateReactor;

class GenerateCall final : public ResponseSink, public std::enable_shared_from_this<GenerateCall> {
 public:
  GenerateCall(FrontendContext& fc, grpc::CallbackServerContext* context, GenerateReactor* reactor)
      : fc_(fc), server_ctx_(context), reactor_(reactor), arrival_(fc.pipeline.clock->now()) {
    if (fc_.live_calls != nullptr) fc_.live_calls->fetch_add(1);
  }
  ~GenerateCall() override {
    if (fc_.live_calls != nullptr) fc_.live_calls->fetch_sub(1);
  }

  // Parses and validates the request's bytes, then starts its pipeline (or ends the call).
  void start(const grpc::ByteBuffer& bytes);
  void on_write_done(bool ok);
  void on_cancel();

  // ResponseSink (called with the pipeline's mutex held).
  Accepted on_tokens(std::span<const int32_t> ids) override;
  void on_failover(const std::string& reason, const Status& cause) override;
  void on_end(const Status& status, const PipelineOutcome& outcome) override;

 private:
  // Ends a call that never got a pipeline.
  void refuse(const Status& status);
  void count_end(const Status& status);
  void pump_locked();

  FrontendContext& fc_;
  grpc::CallbackServerContext* server_ctx_;
  GenerateReactor* reactor_;  // valid until Finish is called on it (guarded by mu_)
  const TimePoint arrival_;
  std::shared_ptr<RequestPipeline> pipeline_;  // set once by start()

  std::mutex mu_;
  GenerateSpec spec_;
  std::optional<TextStream> text_;
  bool first_token_seen_ = false;
  // Outgoing messages, serialized; one write in flight at a time.
  std::deque<grpc::ByteBuffer> out_;
  bool writing_ = false;
  bool ending_ = false;  // the final status is decided
  bool finish_called_ = false;
  grpc::Status final_status_;
};

class GenerateReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  GenerateReactor(FrontendContext& fc, grpc::CallbackServerContext* context, const grpc::ByteBuffer* request)
      : call_(std::make_shared<GenerateCall>(fc, context, this)) {
    call_->start(*request);
  }
  void OnWriteDone(bool ok) override { call_->on_write_done(ok); }
  void OnCancel() override { call_->on_cancel(); }
  void OnDone() override { delete this; }

 private:
  std::shared_ptr<GenerateCall> call_;
};

void GenerateCall::start(const grpc::ByteBuffer& bytes) {
  std::optional<int32_t> key_max_priority;  // a privileged key's bound
  if (fc_.api_keys != nullptr) {
    if (Status st = fc_.api_keys->check(*server_ctx_, &key_max_priority); !st.ok()) {
      refuse(st);
      return;
    }
  }
  v1::GenerateRequest request;
  grpc::ByteBuffer copy(bytes);  // Deserialize consumes its buffer
  if (!grpc::SerializationTraits<v1::GenerateRequest>::Deserialize(&copy, &request).ok()) {
    refuse(invalid_argument(malformed_request_message(bytes)));
    return;
  }
  if (fc_.draining != nullptr && fc_.draining->load()) {
    refuse(unavailable("this frontend is shutting down; retry on another replica"));
    return;
  }
  // A client that names no request gets a random public id (the workers see other ids).
  auto spec = make_generate_spec(request, *fc_.model, "req-" + random_request_id().substr(0, 16), key_max_priority);
  if (!spec.ok()) {
    refuse(spec.status());
    return;
  }
  PipelineRequest pr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    spec_ = std::move(*spec);
    text_.emplace(*fc_.model->tokenizer, spec_.stop);
    pr.label = spec_.request_id;
    pr.prompt_ids = spec_.prompt_ids;
    pr.max_tokens = spec_.max_tokens;
    pr.sampling = spec_.sampling;
    pr.ignore_eos = spec_.ignore_eos;
    pr.stop_ids = fc_.model->tokenizer->stop_ids();
    pr.priority = spec_.priority;
    pr.model_fingerprint = fc_.model->fingerprint;
    pr.arrival = arrival_;
    pr.call_deadline = server_ctx_->deadline();
    if (pr.call_deadline != CallDeadline::max()) {
      pr.deadline = arrival_ + std::chrono::duration_cast<TimePoint::duration>(pr.call_deadline -
                                                                              std::chrono::system_clock::now());
    }
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

void GenerateCall::refuse(const Status& status) {
  spdlog::info("req={} refused: {}", spec_.request_id.empty() ? "-" : spec_.request_id, status.to_string());
  count_end(status);
  std::lock_guard<std::mutex> lock(mu_);
  ending_ = true;
  final_status_ = to_grpc(status);
  pump_locked();
}

void GenerateCall::count_end(const Status& status) {
  if (fc_.metrics) fc_.metrics->requests_total.Add({{"code", status_code_name(status.code())}}).Increment();
}

ResponseSink::Accepted GenerateCall::on_tokens(std::span<const int32_t> ids) {
  std::lock_guard<std::mutex> lock(mu_);
  Accepted a;
  if (ending_) return a;
  v1::GenerateResponse msg;
  msg.set_request_id(spec_.request_id);
  std::string text;
  for (int32_t id : ids) {
    if (text_->stopped()) break;
    msg.add_token_ids(id);
    ++a.n;
    text += text_->push(id);
  }
  a.stop = text_->stopped();
  msg.set_text(text);
  out_.push_back(serialize(msg));
  if (!first_token_seen_ && a.n > 0) {
    first_token_seen_ = true;
    if (fc_.metrics) {
      const auto labels = Metrics::role_labels("frontend", fc_.name);
      fc_.metrics->histogram(fc_.metrics->ttft_seconds, labels)
          .Observe(std::chrono::duration<double>(fc_.pipeline.clock->now() - arrival_).count());
    }
  }
  pump_locked();
  return a;
}

void GenerateCall::on_failover(const std::string& reason, const Status&) {
  if (fc_.metrics) fc_.metrics->request_failovers_total.Add({{"reason", reason}}).Increment();
}

void GenerateCall::on_end(const Status& status, const PipelineOutcome& o) {
  count_end(status);
  std::lock_guard<std::mutex> lock(mu_);
  if (status.ok()) {
    v1::GenerateResponse msg;
    msg.set_request_id(spec_.request_id);
    msg.set_text(text_->finish());
    auto* fin = msg.mutable_final();
    fin->set_finish_reason(o.finish_reason == "length" ? v1::FINISH_REASON_LENGTH : v1::FINISH_REASON_STOP);
    fin->mutable_usage()->set_prompt_tokens(o.n_prompt_tokens);
    fin->mutable_usage()->set_completion_tokens(o.n_generated);
    auto* t = fin->mutable_timing();
    t->set_queue_seconds(o.queue_seconds);
    t->set_prefill_seconds(o.prefill_seconds);
    t->set_kv_transfer_seconds(o.kv_transfer_seconds);
    t->set_decode_queue_seconds(o.decode_queue_seconds);
    t->set_ttft_seconds(o.ttft_seconds);
    t->set_e2e_seconds(o.e2e_seconds);
    t->set_failovers(o.failovers);
    t->set_cached_prompt_tokens(o.cached_prompt_tokens);
    fin->set_prefill_worker(o.prefill_address);
    fin->set_decode_worker(o.decode_address);
    out_.push_back(serialize(msg));
    spdlog::info("req={} done: {} tokens, finish {}, ttft {:.3f}s, e2e {:.3f}s{}", spec_.request_id, o.n_generated,
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
  } else {
    while (out_.size() > (writing_ ? 1u : 0u)) out_.pop_back();  // the front may be in flight
    spdlog::info("req={} ended: {}", spec_.request_id, status.to_string());
  }
  ending_ = true;
  final_status_ = to_grpc(status);
  pump_locked();
}

void GenerateCall::pump_locked() {
  if (writing_ || finish_called_ || reactor_ == nullptr) return;
  if (!out_.empty()) {
    writing_ = true;
    reactor_->StartWrite(&out_.front());
    return;
  }
  if (ending_) {
    finish_called_ = true;
    GenerateReactor* r = reactor_;
    reactor_ = nullptr;
    r->Finish(final_status_);
  }
}

void GenerateCall::on_write_done(bool ok) {
  std::shared_ptr<RequestPipeline> pipeline;
  {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!out_.empty()) out_.pop_front();
    if (ok) {
      pump_locked();
      return;
    }
    out_.clear();  // the client went away: nothing more can reach it
    pipeline = pipeline_;
    if (pipeline == nullptr || ending_) {
      pump_locked();
      return;
    }
  }
  pipeline->cancel(cancelled("the client stream broke"));  // on_end finishes the call
}

void GenerateCall::on_cancel() {
  std::shared_ptr<RequestPipeline> pipeline;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ending_) return;
    pipeline = pipeline_;
  }
  if (pipeline == nullptr) return;
  // gRPC reports its own deadline, and the server's shutdown at the end of a drain, as a
  // cancellation: name the server-side causes as such (metrics and logs count them apart).
  const bool expired = server_ctx_->deadline() <= std::chrono::system_clock::now();
  const bool drained = fc_.draining != nullptr && fc_.draining->load();
  if (expired) {
    pipeline->cancel(deadline_exceeded("the request's deadline passed"));
  } else if (drained) {
    pipeline->cancel(unavailable("this frontend shut down before the request finished (its drain timeout passed); "
                                 "retry on another replica"));
  } else {
    pipeline->cancel(cancelled("the client cancelled the request"));
  }
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* start_generate_call(FrontendContext& fc, grpc::CallbackServerContext* context,
                                                                const grpc::ByteBuffer* request) {
  return new GenerateReactor(fc, context, request);
}

}  // namespace baton
