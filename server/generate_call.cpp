#include "server/generate_call.h"

#include <spdlog/spdlog.h>

#include "common/check.h"
#include "common/grpc_status.h"
#include "proto/convert.h"

namespace baton {
namespace {

using SteadyTime = std::chrono::steady_clock;

double seconds_between(SteadyTime::time_point a, SteadyTime::time_point b) { return std::chrono::duration<double>(b - a).count(); }

grpc::ByteBuffer serialize(const v1::GenerateResponse& msg) {
  grpc::ByteBuffer bytes;
  bool own = false;
  const grpc::Status s = grpc::SerializationTraits<v1::GenerateResponse>::Serialize(msg, &bytes, &own);
  BATON_CHECK(s.ok(), "serializing a GenerateResponse failed: %s", s.error_message().c_str());
  return bytes;
}

}  // namespace

class GenerateReactor;

class GenerateCall : public std::enable_shared_from_this<GenerateCall> {
 public:
  GenerateCall(FrontendContext& fc, grpc::CallbackServerContext* context, GenerateReactor* reactor)
      : fc_(fc), server_ctx_(context), reactor_(reactor), arrival_(SteadyTime::now()) {
    if (fc_.live_calls != nullptr) fc_.live_calls->fetch_add(1);
  }
  // Worker callbacks can outlive the client's stream: the frontend waits for this before it goes.
  ~GenerateCall() {
    if (fc_.live_calls != nullptr) fc_.live_calls->fetch_sub(1);
  }

  // Parses the request's bytes, then starts it (or ends the call with INVALID_ARGUMENT).
  void start(const grpc::ByteBuffer& bytes);
  void start(const v1::GenerateRequest& request);
  void on_write_done(bool ok);
  void on_cancel();

  // Pipeline events (any thread).
  void on_placed(const Placement& placement);
  void on_admitted(const grpc::Status& status);
  void on_prefill_event(const v1::PrefillEvent& event);
  void on_prefill_done(const grpc::Status& status);
  void on_decode_event(const v1::DecodeEvent& event);
  void on_decode_done(const grpc::Status& status);

  std::chrono::system_clock::time_point deadline() const { return server_ctx_->deadline(); }

 private:

  // Scheduler calls may place or fail OTHER requests, whose callbacks take their own locks: they
  // are never made while holding mu_. Entry points set these flags under mu_ and call
  // flush_scheduler() after unlocking.
  void flush_scheduler();
  struct FlushOnExit {
    GenerateCall& call;
    ~FlushOnExit() { call.flush_scheduler(); }
  };
  bool sched_decode_admitted_ = false;
  bool sched_prefill_done_ = false;
  bool sched_finished_ = false;

  void emit_tokens_locked(const std::vector<int32_t>& ids);
  void maybe_complete_locked();
  // Ends the request: with OK the final message (usage, timing) goes out first.
  void end_locked(const Status& status);
  void pump_locked();
  void cancel_workers_locked();
  // Best-effort Release of the decode reservation (idempotent on the worker).
  void release_decode_locked();
  // Only errors that say something about the worker's health mark it failed.
  static bool is_worker_fault(const grpc::Status& status);

  FrontendContext& fc_;
  grpc::CallbackServerContext* server_ctx_;
  std::mutex mu_;
  GenerateReactor* reactor_;  // valid until Finish is called on it
  const SteadyTime::time_point arrival_;

  GenerateSpec spec_;
  // The id the scheduler and the workers know this request by: unique across frontends and not
  // chosen by the client (spec_.request_id is the client's, echoed back and logged).
  std::string id_;
  std::optional<TextStream> text_;
  Placement placement_;
  bool placed_ = false;
  bool submitted_ = false;
  // Client-side contexts of the worker calls; null once their reactors are done.
  grpc::ClientContext* prefill_ctx_ = nullptr;
  grpc::ClientContext* decode_ctx_ = nullptr;
  bool admitted_ = false;

  SteadyTime::time_point prefill_sent_{};
  SteadyTime::time_point first_token_at_{};
  bool have_first_token_ = false;
  std::vector<int32_t> early_decode_tokens_;  // decode tokens that overtook the first token
  int n_generated_ = 0;
  std::string finish_reason_;
  bool decode_done_ = false;
  double queue_s_ = 0, prefill_s_ = 0, kv_transfer_s_ = -1, decode_queue_s_ = 0;

  // Outgoing messages, serialized; one write in flight at a time.
  std::deque<grpc::ByteBuffer> out_;
  bool writing_ = false;
  bool ending_ = false;          // end decided: no more tokens accepted
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

// A server-streaming call to a worker on the client callback API: events and the final status
// go to the GenerateCall's member functions. Deletes itself in OnDone (and only there).
template <typename Request, typename Event>
class WorkerStream final : public grpc::ClientReadReactor<Event> {
 public:
  using EventFn = void (GenerateCall::*)(const Event&);
  using DoneFn = void (GenerateCall::*)(const grpc::Status&);
  // `start_rpc` binds the call to its stub method, e.g. stub.async()->Prefill(ctx, req, reactor).
  template <typename StartRpc>
  WorkerStream(std::shared_ptr<GenerateCall> call, Request request, EventFn on_event, DoneFn on_done,
               StartRpc&& start_rpc)
      : call_(std::move(call)), request_(std::move(request)), on_event_(on_event), on_done_(on_done) {
    ctx_.set_deadline(call_->deadline());
    start_rpc(&ctx_, &request_, this);
  }
  grpc::ClientContext* context() { return &ctx_; }
  void begin() {
    this->StartRead(&event_);
    this->StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    ((*call_).*on_event_)(event_);
    this->StartRead(&event_);
  }
  void OnDone(const grpc::Status& status) override {
    ((*call_).*on_done_)(status);
    delete this;
  }

 private:
  std::shared_ptr<GenerateCall> call_;
  grpc::ClientContext ctx_;
  Request request_;
  Event event_;
  EventFn on_event_;
  DoneFn on_done_;
};

void GenerateCall::start(const grpc::ByteBuffer& bytes) {
  v1::GenerateRequest request;
  grpc::ByteBuffer copy(bytes);  // Deserialize consumes its buffer
  if (!grpc::SerializationTraits<v1::GenerateRequest>::Deserialize(&copy, &request).ok()) {
    std::lock_guard<std::mutex> lock(mu_);  // nothing submitted yet: as the refusals in start below
    end_locked(invalid_argument(
        "the request is not a valid baton.v1.GenerateRequest: malformed protobuf bytes, or a string field "
        "(prompt, messages, stop, model, request_id) that is not valid UTF-8"));
    return;
  }
  start(request);
}

void GenerateCall::start(const v1::GenerateRequest& request) {
  PendingRequest pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (fc_.draining != nullptr && fc_.draining->load()) {
      end_locked(unavailable("this frontend is shutting down; retry on another replica"));
      return;
    }
    auto spec = make_generate_spec(request, *fc_.model, "req-" + fc_.instance + "-" + std::to_string(fc_.next_id->load()));
    if (!spec.ok()) {
      end_locked(spec.status());
      return;
    }
    spec_ = std::move(*spec);
    id_ = fc_.instance + "-" + std::to_string(fc_.next_id->fetch_add(1));
    text_.emplace(*fc_.model->tokenizer, spec_.stop);
    pending.id = id_;
    pending.n_prompt_tokens = static_cast<int64_t>(spec_.prompt_ids.size());
    pending.n_total_tokens = pending.n_prompt_tokens + spec_.max_tokens;
    pending.priority = spec_.priority;
    pending.arrival = arrival_;
    if (server_ctx_->deadline() != std::chrono::system_clock::time_point::max()) {
      pending.deadline = arrival_ + std::chrono::duration_cast<SteadyTime::duration>(server_ctx_->deadline() -
                                                                                 std::chrono::system_clock::now());
    }
    submitted_ = true;  // before submit: its callbacks may run on this thread, inside submit
  }
  std::weak_ptr<GenerateCall> weak = weak_from_this();
  Status s = fc_.scheduler->submit(
      pending,
      [weak](const Placement& p) {
        if (auto self = weak.lock()) self->on_placed(p);
      },
      [weak](const Status& st) {
        if (auto self = weak.lock()) {
          {
            std::lock_guard<std::mutex> l(self->mu_);
            self->end_locked(st);
          }
          self->flush_scheduler();
        }
      });
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!s.ok()) {
      submitted_ = false;  // never admitted: nothing to release
      end_locked(s);
      return;
    }
    if (fc_.metrics && !ending_) {
      fc_.metrics->prompt_tokens_total.Add({}).Increment(static_cast<double>(spec_.prompt_ids.size()));
    }
    spdlog::info("req={} admitted as {}: {} prompt tokens, max_tokens {}", spec_.request_id, id_,
                 spec_.prompt_ids.size(), spec_.max_tokens);
  }
  flush_scheduler();
}

void GenerateCall::flush_scheduler() {
  bool admitted = false, prefill_done = false, finished = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::swap(admitted, sched_decode_admitted_);
    std::swap(prefill_done, sched_prefill_done_);
    std::swap(finished, sched_finished_);
  }
  if (admitted) fc_.scheduler->decode_admitted(id_);
  if (prefill_done) fc_.scheduler->prefill_done(id_);
  if (finished) fc_.scheduler->finished(id_);
}

void GenerateCall::on_placed(const Placement& placement) {
  FlushOnExit flush(*this);  // after the lock below is released
  std::lock_guard<std::mutex> lock(mu_);
  if (ending_) return;
  placement_ = placement;
  placed_ = true;
  auto* ctx = new grpc::ClientContext();
  ctx->set_deadline(server_ctx_->deadline());
  auto* req = new v1::AdmitRequest();
  auto* resp = new v1::AdmitResponse();
  req->set_request_id(id_);
  req->set_n_prompt_tokens(static_cast<int32_t>(spec_.prompt_ids.size()));
  req->set_max_tokens(spec_.max_tokens);
  sampling_to_proto(spec_.sampling, req->mutable_sampling());
  req->set_ignore_eos(spec_.ignore_eos);
  req->set_model_fingerprint(fc_.model->fingerprint);
  auto self = shared_from_this();
  fc_.pool->decode_stub(placement.decode_address)
      .async()
      ->Admit(ctx, req, resp, [self, ctx, req, resp](grpc::Status s) {
        self->on_admitted(s);
        delete ctx;
        delete req;
        delete resp;
      });
}

void GenerateCall::on_admitted(const grpc::Status& status) {
  FlushOnExit flush(*this);  // after the lock below is released
  std::lock_guard<std::mutex> lock(mu_);
  if (!status.ok()) {
    if (is_worker_fault(status)) fc_.registry->report_failure(WorkerRole::kDecode, placement_.decode_address);
    // The worker may have admitted it before the error reached us: release to be sure.
    if (status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED &&
        status.error_code() != grpc::StatusCode::INVALID_ARGUMENT &&
        status.error_code() != grpc::StatusCode::FAILED_PRECONDITION) {
      release_decode_locked();
    }
    end_locked(Status(from_grpc(status).code(), "decode worker " + placement_.decode_address +
                                                    " refused the request: " + status.error_message()));
    return;
  }
  admitted_ = true;
  sched_decode_admitted_ = true;
  if (ending_) {
    release_decode_locked();  // ended while Admit was in flight
    return;
  }
  auto self = shared_from_this();
  v1::StreamRequest sreq;
  sreq.set_request_id(id_);
  auto& dstub = fc_.pool->decode_stub(placement_.decode_address);
  auto* decode = new WorkerStream<v1::StreamRequest, v1::DecodeEvent>(
      self, std::move(sreq), &GenerateCall::on_decode_event, &GenerateCall::on_decode_done,
      [&dstub](grpc::ClientContext* c, const v1::StreamRequest* r, grpc::ClientReadReactor<v1::DecodeEvent>* rx) {
        dstub.async()->Stream(c, r, rx);
      });
  decode_ctx_ = decode->context();
  v1::PrefillRequest preq;
  preq.set_request_id(id_);
  for (int32_t id : spec_.prompt_ids) preq.add_prompt_token_ids(id);
  sampling_to_proto(spec_.sampling, preq.mutable_sampling());
  preq.set_decode_address(placement_.decode_address);
  auto& pstub = fc_.pool->prefill_stub(placement_.prefill_address);
  auto* prefill = new WorkerStream<v1::PrefillRequest, v1::PrefillEvent>(
      self, std::move(preq), &GenerateCall::on_prefill_event, &GenerateCall::on_prefill_done,
      [&pstub](grpc::ClientContext* c, const v1::PrefillRequest* r, grpc::ClientReadReactor<v1::PrefillEvent>* rx) {
        pstub.async()->Prefill(c, r, rx);
      });
  prefill_ctx_ = prefill->context();
  prefill_sent_ = SteadyTime::now();
  decode->begin();
  prefill->begin();
}

void GenerateCall::on_prefill_event(const v1::PrefillEvent& event) {
  FlushOnExit flush(*this);  // after the lock below is released
  std::lock_guard<std::mutex> lock(mu_);
  if (event.has_first_token()) {
    const auto& ft = event.first_token();
    sched_prefill_done_ = true;
    queue_s_ = seconds_between(arrival_, prefill_sent_) + ft.queue_seconds();
    prefill_s_ = ft.prefill_seconds();
    if (ending_) return;
    have_first_token_ = true;
    first_token_at_ = SteadyTime::now();  // before emitting: a stop string may end the request
    emit_tokens_locked({ft.token_id()});
    if (fc_.metrics) {
      const auto labels = Metrics::role_labels("frontend", fc_.name);
      fc_.metrics->histogram(fc_.metrics->ttft_seconds, labels).Observe(seconds_between(arrival_, first_token_at_));
      fc_.metrics->histogram(fc_.metrics->queue_seconds, labels).Observe(queue_s_);
    }
    if (!early_decode_tokens_.empty()) {
      std::vector<int32_t> early;
      early.swap(early_decode_tokens_);
      emit_tokens_locked(early);
    }
    maybe_complete_locked();
  } else if (event.has_kv_sent()) {
    kv_transfer_s_ = event.kv_sent().transfer_seconds();
  }
}

void GenerateCall::on_prefill_done(const grpc::Status& status) {
  FlushOnExit flush(*this);  // after the lock below is released
  std::lock_guard<std::mutex> lock(mu_);
  prefill_ctx_ = nullptr;
  if (status.ok() && !have_first_token_ && !ending_) {
    end_locked(internal_error("prefill worker " + placement_.prefill_address + " ended without a first token"));
    return;
  }
  if (!status.ok() && !ending_) {
    if (is_worker_fault(status)) fc_.registry->report_failure(WorkerRole::kPrefill, placement_.prefill_address);
    Status s = from_grpc(status);
    end_locked(Status(s.code(), "prefill on " + placement_.prefill_address + " failed: " + status.error_message()));
  }
}

void GenerateCall::on_decode_event(const v1::DecodeEvent& event) {
  FlushOnExit flush(*this);  // after the lock below is released
  std::lock_guard<std::mutex> lock(mu_);
  if (ending_) return;
  if (event.decode_queue_seconds() > 0) decode_queue_s_ = event.decode_queue_seconds();
  if (kv_transfer_s_ < 0 && event.kv_transfer_seconds() > 0) kv_transfer_s_ = event.kv_transfer_seconds();
  std::vector<int32_t> ids(event.token_ids().begin(), event.token_ids().end());
  if (!have_first_token_) {
    early_decode_tokens_.insert(early_decode_tokens_.end(), ids.begin(), ids.end());
  } else {
    emit_tokens_locked(ids);
  }
  if (event.done()) {
    decode_done_ = true;
    if (finish_reason_.empty()) {
      finish_reason_ = event.finish_reason() == v1::FINISH_REASON_LENGTH ? "length" : "stop";
    }
    maybe_complete_locked();
  }
}

void GenerateCall::on_decode_done(const grpc::Status& status) {
  FlushOnExit flush(*this);  // after the lock below is released
  std::lock_guard<std::mutex> lock(mu_);
  decode_ctx_ = nullptr;
  if (ending_) return;
  if (!status.ok()) {
    if (is_worker_fault(status)) fc_.registry->report_failure(WorkerRole::kDecode, placement_.decode_address);
    Status s = from_grpc(status);
    end_locked(Status(s.code(), "decode on " + placement_.decode_address + ": " + status.error_message()));
    return;
  }
  if (!decode_done_) end_locked(internal_error("decode worker ended the stream without a final event"));
}

void GenerateCall::emit_tokens_locked(const std::vector<int32_t>& ids) {
  if (ids.empty() || ending_) return;
  v1::GenerateResponse msg;
  msg.set_request_id(spec_.request_id);
  std::string text;
  for (int32_t id : ids) {
    if (text_->stopped()) break;
    msg.add_token_ids(id);
    ++n_generated_;
    text += text_->push(id);
  }
  msg.set_text(text);
  out_.push_back(serialize(msg));
  pump_locked();
  if (text_->stopped()) {
    // A stop string ends the request here; end_locked cancels the decode stream, which frees
    // the sequence's blocks on the worker.
    finish_reason_ = "stop";
    decode_done_ = true;
    maybe_complete_locked();
  }
}

void GenerateCall::maybe_complete_locked() {
  if (ending_ || !have_first_token_ || !decode_done_) return;
  end_locked(Status());
}

void GenerateCall::cancel_workers_locked() {
  if (decode_ctx_ != nullptr) decode_ctx_->TryCancel();
  // After the first token the prefill only moves KV, which the cancelled decode side refuses.
  if (prefill_ctx_ != nullptr && !have_first_token_) prefill_ctx_->TryCancel();
}

bool GenerateCall::is_worker_fault(const grpc::Status& status) {
  switch (status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::INTERNAL:
    case grpc::StatusCode::DATA_LOSS:
      return true;
    default:
      return false;
  }
}

void GenerateCall::release_decode_locked() {
  auto* ctx = new grpc::ClientContext();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto* req = new v1::ReleaseRequest();
  auto* resp = new v1::ReleaseResponse();
  req->set_request_id(id_);
  fc_.pool->decode_stub(placement_.decode_address).async()->Release(ctx, req, resp, [ctx, req, resp](grpc::Status) {
    delete ctx;
    delete req;
    delete resp;
  });
}

void GenerateCall::end_locked(const Status& status) {
  if (ending_) return;
  ending_ = true;
  const auto now = SteadyTime::now();
  if (status.ok()) {
    v1::GenerateResponse msg;
    msg.set_request_id(spec_.request_id);
    const std::string rest = text_ ? text_->finish() : std::string();
    msg.set_text(rest);
    auto* fin = msg.mutable_final();
    fin->set_finish_reason(finish_reason_ == "length" ? v1::FINISH_REASON_LENGTH : v1::FINISH_REASON_STOP);
    fin->mutable_usage()->set_prompt_tokens(static_cast<int32_t>(spec_.prompt_ids.size()));
    fin->mutable_usage()->set_completion_tokens(n_generated_);
    auto* t = fin->mutable_timing();
    t->set_queue_seconds(queue_s_);
    t->set_prefill_seconds(prefill_s_);
    t->set_kv_transfer_seconds(std::max(0.0, kv_transfer_s_));
    t->set_decode_queue_seconds(decode_queue_s_);
    t->set_ttft_seconds(seconds_between(arrival_, first_token_at_));
    t->set_e2e_seconds(seconds_between(arrival_, now));
    fin->set_prefill_worker(placement_.prefill_address);
    fin->set_decode_worker(placement_.decode_address);
    out_.push_back(serialize(msg));
    spdlog::info("req={} done: {} tokens, finish {}, ttft {:.3f}s, e2e {:.3f}s", spec_.request_id, n_generated_,
                 finish_reason_, t->ttft_seconds(), t->e2e_seconds());
  } else {
    while (out_.size() > (writing_ ? 1u : 0u)) out_.pop_back();  // the front may be in flight
    if (admitted_ && !decode_done_) release_decode_locked();
    spdlog::info("req={} ended: {}", spec_.request_id.empty() ? "-" : spec_.request_id, status.to_string());
  }
  final_status_ = to_grpc(status);
  cancel_workers_locked();
  if (submitted_) sched_finished_ = true;
  if (fc_.metrics) {
    const auto labels = Metrics::role_labels("frontend", fc_.name);
    fc_.metrics->requests_total.Add({{"code", status_code_name(status.code())}}).Increment();
    if (status.ok()) {
      fc_.metrics->generation_tokens_total.Add({}).Increment(n_generated_);
      fc_.metrics->histogram(fc_.metrics->e2e_seconds, labels).Observe(seconds_between(arrival_, now));
      if (n_generated_ > 1) {
        fc_.metrics->histogram(fc_.metrics->tpot_seconds, labels)
            .Observe(seconds_between(first_token_at_, now) / (n_generated_ - 1));
      }
    }
  }
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
  FlushOnExit flush(*this);  // after the lock below is released
  std::lock_guard<std::mutex> lock(mu_);
  writing_ = false;
  if (!out_.empty()) out_.pop_front();
  if (!ok) {
    // The client went away: stop everything (nothing is in flight now).
    out_.clear();
    if (!ending_) end_locked(cancelled("the client stream broke"));
  }
  pump_locked();
}

void GenerateCall::on_cancel() {
  FlushOnExit flush(*this);  // after the lock below is released: finished() leaves the queue too
  std::lock_guard<std::mutex> lock(mu_);
  if (ending_) return;
  // gRPC reports its own deadline as a cancellation.
  const bool expired = server_ctx_->deadline() <= std::chrono::system_clock::now();
  end_locked(expired ? deadline_exceeded("the request's deadline passed")
                     : cancelled("the client cancelled the request"));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* start_generate_call(FrontendContext& fc, grpc::CallbackServerContext* context,
                                                                const grpc::ByteBuffer* request) {
  return new GenerateReactor(fc, context, request);
}

}  // namespace baton
