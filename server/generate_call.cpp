// One Generate RPC on the frontend: the gRPC edge of a PublicCall (server/public_call.h, which
// admits the request, runs its pipeline and turns its tokens into text). This file parses the
// request's bytes into the call's RequestBuilder, turns text and the end into response messages,
// writes them one at a time, and turns client cancellation and deadlines into cancel().
//
// Ownership: GenerateReactor (the server-side gRPC reactor) holds the GenerateCall; the pipeline
// holds the call as its sink until it has ended. The call writes through a GrpcStreamWriter
// (common/grpc_stream_writer.h, whose lifetime rule it follows); the reactor deletes itself in
// OnDone and only there.
#include "server/frontend.h"

#include <grpcpp/impl/codegen/proto_utils.h>

#include "common/check.h"
#include "common/grpc_status.h"
#include "common/grpc_stream_writer.h"
#include "proto/convert.h"
#include "proto/utf8_fields.h"

namespace baton {
namespace {

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

// A GenerateRequest's fields, handed to the builder one by one (proto3: an empty field is unset).
Result<ValidRequest> read_request(const v1::GenerateRequest& r, const ServedModel& model, RequestBuilder b) {
  if (!r.request_id().empty()) BATON_RETURN_IF_ERROR(b.request_id(r.request_id()));
  if (!r.model().empty() && r.model() != model.name) {
    return invalid_argument("model " + quote_input(r.model()) + " is not served here (ListModels: '" + model.name +
                            "')");
  }
  if (!r.prompt().empty()) BATON_RETURN_IF_ERROR(b.prompt_text(r.prompt()));
  if (r.prompt_token_ids_size() > 0) {
    BATON_RETURN_IF_ERROR(b.prompt_ids({r.prompt_token_ids().data(), static_cast<size_t>(r.prompt_token_ids_size())},
                                       "prompt_token_ids"));
  }
  if (r.messages_size() > 0) {
    std::vector<ChatMessage> messages;
    for (const v1::ChatMessage& m : r.messages()) messages.push_back({m.role(), m.content()});
    BATON_RETURN_IF_ERROR(b.messages(messages));
  }
  b.max_tokens(r.max_tokens());
  BATON_RETURN_IF_ERROR(b.sampling(sampling_from_proto(r.sampling()), "sampling."));
  BATON_RETURN_IF_ERROR(b.stop({r.stop().begin(), r.stop().end()}));
  b.ignore_eos(r.ignore_eos());
  BATON_RETURN_IF_ERROR(b.priority(r.priority()));
  BATON_RETURN_IF_ERROR(b.ttft_slo(r.ttft_slo_seconds(), "ttft_slo_seconds"));
  BATON_RETURN_IF_ERROR(b.cache_salt(r.cache_salt(), "cache_salt"));
  return std::move(b).build();
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

class GenerateCall final : public PublicCall {
 public:
  GenerateCall(FrontendContext& fc, grpc::CallbackServerContext* context, GenerateReactor* reactor);

  // Checks the key, parses the request's bytes, then starts its pipeline (or ends the call).
  void begin(const grpc::ByteBuffer& bytes);
  void on_write_done(bool ok);
  void on_cancel();

 private:
  using Writer = GrpcStreamWriter<grpc::ByteBuffer>;

  void emit_tokens(std::span<const int32_t> ids, std::span<const TokenLogprobs> logprobs,
                   const std::string& text) override;
  void emit_end(const Status& status, const PipelineOutcome& outcome, const std::string& tail) override;

  grpc::CallbackServerContext* server_ctx_;
  const std::shared_ptr<Writer> out_;  // serialized responses (the writer's lifetime rule)
};

class GenerateReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  GenerateReactor(FrontendContext& fc, grpc::CallbackServerContext* context, const grpc::ByteBuffer* request)
      : call_(std::make_shared<GenerateCall>(fc, context, this)) {
    call_->begin(*request);
  }
  // Local copies: the writer may Finish inside, and OnDone delete the reactor (and its call_).
  void OnWriteDone(bool ok) override {
    const std::shared_ptr<GenerateCall> call = call_;
    call->on_write_done(ok);
  }
  void OnCancel() override {
    const std::shared_ptr<GenerateCall> call = call_;
    call->on_cancel();
  }
  void OnDone() override { delete this; }

 private:
  std::shared_ptr<GenerateCall> call_;
};

GenerateCall::GenerateCall(FrontendContext& fc, grpc::CallbackServerContext* context, GenerateReactor* reactor)
    : PublicCall(fc), server_ctx_(context), out_(std::make_shared<Writer>(reactor)) {}

void GenerateCall::begin(const grpc::ByteBuffer& bytes) {
  const auto& metadata = server_ctx_->client_metadata();
  const auto auth = metadata.find("authorization");
  const std::string_view authorization =
      auth == metadata.end() ? std::string_view() : std::string_view(auth->second.data(), auth->second.size());
  if (Status st = authorize(authorization); !st.ok()) {
    refuse(st);
    return;
  }
  v1::GenerateRequest request;
  grpc::ByteBuffer copy(bytes);  // Deserialize consumes its buffer
  if (!grpc::SerializationTraits<v1::GenerateRequest>::Deserialize(&copy, &request).ok()) {
    refuse(invalid_argument(malformed_request_message(bytes)));
    return;
  }
  start(read_request(request, *frontend().model, request_builder()), server_ctx_->deadline());
}

void GenerateCall::emit_tokens(std::span<const int32_t> ids, std::span<const TokenLogprobs> logprobs,
                               const std::string& text) {
  v1::GenerateResponse msg;
  msg.set_request_id(request_id());
  for (int32_t id : ids) msg.add_token_ids(id);
  for (size_t i = 0; i < logprobs.size(); ++i) logprob_to_proto(ids[i], logprobs[i], msg.add_logprobs());
  msg.set_text(text);
  out_->write(serialize(msg));
}

// A failed request ends with its status at once: what is queued and not yet written is dropped.
void GenerateCall::emit_end(const Status& status, const PipelineOutcome& o, const std::string& tail) {
  if (!status.ok()) {
    if (status.retry_after_seconds() > 0) {
      server_ctx_->AddTrailingMetadata("retry-after", std::to_string(status.retry_after_seconds()));
    }
    out_->finish(to_grpc(status), Writer::Queued::kDrop);
    return;
  }
  v1::GenerateResponse msg;
  msg.set_request_id(request_id());
  msg.set_text(tail);
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
  out_->write(serialize(msg));
  out_->finish(grpc::Status::OK);
}

// The client went away: the pipeline is cancelled (its end, emitted after, is dropped).
void GenerateCall::on_write_done(bool ok) {
  if (!out_->on_write_done(ok)) cancel(cancelled("the client stream broke"));
}

void GenerateCall::on_cancel() {
  if (out_->ending()) return;
  // gRPC reports its own deadline, and the server's shutdown at the end of a drain, as a
  // cancellation: name the server-side causes as such (metrics and logs count them apart).
  const bool expired = server_ctx_->deadline() <= std::chrono::system_clock::now();
  const bool drained = frontend().draining != nullptr && frontend().draining->load();
  if (expired) {
    cancel(deadline_exceeded("the request's deadline passed"));
  } else if (drained) {
    cancel(unavailable("this frontend shut down before the request finished (its drain timeout passed); "
                       "retry on another replica"));
  } else {
    cancel(cancelled("the client cancelled the request"));
  }
  out_->on_cancel();
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* start_generate_call(FrontendContext& fc, grpc::CallbackServerContext* context,
                                                                const grpc::ByteBuffer* request) {
  return new GenerateReactor(fc, context, request);
}

}  // namespace baton
