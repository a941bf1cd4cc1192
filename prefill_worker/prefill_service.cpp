#include "prefill_worker/prefill_service.h"

#include <spdlog/spdlog.h>

#include <deque>
#include <mutex>

#include "common/grpc_status.h"
#include "proto/convert.h"

namespace baton {
namespace {

Status check_ids(const google::protobuf::RepeatedField<int32_t>& ids, const char* field, int n_vocab) {
  for (int i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= n_vocab) {
      return invalid_argument(std::string(field) + "[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                              " is outside the model's vocabulary [0, " + std::to_string(n_vocab) + ")");
    }
  }
  return {};
}

// One Prefill call. The engine's callbacks point at this reactor, so it finishes the call only
// after on_done (the engine's last call for the job); OnDone, which follows Finish, deletes it.
// Events are written one at a time, in order: Progress (for each chunk of a long prompt), then
// FirstToken, then KvSent.
class PrefillReactor final : public grpc::ServerWriteReactor<baton::v1::PrefillEvent> {
 public:
  PrefillReactor(PrefillEngine& engine, const Model& model, const baton::v1::PrefillRequest& request, bool draining)
      : engine_(engine), request_id_(request.request_id()) {
    Status s = draining ? unavailable("this prefill worker is draining: send the request to another one")
                        : validate_prefill_request(request, model.config());
    if (s.ok()) {
      PrefillJob job;
      job.request_id = request.request_id();
      job.tokens.assign(request.prompt_token_ids().begin(), request.prompt_token_ids().end());
      job.tokens.insert(job.tokens.end(), request.generated_token_ids().begin(), request.generated_token_ids().end());
      job.n_generated = request.generated_token_ids_size();
      job.sampling = sampling_from_proto(request.sampling());
      job.decode_address = request.decode_address();
      job.model_fingerprint = model.fingerprint();
      job.on_first_token = [this](int32_t token, double queue_s, double prefill_s, int32_t n_cached) {
        on_first_token(token, queue_s, prefill_s, n_cached);
      };
      job.on_progress = [this](int32_t n_done) { on_progress(n_done); };
      job.on_done = [this](const Status& status, double transfer_s, int64_t bytes) {
        on_done(status, transfer_s, bytes);
      };
      s = engine_.submit(std::move(job));  // on error, no callback ever comes
      submitted_ = s.ok();
    }
    if (!s.ok()) {
      spdlog::info("req={} prefill refused: {}", request_id_, s.to_string());
      Finish(to_grpc(s));
    }
  }

  void OnWriteDone(bool ok) override {
    Next next;
    PrefillEngine& engine = engine_;      // copies: once mu_ is released another thread may
    const std::string id = request_id_;  // Finish, and the reactor be deleted
    {
      std::lock_guard<std::mutex> lock(mu_);
      writing_ = false;
      events_.pop_front();
      if (!ok) {
        broken_ = true;  // the client is gone: nothing more can be written
        events_.clear();
      }
      next = claim_locked();
    }
    // A claim in `next` keeps the reactor alive until performed (OnDone comes only after Finish,
    // the next OnWriteDone only after StartWrite); without one it may already be gone.
    if (!ok) engine.cancel(id);  // usually OnCancel did already; cancel is idempotent
    perform(this, next);
  }

  // Only a job this call submitted: a refused duplicate id must not cancel the original.
  void OnCancel() override {
    if (submitted_) engine_.cancel(request_id_);
  }

  void OnDone() override { delete this; }

 private:
  // What the thread holding mu_ claimed: the next write, or the call's Finish. The claim and the
  // state change that allows it happen under one lock, and only the claiming thread performs it,
  // touching nothing of `this` after: once the event queue is empty and done_ is set, any thread
  // may Finish, and OnDone (which deletes the reactor) may run at once. (Setting done_, unlocking
  // and then locking again to decide would let another thread Finish in the gap and the engine
  // thread lock a freed mutex: the window tests/unit/prefill_worker/prefill_service_test.cpp
  // stresses.)
  struct Next {
    const baton::v1::PrefillEvent* write = nullptr;  // StartWrite this
    bool finish = false;                             // else Finish with status
    grpc::Status status;
  };

  Next claim_locked() {
    Next next;
    if (writing_ || finished_) return next;
    if (!events_.empty()) {
      writing_ = true;
      next.write = &events_.front();  // stays put (deque front) until OnWriteDone pops it
    } else if (done_) {
      finished_ = true;
      next.finish = true;
      next.status = final_status_;
    }
    return next;
  }

  // gRPC is called without mu_ held; after Finish the reactor may be gone. Static, so that an
  // empty claim never touches a reactor another thread may have deleted.
  static void perform(PrefillReactor* self, const Next& next) {
    if (next.write != nullptr) {
      self->StartWrite(next.write);
    } else if (next.finish) {
      self->Finish(next.status);
    }
  }

  void on_first_token(int32_t token, double queue_s, double prefill_s, int32_t n_cached) {
    Next next;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_) return;
      baton::v1::FirstToken* ft = events_.emplace_back().mutable_first_token();
      ft->set_token_id(token);
      ft->set_queue_seconds(queue_s);
      ft->set_prefill_seconds(prefill_s);
      ft->set_cached_tokens(n_cached);
      next = claim_locked();
    }
    perform(this, next);
  }

  // A chunk of the prompt is done. Queued behind an unwritten one, it replaces it: the frontend
  // needs the latest, not each.
  void on_progress(int32_t n_done) {
    Next next;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_) return;
      const bool replace = events_.size() > (writing_ ? 1u : 0u) && events_.back().has_progress();
      baton::v1::PrefillProgress* p = (replace ? events_.back() : events_.emplace_back()).mutable_progress();
      p->set_tokens_done(n_done);
      next = claim_locked();
    }
    perform(this, next);
  }

  // The engine's last call for the job.
  void on_done(const Status& status, double transfer_s, int64_t bytes) {
    Next next;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (status.ok() && !broken_) {
        baton::v1::KvSent* sent = events_.emplace_back().mutable_kv_sent();
        sent->set_transfer_seconds(transfer_s);
        sent->set_bytes(bytes);
      }
      final_status_ = to_grpc(status);
      done_ = true;
      next = claim_locked();
    }
    perform(this, next);
  }

  PrefillEngine& engine_;
  const std::string request_id_;
  bool submitted_ = false;  // the engine accepted the job (set in the constructor, read after)
  std::mutex mu_;
  std::deque<baton::v1::PrefillEvent> events_;  // to write; the front is in flight while writing_
  bool writing_ = false;
  bool broken_ = false;    // a write failed: drop further events
  bool done_ = false;      // on_done came: final_status_ is set
  bool finished_ = false;  // Finish called
  grpc::Status final_status_;
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

Status validate_prefill_request(const baton::v1::PrefillRequest& r, const ModelConfig& model) {
  if (r.request_id().empty()) return invalid_argument("request_id is empty");
  if (r.prompt_token_ids().empty()) return invalid_argument("prompt_token_ids is empty: give at least one token");
  BATON_RETURN_IF_ERROR(check_ids(r.prompt_token_ids(), "prompt_token_ids", model.n_vocab));
  BATON_RETURN_IF_ERROR(check_ids(r.generated_token_ids(), "generated_token_ids", model.n_vocab));
  const int64_t n = static_cast<int64_t>(r.prompt_token_ids_size()) + r.generated_token_ids_size();
  if (n >= model.n_ctx) {
    return invalid_argument("prompt_token_ids (" + std::to_string(r.prompt_token_ids_size()) +
                            ") + generated_token_ids (" + std::to_string(r.generated_token_ids_size()) +
                            ") leave no room for a new token in the model's context of " + std::to_string(model.n_ctx));
  }
  const Status s = validate_sampling(sampling_from_proto(r.sampling()));
  if (!s.ok()) return invalid_argument("sampling." + s.message());
  if (r.decode_address().empty()) return invalid_argument("decode_address is empty");
  return {};
}

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
