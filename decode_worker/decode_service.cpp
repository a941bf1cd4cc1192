#include "decode_worker/decode_service.h"

#include <algorithm>
#include <spdlog/spdlog.h>

#include <optional>

#include "common/grpc_status.h"
#include "common/grpc_stream_writer.h"
#include "common/tls.h"
#include "kv/tcp/tcp_transport.h"
#include "proto/convert.h"

namespace baton {
namespace {

// ---- protobuf <-> engine types (the one place) ------------------------------------------------

DecodeAdmit from_proto(const v1::AdmitRequest& r) {
  DecodeAdmit a;
  a.request_id = r.request_id();
  a.n_prompt_tokens = r.n_prompt_tokens();
  a.n_output_tokens = r.n_output_tokens();
  a.max_tokens = r.max_tokens();
  a.sampling = sampling_from_proto(r.sampling());
  a.ignore_eos = r.ignore_eos();
  a.model_fingerprint = r.model_fingerprint();
  a.prefill_tokens.assign(r.prefill_token_ids().begin(), r.prefill_token_ids().end());
  a.n_forks = r.n_forks();
  a.fork_of = r.fork_of();
  return a;
}

v1::FinishReason to_proto_finish(const std::string& reason) {
  if (reason == "stop") return v1::FINISH_REASON_STOP;
  if (reason == "length") return v1::FINISH_REASON_LENGTH;
  return v1::FINISH_REASON_UNSPECIFIED;
}

// The final event of an abnormal end carries no finish reason: the call's status says why.
v1::DecodeEvent to_proto(const DecodeOutput& o) {
  v1::DecodeEvent e;
  e.mutable_token_ids()->Add(o.token_ids.begin(), o.token_ids.end());
  e.set_done(o.done);
  for (size_t i = 0; i < o.logprobs.size() && i < o.token_ids.size(); ++i) {
    logprob_to_proto(o.token_ids[i], o.logprobs[i], e.add_logprobs());
  }
  if (o.done && o.status.ok()) e.set_finish_reason(to_proto_finish(o.finish_reason));
  e.set_decode_queue_seconds(o.decode_queue_seconds);
  e.set_kv_transfer_seconds(o.kv_transfer_seconds);
  e.set_first_token_included(o.first_token_included);
  e.set_queue_seconds(o.queue_seconds);
  e.set_prefill_seconds(o.prefill_seconds);
  e.set_cached_tokens(o.cached_tokens);
  return e;
}

void to_proto(const DecodeLoad& l, const Model& model, bool draining, DType kv_dtype,
              const std::vector<std::string>& kv_transports, v1::LoadReport* r) {
  const ModelConfig& c = model.config();
  r->set_model_fingerprint(model.fingerprint());
  r->set_free_blocks(l.free_blocks);
  r->set_total_blocks(l.total_blocks);
  r->set_block_size(l.block_size);
  r->set_running(l.n_running);
  r->set_draining(draining);
  r->set_local_prefill_max_tokens(l.local_prefill_max_tokens);
  r->set_queued_prompt_tokens(l.queued_prompt_tokens);
  r->set_step_seconds(l.step_seconds);
  r->set_prefill_tokens_per_second(l.prefill_tokens_per_second);
  model_info_to_proto(c.name, c, model.fingerprint(), "", r->mutable_model());
  for (const std::string& t : kv_transports) r->add_kv_transports(t);
  worker_identity_to_proto(dtype_name(kv_dtype), r);
}

// A gRPC deadline as a steady-clock time point; nullopt for "none" (gRPC's infinite future).
std::optional<DecodeClock::time_point> steady_deadline(std::chrono::system_clock::time_point d) {
  const auto sys_now = std::chrono::system_clock::now();
  const auto left = d - sys_now;
  if (left > std::chrono::hours(24 * 365)) return std::nullopt;
  return DecodeClock::now() + std::chrono::duration_cast<DecodeClock::duration>(left);
}

// ---- Stream ---------------------------------------------------------------------------------

// One Stream call: subscribes to the engine and writes its events in order through a
// GrpcStreamWriter (its lifetime rule: the engine's sink holds the writer, never the reactor).
class StreamReactor final : public grpc::ServerWriteReactor<v1::DecodeEvent> {
 public:
  // The request ends at the Stream call's deadline, or `cap` from now, whichever is first.
  StreamReactor(DecodeEngine& engine, grpc::CallbackServerContext* context, std::string request_id,
                std::chrono::seconds cap, const std::string& owner)
      : engine_(engine), context_(context), request_id_(std::move(request_id)), out_(std::make_shared<Writer>(this)) {
    const auto capped = DecodeClock::now() + cap;
    const auto asked = steady_deadline(context_->deadline());
    const Status st = engine_.attach(
        request_id_, [out = out_](const DecodeOutput& o) { push(*out, o); }, asked ? std::min(*asked, capped) : capped,
        owner);
    attached_ = st.ok();
    if (!st.ok()) out_->finish(to_grpc(st));
  }

  void OnWriteDone(bool ok) override {
    const std::shared_ptr<Writer> out = out_;  // Finish may delete the reactor
    out->on_write_done(ok);
  }

  // Only a request this call attached to: a Stream refused (another peer's request, or one that
  // has a stream already) must not cancel it when it is cancelled or its deadline passes.
  void OnCancel() override {
    const std::shared_ptr<Writer> out = out_;
    const bool expired = context_->deadline() <= std::chrono::system_clock::now();
    if (attached_) {
      engine_.cancel(request_id_, expired ? deadline_exceeded("the Stream call's deadline passed")
                                          : cancelled("the Stream call was cancelled"));
    }
    out->on_cancel();
  }

  void OnDone() override { delete this; }

 private:
  using Writer = GrpcStreamWriter<v1::DecodeEvent>;

  // The engine's sink (engine thread): never blocks, only queues. Tokens produced before a
  // failure still go out; the status ends the call.
  static void push(Writer& out, const DecodeOutput& o) {
    if (o.done && !o.status.ok()) {
      if (!o.token_ids.empty()) {
        DecodeOutput partial = o;
        partial.done = false;
        out.write(to_proto(partial));
      }
      out.finish(to_grpc(o.status));
      return;
    }
    out.write(to_proto(o));
    if (o.done) out.finish(grpc::Status::OK);
  }

  DecodeEngine& engine_;
  grpc::CallbackServerContext* context_;
  const std::string request_id_;
  const std::shared_ptr<Writer> out_;
  bool attached_ = false;  // the engine took this call's sink: the request is this call's to cancel
};

}  // namespace

// ---- unary RPCs and the KV hand-off -----------------------------------------------------------

grpc::ServerUnaryReactor* DecodeService::Admit(grpc::CallbackServerContext* context, const v1::AdmitRequest* request,
                                               v1::AdmitResponse* response) {
  int64_t reserved = 0;
  DecodeAdmit admit = from_proto(*request);
  // Until a Stream attaches (which sets the request's real deadline), the reservation lives at
  // most until the Admit call's deadline or the attach timeout, whichever is first: neither a
  // frontend that dies between Admit and Stream nor a caller asking for a long deadline can hold
  // blocks for long.
  const auto attach_by = DecodeClock::now() + std::min<std::chrono::seconds>(std::chrono::seconds(60), max_request_);
  const auto asked = steady_deadline(context->deadline());
  admit.deadline = asked ? std::min(*asked, attach_by) : attach_by;
  admit.owner = peer_identity(*context);
  admit.kv_sender_certificate = request->kv_sender_certificate();
  // Sizes before anything is quoted or resolved (a megabyte host name reached the resolver and
  // the refusal, which then could not travel as a status).
  for (const auto& [value, field] : {std::pair{&request->request_id(), "request_id"}, {&request->kv_sender(), "kv_sender"}}) {
    if (const Status st = check_length(*value, field); !st.ok()) {
      auto* reactor = context->DefaultReactor();
      reactor->Finish(to_grpc(st));
      return reactor;
    }
  }
  if (!request->kv_sender().empty() && admit.kv_sender_certificate.empty()) {
    admit.kv_senders = peer_hosts_of(request->kv_sender());
    if (admit.kv_senders.empty()) {
      auto* reactor = context->DefaultReactor();
      reactor->Finish(to_grpc(unavailable("cannot resolve the KV sender '" + request->kv_sender() +
                                          "' named by the Admit of request " + request->request_id())));
      return reactor;
    }
  }
  const Status st = engine_.admit(admit, &reserved);
  if (st.ok()) response->set_reserved_blocks(reserved);
  auto* reactor = context->DefaultReactor();
  reactor->Finish(to_grpc(st));
  return reactor;
}

grpc::ServerWriteReactor<v1::DecodeEvent>* DecodeService::Stream(grpc::CallbackServerContext* context,
                                                                 const v1::StreamRequest* request) {
  return new StreamReactor(engine_, context, request->request_id(), max_request_, peer_identity(*context));
}

grpc::ServerUnaryReactor* DecodeService::Release(grpc::CallbackServerContext* context,
                                                 const v1::ReleaseRequest* request, v1::ReleaseResponse* response) {
  const Status st = engine_.release(request->request_id(), peer_identity(*context));
  auto* reactor = context->DefaultReactor();
  reactor->Finish(to_grpc(st));
  return reactor;
}

grpc::ServerReadReactor<v1::KvMessage>* DecodeService::TransferKv(grpc::CallbackServerContext* context,
                                                                  v1::KvAck* response) {
  return make_kv_receive_reactor(context, response, engine_, kv_probe_);
}

grpc::ServerUnaryReactor* DecodeService::GetLoad(grpc::CallbackServerContext* context, const v1::LoadRequest* request,
                                                 v1::LoadReport* response) {
  to_proto(engine_.load(), model_, draining_, engine_.config().kv_dtype, kv_transports_, response);
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace baton
