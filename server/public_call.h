// The half of one public request that does not depend on the surface it came in on (gRPC
// Generate, the OpenAI-compatible HTTP API): admission (the API key, the drain, validation into
// a ValidRequest), the RequestPipeline, token ids → text with stop strings, and the request-level
// metrics and logs. A surface derives from PublicCall, reads its wire format field by field into
// the RequestBuilder that request_builder() gives it, and writes what emit_tokens / emit_end give
// it; everything a client can be refused for is decided by the builder or here, once, the same
// way for every surface.
//
// Order of a call: authorize() (before the request is read), then start() with what the builder
// built (or refuse() with the surface's own reason: a body that does not parse). Exactly one
// emit_end follows, after any emit_tokens.
//
// Ownership: the surface holds its call in a shared_ptr; the pipeline holds the call as its sink
// until it has ended. Threading: emit_tokens and emit_end run on the pipeline's threads with its
// mutex held (emit_end also on the surface's thread, from refuse or a refusal inside start): they
// must queue and return, never call back into the call.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "common/api_keys.h"
#include "common/metrics.h"
#include "scheduler/request_pipeline.h"
#include "server/request_validation.h"
#include "server/text_stream.h"

namespace baton {

// What every call of one frontend shares.
struct FrontendContext {
  const ServedModel* model = nullptr;
  PipelineDeps pipeline;       // scheduler, registry, worker client, clock, failover bound
  Metrics* metrics = nullptr;  // may be null
  std::string name;            // this frontend's listen address (metric label)
  std::atomic<int64_t>* live_calls = nullptr;  // calls alive, every surface (stop() waits for zero)
  std::atomic<bool>* draining = nullptr;  // true: refuse new requests with UNAVAILABLE
  ApiKeys* api_keys = nullptr;            // null: no key needed; else UNAUTHENTICATED without one
  std::chrono::seconds max_request{3600};  // --max-request-seconds: caps every request's deadline
};

class PublicCall : public ResponseSink, public std::enable_shared_from_this<PublicCall> {
 public:
  ~PublicCall() override;
  PublicCall(const PublicCall&) = delete;
  PublicCall& operator=(const PublicCall&) = delete;

  // ResponseSink: the pipeline's events become text, metrics and the emit_* calls.
  Accepted on_tokens(std::span<const int32_t> ids, std::span<const TokenLogprobs> logprobs) final;
  void on_failover(const std::string& reason, const Status& cause) final;
  void on_end(const Status& status, const PipelineOutcome& outcome) final;

 protected:
  explicit PublicCall(FrontendContext& fc);

  // The caller's `authorization` ("Bearer <key>", "" when absent) against --api-key-file: OK
  // (remembering the key's priority bound) or UNAUTHENTICATED. OK when no keys are required.
  Status authorize(std::string_view authorization);
  // The builder this call's request is read into: the served model, and the caller's API key's
  // priority bound (so after authorize()).
  RequestBuilder request_builder() const;
  // Refuses the request while draining or when it did not validate; otherwise starts its
  // pipeline. `deadline`: when the client stops waiting (max: never).
  void start(Result<ValidRequest> request, CallDeadline deadline);
  // Ends a call that has no pipeline (yet): counted, logged, emit_end(status).
  void refuse(const Status& status);
  // Ends the request with `why` (its pipeline calls emit_end) unless it has ended; nothing
  // before start().
  void cancel(const Status& why);

  FrontendContext& frontend() const { return fc_; }
  // Valid once start() has accepted the request (read-only from then on).
  const std::string& request_id() const { return request_id_; }

  // Text that is ready for the client with the ids it completes (text may be empty mid-character)
  // and, when the request asked, their log-probabilities (else empty).
  virtual void emit_tokens(std::span<const int32_t> ids, std::span<const TokenLogprobs> logprobs,
                           const std::string& text) = 0;
  // The end, once. OK: `outcome` is complete and `tail` is the text held back until now (it
  // follows the last emit_tokens). Otherwise `status` says why, for the client.
  virtual void emit_end(const Status& status, const PipelineOutcome& outcome, const std::string& tail) = 0;

 private:
  void count_end(const Status& status);

  FrontendContext& fc_;
  const TimePoint arrival_;
  std::optional<int32_t> key_max_priority_;  // the caller's API key's bound, when it has one
  std::string tenant_;                       // the caller's API key's identity (ApiKey::tenant)
  std::string request_id_;  // the client's, or one made up for it
  // Touched only in the pipeline's callbacks, which its mutex orders.
  std::optional<TextStream> text_;
  bool first_token_seen_ = false;

  std::mutex mu_;
  std::shared_ptr<RequestPipeline> pipeline_;  // guarded by mu_; set once by start()
};

}  // namespace baton
