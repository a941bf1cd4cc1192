#include "server/grpc_worker_client.h"

#include <memory>

#include "common/grpc_status.h"
#include "proto/convert.h"

namespace baton {
namespace {

v1::AdmitRequest to_proto(const AdmitCall& c) {
  v1::AdmitRequest r;
  r.set_request_id(c.request_id);
  r.set_n_prompt_tokens(c.n_prompt_tokens);
  r.set_n_output_tokens(c.n_output_tokens);
  r.set_max_tokens(c.max_tokens);
  sampling_to_proto(c.sampling, r.mutable_sampling());
  r.set_ignore_eos(c.ignore_eos);
  r.set_model_fingerprint(c.model_fingerprint);
  r.set_kv_sender(c.kv_sender);
  r.set_kv_sender_certificate(c.kv_sender_certificate);
  r.mutable_prefill_token_ids()->Add(c.prefill_ids.begin(), c.prefill_ids.end());
  r.set_n_forks(c.n_forks);
  r.set_fork_of(c.fork_of);
  return r;
}

v1::PrefillRequest to_proto(const PrefillCall& c) {
  v1::PrefillRequest r;
  r.set_request_id(c.request_id);
  r.mutable_prompt_token_ids()->Add(c.prompt_ids.begin(), c.prompt_ids.end());
  r.mutable_generated_token_ids()->Add(c.generated_ids.begin(), c.generated_ids.end());
  sampling_to_proto(c.sampling, r.mutable_sampling());
  r.set_decode_address(c.decode_address);
  return r;
}

// An event with neither part set (a newer worker's kind) yields nothing.
std::optional<PrefillUpdate> from_proto(const v1::PrefillEvent& e) {
  PrefillUpdate u;
  if (e.has_first_token()) {
    u.kind = PrefillUpdate::Kind::kFirstToken;
    u.token_id = e.first_token().token_id();
    u.queue_seconds = e.first_token().queue_seconds();
    u.prefill_seconds = e.first_token().prefill_seconds();
    u.cached_tokens = e.first_token().cached_tokens();
    if (e.first_token().has_logprob()) u.logprobs = logprob_from_proto(e.first_token().logprob());
    return u;
  }
  if (e.has_progress()) {
    u.kind = PrefillUpdate::Kind::kProgress;
    u.tokens_done = e.progress().tokens_done();
    return u;
  }
  if (e.has_kv_sent()) {
    u.kind = PrefillUpdate::Kind::kKvSent;
    u.transfer_seconds = e.kv_sent().transfer_seconds();
    return u;
  }
  return std::nullopt;
}

DecodeUpdate from_proto(const v1::DecodeEvent& e) {
  DecodeUpdate u;
  u.token_ids.assign(e.token_ids().begin(), e.token_ids().end());
  for (const v1::TokenLogprob& lp : e.logprobs()) u.logprobs.push_back(logprob_from_proto(lp));
  u.done = e.done();
  u.length = e.finish_reason() == v1::FINISH_REASON_LENGTH;
  u.decode_queue_seconds = e.decode_queue_seconds();
  u.kv_transfer_seconds = e.kv_transfer_seconds();
  u.first_token_included = e.first_token_included();
  u.queue_seconds = e.queue_seconds();
  u.prefill_seconds = e.prefill_seconds();
  u.cached_tokens = e.cached_tokens();
  return u;
}

// A server-streaming worker call on the callback API. Deletes itself in OnDone, after `done`
// has returned (so the handle is valid until then, as worker_client.h promises).
template <typename Request, typename Event, typename Update>
class StreamCall final : public grpc::ClientReadReactor<Event>, public WorkerCall {
 public:
  StreamCall(Request request, CallDeadline deadline, std::function<void(const Update&)> on_update,
             WorkerClient::Done done)
      : request_(std::move(request)), on_update_(std::move(on_update)), done_(std::move(done)) {
    ctx_.set_deadline(deadline);
  }
  template <typename StartRpc>
  void begin(StartRpc&& start_rpc) {
    start_rpc(&ctx_, &request_, this);
    this->StartRead(&event_);
    this->StartCall();
  }
  void cancel() override { ctx_.TryCancel(); }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    if constexpr (std::is_same_v<Update, PrefillUpdate>) {
      if (auto u = from_proto(event_)) on_update_(*u);
    } else {
      on_update_(from_proto(event_));
    }
    this->StartRead(&event_);
  }
  void OnDone(const grpc::Status& status) override {
    done_(from_grpc(status));
    delete this;
  }

 private:
  grpc::ClientContext ctx_;
  Request request_;
  Event event_;
  std::function<void(const Update&)> on_update_;
  WorkerClient::Done done_;
};

// `done`, counted in `in_flight` from now until it has run.
WorkerClient::Done counted(std::shared_ptr<std::atomic<int64_t>> in_flight, WorkerClient::Done done) {
  in_flight->fetch_add(1);
  return [in_flight = std::move(in_flight), done = std::move(done)](const Status& s) {
    if (done) done(s);
    in_flight->fetch_sub(1);
  };
}

}  // namespace

void GrpcWorkerClient::admit(const std::string& decode_address, const AdmitCall& call, CallDeadline deadline,
                             Done done) {
  struct Unary {
    grpc::ClientContext ctx;
    v1::AdmitRequest req;
    v1::AdmitResponse resp;
  };
  auto* u = new Unary;
  u->ctx.set_deadline(deadline);
  u->req = to_proto(call);
  pool_.decode_stub(decode_address).async()->Admit(&u->ctx, &u->req, &u->resp, [u, done = counted(in_flight_, std::move(done))](grpc::Status s) {
    done(from_grpc(s));
    delete u;
  });
}

WorkerCall* GrpcWorkerClient::prefill(const std::string& prefill_address, const PrefillCall& call,
                                      CallDeadline deadline, std::function<void(const PrefillUpdate&)> on_update,
                                      Done done) {
  auto* c = new StreamCall<v1::PrefillRequest, v1::PrefillEvent, PrefillUpdate>(to_proto(call), deadline,
                                                                               std::move(on_update), counted(in_flight_, std::move(done)));
  auto& stub = pool_.prefill_stub(prefill_address);
  c->begin([&stub](grpc::ClientContext* ctx, const v1::PrefillRequest* r, grpc::ClientReadReactor<v1::PrefillEvent>* rx) {
    stub.async()->Prefill(ctx, r, rx);
  });
  return c;
}

WorkerCall* GrpcWorkerClient::stream(const std::string& decode_address, const std::string& request_id,
                                     CallDeadline deadline, std::function<void(const DecodeUpdate&)> on_update,
                                     Done done) {
  v1::StreamRequest req;
  req.set_request_id(request_id);
  auto* c = new StreamCall<v1::StreamRequest, v1::DecodeEvent, DecodeUpdate>(std::move(req), deadline,
                                                                           std::move(on_update), counted(in_flight_, std::move(done)));
  auto& stub = pool_.decode_stub(decode_address);
  c->begin([&stub](grpc::ClientContext* ctx, const v1::StreamRequest* r, grpc::ClientReadReactor<v1::DecodeEvent>* rx) {
    stub.async()->Stream(ctx, r, rx);
  });
  return c;
}

void GrpcWorkerClient::release(const std::string& decode_address, const std::string& request_id) {
  struct Unary {
    grpc::ClientContext ctx;
    v1::ReleaseRequest req;
    v1::ReleaseResponse resp;
  };
  auto* u = new Unary;
  u->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  u->req.set_request_id(request_id);
  pool_.decode_stub(decode_address).async()->Release(&u->ctx, &u->req, &u->resp,
                                                     [u, done = counted(in_flight_, nullptr)](grpc::Status s) {
                                                       done(from_grpc(s));
                                                       delete u;
                                                     });
}

}  // namespace baton
