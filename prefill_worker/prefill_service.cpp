#include "prefill_worker/prefill_service.h"

#include <spdlog/spdlog.h>

#include "common/grpc_status.h"
#include "common/grpc_stream_writer.h"
#include "proto/convert.h"

namespace baton {
namespace {

// One Prefill call. Events go out through a GrpcStreamWriter, in order: Progress (after each step
// while the prompt waits or is part done), FirstToken, then KvSent; the engine's callbacks hold
// the writer, never the reactor (the writer's lifetime rule).
class PrefillReactor final : public grpc::ServerWriteReactor<baton::v1::PrefillEvent> {
 public:
  PrefillReactor(PrefillEngine& engine, const Model& model, const baton::v1::PrefillRequest& request, bool draining)
      : engine_(engine), request_id_(request.request_id()), out_(std::make_shared<Writer>(this)) {
    // The engine validates the job (PrefillJob::validate_against), once.
    Status s = draining ? unavailable("this prefill worker is draining: send the request to another one") : Status();
    if (s.ok()) {
      PrefillJob job;
      job.request_id = request.request_id();
      job.tokens.assign(request.prompt_token_ids().begin(), request.prompt_token_ids().end());
      job.tokens.insert(job.tokens.end(), request.generated_token_ids().begin(), request.generated_token_ids().end());
      job.n_generated = request.generated_token_ids_size();
      job.sampling = sampling_from_proto(request.sampling());
      job.decode_address = request.decode_address();
      job.model_fingerprint = model.fingerprint();
      job.on_first_token = [out = out_](int32_t token, double queue_s, double prefill_s, int32_t n_cached,
                                        const TokenLogprobs* logprobs) {
        baton::v1::PrefillEvent e;
        baton::v1::FirstToken* ft = e.mutable_first_token();
        ft->set_token_id(token);
        ft->set_queue_seconds(queue_s);
        ft->set_prefill_seconds(prefill_s);
        ft->set_cached_tokens(n_cached);
        if (logprobs != nullptr) logprob_to_proto(token, *logprobs, ft->mutable_logprob());
        out->write(std::move(e));
      };
      // The frontend needs the latest progress, not each: an unwritten one is replaced.
      job.on_progress = [out = out_](int32_t n_done) {
        baton::v1::PrefillEvent e;
        e.mutable_progress()->set_tokens_done(n_done);
        out->write(std::move(e), /*mergeable=*/true);
      };
      job.on_done = [out = out_](const Status& status, double transfer_s, int64_t bytes) {
        if (status.ok()) {
          baton::v1::PrefillEvent e;
          e.mutable_kv_sent()->set_transfer_seconds(transfer_s);
          e.mutable_kv_sent()->set_bytes(bytes);
          out->write(std::move(e));
        }
        out->finish(to_grpc(status));
      };
      s = engine_.submit(std::move(job));  // on error, no callback ever comes
      submitted_ = s.ok();
    }
    if (!s.ok()) {
      spdlog::info("req={} prefill refused: {}", request_id_, s.to_string());
      out_->finish(to_grpc(s));
    }
  }

  // A broken stream or a cancelled call cancels the job; only a job this call submitted: a
  // refused duplicate id must not cancel the original.
  void OnWriteDone(bool ok) override {
    PrefillEngine& engine = engine_;     // copies: once the writer has the end, another thread
    const std::string id = request_id_;  // may Finish and the reactor be deleted
    const bool submitted = submitted_;
    const std::shared_ptr<Writer> out = out_;
    if (!out->on_write_done(ok) && submitted) engine.cancel(id);
  }

  void OnCancel() override {
    const std::shared_ptr<Writer> out = out_;
    if (submitted_) engine_.cancel(request_id_);
    out->on_cancel();
  }

  void OnDone() override { delete this; }

 private:
  using Writer = GrpcStreamWriter<baton::v1::PrefillEvent>;

  PrefillEngine& engine_;
  const std::string request_id_;
  const std::shared_ptr<Writer> out_;
  bool submitted_ = false;  // the engine accepted the job (set in the constructor, read after)
};

// One ProbeKv call. Finish is called exactly once: in the constructor when the probe does not
// start, else by the prober's `done` (on its thread, perhaps before the constructor returns: the
// constructor touches nothing after start). Cancelling the call only abandons the probe, whose
// `done` then finishes the call CANCELLED. OnDone, which follows Finish, deletes the reactor.
class ProbeReactor final : public grpc::ServerUnaryReactor {
 public:
  ProbeReactor(KvProber* prober, const baton::v1::KvProbeRequest& request, baton::v1::KvProbeResponse* response,
               bool draining)
      : prober_(prober) {
    Status s = unimplemented("this prefill worker runs no KV probes");
    if (draining) {
      s = unavailable("this prefill worker is draining");
    } else if (prober_ != nullptr) {
      s = prober_->start(this, request.decode_address(), request.bytes(), request.rounds(),
                         [this, response](Result<KvProbeResult> r) { done(std::move(r), response); });
    }
    if (!s.ok()) Finish(to_grpc(s));
  }

  // A probe that did not start, or has finished, is no longer this caller's: ignored.
  void OnCancel() override {
    if (prober_ != nullptr) prober_->cancel(this);
  }

  void OnDone() override { delete this; }

 private:
  void done(Result<KvProbeResult> r, baton::v1::KvProbeResponse* response) {
    if (!r.ok()) {
      Finish(to_grpc(r.status()));
      return;
    }
    response->set_transport(r->transport);
    response->set_bytes(r->bytes);
    response->mutable_seconds()->Assign(r->seconds.begin(), r->seconds.end());
    response->set_latency_bytes(r->latency_bytes);
    response->mutable_latency_seconds()->Assign(r->latency_seconds.begin(), r->latency_seconds.end());
    Finish(grpc::Status::OK);
  }

  KvProber* const prober_;
};

}  // namespace

grpc::ServerWriteReactor<baton::v1::PrefillEvent>* PrefillService::Prefill(grpc::CallbackServerContext* context,
                                                                           const baton::v1::PrefillRequest* request) {
  return new PrefillReactor(engine_, model_, *request, draining_);
}

grpc::ServerUnaryReactor* PrefillService::GetLoad(grpc::CallbackServerContext* context,
                                                  const baton::v1::LoadRequest* request,
                                                  baton::v1::LoadReport* response) {
  const PrefillLoad load = engine_.load();
  const ModelConfig& c = model_.config();
  response->set_model_fingerprint(model_.fingerprint());
  response->set_free_blocks(load.free_blocks);
  response->set_total_blocks(load.total_blocks);
  response->set_block_size(engine_.config().block_size);
  response->set_queued_prompt_tokens(load.queued_prompt_tokens);
  response->set_running(load.n_running + load.n_sending);
  response->set_draining(draining_);
  response->set_step_seconds(load.step_seconds);
  response->set_prefill_tokens_per_second(load.prefill_tokens_per_second);
  response->set_step_token_budget(load.token_budget);
  response->set_step_fixed_seconds(load.step_fixed_seconds);
  response->set_step_seconds_per_token(load.step_seconds_per_token);
  response->set_step_tokens_in_progress(load.step_tokens_in_progress);
  response->set_step_elapsed_seconds(load.step_elapsed_seconds);
  response->set_prefix_cache_blocks(load.prefix_cache_blocks);
  response->set_cached_blocks(load.n_cached_blocks);
  response->set_prefix_hash_seed(load.prefix_hash_seed);
  response->mutable_cached_block_hashes()->Assign(load.cached_block_hashes.begin(), load.cached_block_hashes.end());
  model_info_to_proto(c.name, c, model_.fingerprint(), "", response->mutable_model());
  response->set_kv_transport(kv_transport_);
  worker_identity_to_proto(dtype_name(engine_.config().kv_dtype), response);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* PrefillService::ProbeKv(grpc::CallbackServerContext* context,
                                                  const baton::v1::KvProbeRequest* request,
                                                  baton::v1::KvProbeResponse* response) {
  return new ProbeReactor(prober_, *request, response, draining_);
}

}  // namespace baton
