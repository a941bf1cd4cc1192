// What a prefill worker takes and reports, in the engine's own types (the gRPC service converts
// protobuf to and from them): its config, a job, and its load report.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "model/config.h"
#include "model/output_constraints.h"
#include "model/sampler.h"

namespace baton {

struct PrefillConfig {
  int token_budget = 512;            // --prefill-token-budget: most prompt tokens in one step (one forward)
  int n_blocks = 0;                  // KV blocks in the worker's cache; 0: enough for max(4 × token_budget,
                                     // the model's context) tokens
  int block_size = 16;               // tokens per KV block
  DType kv_dtype = DType::kF32;      // KV cache element type, also the dtype on the wire
  int max_queued_tokens = 65536;     // bound on prompt tokens waiting to start; a submit beyond it is
                                     // RESOURCE_EXHAUSTED (a job is always accepted into an empty queue)
  int n_senders = 4;                 // threads exporting and sending KV (each blocks on one transfer)
  bool stream_kv = true;             // a job's transfer starts with its prefill: each layer's KV of a step
                                     // leaves as soon as the forward wrote it (else after the first token)
  int64_t kv_chunk_bytes = 2 << 20;  // most K+V bytes in one KvChunk: chunks stay well below gRPC's
                                     // default 4 MiB message limit; at least one token per chunk
  std::string name;                  // this worker's name (its listen address): metric label, logs
  // --prefix-cache-blocks: most blocks the prefix cache holds (in use or idle); -1: the whole pool
  // (cached blocks are taken back whenever work in flight needs room); 0: no prefix cache.
  // Larger than the pool: the pool.
  int prefix_cache_blocks = -1;
  int prefix_report_blocks = 4096;   // most cached block hashes in a load report (8 bytes each)
  // Structured output: formats compiled against the model's vocabulary;
  // null: requests with a response format are refused.
  std::shared_ptr<OutputConstraints> constraints;
};

// INVALID_ARGUMENT naming the field when a value is out of range.
Status validate_prefill_config(const PrefillConfig& config);
// `config` (which must be valid) with n_blocks = 0 resolved against `model`: room for a few
// steps' prompts, and at least one prompt of the model's full context; prefix_cache_blocks -1
// (or more than the pool) is the whole pool.
PrefillConfig resolve_prefill_config(PrefillConfig config, const ModelConfig& model);

struct PrefillJob {
  std::string request_id;       // unique among this worker's jobs in progress
  std::vector<int32_t> tokens;  // the prompt, then the tokens generated before a failover
  int n_generated = 0;          // how many of `tokens` were generated before a failover (the first
                                // token is drawn at position tokens.size(), as the decode worker would)
  SamplingParams sampling;
  std::string decode_address;     // the decode worker that receives the KV
  std::string model_fingerprint;  // copied into the KV header (the receiver refuses a mismatch)
  // Called once, on the engine thread, as soon as the first token is sampled (before any KV moves).
  // queue_seconds: submit → the step that starts its prefill; prefill_seconds: that step's start →
  // the end of the forward that finished the prompt; n_cached_tokens: the leading tokens whose KV
  // came from the prefix cache (not computed); logprobs: the token's log-probabilities when
  // sampling.top_logprobs >= 0, else null.
  std::function<void(int32_t first_token, double queue_seconds, double prefill_seconds, int32_t n_cached_tokens,
                     const TokenLogprobs* logprobs)>
      on_first_token;
  // Called on the engine thread after each step while the prompt is not finished: with the
  // positions done so far after a chunk of it (a long prompt), with 0 while it waits for a step.
  // The frontend's progress watchdog (scheduler/progress_watch.h) hears that the worker moves.
  // May be empty.
  std::function<void(int32_t n_done)> on_progress;
  // Called exactly once for every accepted job, last: ok when the decode worker acknowledged the
  // whole KV; otherwise the transport's error, CANCELLED, or UNAVAILABLE at shutdown. Runs on the
  // engine thread, a sender thread, or (cancel of a queued job) the thread calling cancel().
  std::function<void(const Status& status, double transfer_seconds, int64_t bytes)> on_done;

  // INVALID_ARGUMENT naming the field as the Prefill RPC names it (prompt_token_ids,
  // generated_token_ids, sampling.*, decode_address) when the job does not fit `model`. The one
  // check of an incoming job: PrefillEngine::submit makes it.
  Status validate_against(const ModelConfig& model) const;
};

// What the worker reports to the frontend's scheduler.
struct PrefillLoad {
  // Prompt tokens still to compute: those of running jobs not prefilled yet, and those of waiting
  // jobs but the part the prefix cache holds now.
  int64_t queued_prompt_tokens = 0;
  int n_queued = 0;                  // jobs waiting to start
  int n_running = 0;                 // jobs being prefilled (hold blocks, prompt not finished)
  int n_sending = 0;                 // jobs whose KV is being exported or sent
  int free_blocks = 0;               // blocks no job holds: empty, or cached and idle (taken on demand)
  int total_blocks = 0;
  double step_seconds = 0;               // the slowest recent step (common/step_stats.h)
  double prefill_tokens_per_second = 0;  // prompt tokens its steps computed per second (0: none yet)
  // Its step schedule (the frontend predicts TTFT by it): the budget, a step's fitted time
  // (StepStats::Fit), and the step running now (its tokens, 0 when none, and how long it has run).
  int token_budget = 0;
  double step_fixed_seconds = 0;
  double step_seconds_per_token = 0;
  int64_t step_tokens_in_progress = 0;
  double step_elapsed_seconds = 0;
  // The prefix cache: its bound (0: none), blocks in it, its hash chain's root
  // (kv/prefix_hash.h), and the hashes of up to prefix_report_blocks cached blocks, in use first,
  // then most recently used first.
  int prefix_cache_blocks = 0;
  int n_cached_blocks = 0;
  uint64_t prefix_hash_seed = 0;
  std::vector<uint64_t> cached_block_hashes;
};

}  // namespace baton
