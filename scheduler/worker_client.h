// How the request pipeline (scheduler/request_pipeline.h) reaches the workers: four operations,
// in baton's own types. The gRPC implementation sits at the edge (server/grpc_worker_client.h,
// with every protobuf conversion of this boundary); tests drive the pipeline with a fake.
//
// Contract for implementations:
// - Callbacks never run on the calling thread before the call returns (the pipeline calls in
//   with its lock held), and run one at a time per call: a call's events, then its `done`, once.
// - A WorkerCall handle stays valid until its `done` callback has returned; cancel() may be
//   called any time before that (the call then ends, usually CANCELLED, and `done` still runs).
// - Statuses are baton Statuses: transport failures (the worker is gone or unreachable) are
//   UNAVAILABLE; a worker's own refusals keep the code it sent.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/sampler.h"

namespace baton {

// Worker calls end at the client's deadline (system_clock: what gRPC carries).
using CallDeadline = std::chrono::system_clock::time_point;

struct AdmitCall {
  std::string request_id;       // the attempt's worker-facing id
  int32_t n_prompt_tokens = 0;  // prompt + tokens already generated (their KV arrives)
  int32_t n_output_tokens = 0;  // of those, the tokens already generated (the penalties count them)
  int32_t max_tokens = 0;       // tokens still to generate, the first one (from prefill) included
  SamplingParams sampling;
  bool ignore_eos = false;
  std::string model_fingerprint;
  std::string kv_sender;  // the prefill worker's address: the only host the decode worker takes this KV from
  std::string kv_sender_certificate;  // under mTLS, what its certificate proved: checked instead of the host
  // Non-empty: no prefill worker; the decode worker prefills these n_prompt_tokens tokens itself and
  // its stream starts with the first token (DecodeUpdate::first_token_included).
  std::vector<int32_t> prefill_ids;
  // The n choices of one prompt (scheduler/choice_group.h): the first announces how many forks of
  // its KV will follow; a fork names the attempt it forks (no KV, no prefill_ids: the decode worker
  // shares that prompt's blocks and its stream starts with the fork's first token).
  int32_t n_forks = 0;
  std::string fork_of;
};

struct PrefillCall {
  std::string request_id;
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> generated_ids;  // already streamed before a failover; prefilled after the prompt
  SamplingParams sampling;
  std::string decode_address;  // where the prefill worker hands the KV
};

struct PrefillUpdate {
  enum class Kind { kFirstToken, kKvSent, kProgress };
  Kind kind = Kind::kFirstToken;
  int32_t token_id = 0;         // kFirstToken
  double queue_seconds = 0;     // kFirstToken: received → prefill compute start
  double prefill_seconds = 0;   // kFirstToken
  int32_t cached_tokens = 0;    // kFirstToken: leading tokens whose KV came from the prefix cache
  std::optional<TokenLogprobs> logprobs;  // kFirstToken, when the sampling asks
  double transfer_seconds = 0;  // kKvSent
  int32_t tokens_done = 0;      // kProgress: prompt positions computed so far (a long prompt's chunk)
};

struct DecodeUpdate {
  std::vector<int32_t> token_ids;  // tokens after the first
  std::vector<TokenLogprobs> logprobs;  // one per token id when the sampling asks
  bool done = false;               // the last update of the stream
  bool length = false;             // done by max_tokens (else by an end-of-sequence token)
  double decode_queue_seconds = 0; // first update: KV arrived → first decode step
  double kv_transfer_seconds = 0;  // first update
  // Local prefill, first update: token_ids[0] is the first token, with the prefill's timing.
  bool first_token_included = false;
  double queue_seconds = 0;    // admitted on the decode worker → its prefill starts
  double prefill_seconds = 0;
  int32_t cached_tokens = 0;  // a fork, first update: prompt positions whose KV it shared
};

class WorkerCall {
 public:
  virtual ~WorkerCall() = default;
  virtual void cancel() = 0;
};

class WorkerClient {
 public:
  using Done = std::function<void(const Status&)>;
  virtual ~WorkerClient() = default;

  // Reserves KV blocks on a decode worker.
  virtual void admit(const std::string& decode_address, const AdmitCall& call, CallDeadline deadline, Done done) = 0;
  // Prefills on a prefill worker: progress for each chunk of a long prompt, the first token, then
  // (once the decode worker has the KV) kv_sent, then done.
  virtual WorkerCall* prefill(const std::string& prefill_address, const PrefillCall& call, CallDeadline deadline,
                              std::function<void(const PrefillUpdate&)> on_update, Done done) = 0;
  // The tokens after the first, from the decode worker that admitted `request_id`.
  virtual WorkerCall* stream(const std::string& decode_address, const std::string& request_id, CallDeadline deadline,
                             std::function<void(const DecodeUpdate&)> on_update, Done done) = 0;
  // Frees a decode reservation (best effort, fire and forget; idempotent on the worker).
  virtual void release(const std::string& decode_address, const std::string& request_id) = 0;
};

}  // namespace baton
