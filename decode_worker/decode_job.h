// What a decode worker takes and gives, in the engine's own types (the gRPC service converts
// protobuf to and from them): its config, the Admit of a request, the events of its stream, and
// its load report.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/backend.h"
#include "model/config.h"
#include "model/output_constraints.h"
#include "model/sampler.h"

namespace baton {

struct DecodeConfig {
  int max_batch = 32;            // most sequences in one decode step (--max-batch)
  int n_blocks = 0;              // KV cache blocks (each holds block_size positions of every layer)
  int block_size = 16;           // tokens per KV block
  DType kv_dtype = DType::kF32;  // KV cache element type; the prefill worker must send the same
  std::string name;              // this worker's name (its listen address): logs and metric labels
  // Local prefill (--local-prefill-max-tokens): a request admitted with its prompt of at most this
  // many tokens is prefilled here, in the decode steps, instead of its KV arriving from a prefill
  // worker (0: never). A colocated server is this with no limit.
  int local_prefill_max_tokens = 0;
  // Most prompt tokens one decode step prefills (chunked prefill, as Sarathi-Serve does): bounds how
  // long a step, and so every running sequence's next token, waits for prompts.
  int local_prefill_token_budget = 512;
  // How long a request's prompt blocks wait for the forks it announced (DecodeAdmit::n_forks) once
  // its KV is complete; a frontend sends them a round trip after it hears the KV arrived.
  std::chrono::milliseconds fork_hold{10'000};
  // How often a sequence that waits for one of max_batch slots gets an empty event (a beat): the
  // frontend's progress bound (scheduler/progress_watch.h) covers a step, not a wait for another
  // sequence to finish, and the n choices of one prompt may outnumber the batch.
  std::chrono::milliseconds slot_wait_beat{500};
  // Structured output: formats compiled against the model's vocabulary;
  // null: requests with a response format are refused.
  std::shared_ptr<OutputConstraints> constraints;
};

// INVALID_ARGUMENT naming the field when a value is out of range (the one place it is checked).
Status validate_decode_config(const DecodeConfig& config);
// Bytes one KV block takes over all layers (K and V): divide a memory budget by it for n_blocks.
int64_t decode_kv_block_bytes(const ModelConfig& model, int block_size, DType kv_dtype);

using DecodeClock = std::chrono::steady_clock;

// What the frontend reserves before the prefill worker sends the KV (or, with prefill_tokens, what
// this worker prefills itself).
struct DecodeAdmit {
  std::string request_id;
  int32_t n_prompt_tokens = 0;  // tokens whose KV will arrive (prompt, plus earlier output on failover)
  int32_t n_output_tokens = 0;  // of those, the trailing ones the request generated before (the penalties count them)
  // Non-empty: prefill these n_prompt_tokens tokens here (local prefill) and sample the first token;
  // no KV transfer comes. At most DecodeConfig::local_prefill_max_tokens of them.
  std::vector<int32_t> prefill_tokens;
  int32_t max_tokens = 0;       // tokens still to produce, counting the first (sampled by prefill)
  SamplingParams sampling;
  bool ignore_eos = false;                          // keep going past stop ids
  std::string model_fingerprint;                    // the frontend's view of the model: must be ours
  std::optional<DecodeClock::time_point> deadline;  // the request ends DEADLINE_EXCEEDED after it
  // Who admitted it (common/tls.h's peer_identity): when set, attach and release are honoured
  // only from the same owner. "" = no check (in-process callers).
  std::string owner;
  // The hosts ("ipv4:10.0.0.5") the KV may come from (the prefill worker Admit named); empty =
  // any. kv_begin from another host is PERMISSION_DENIED.
  std::vector<std::string> kv_senders;
  // The certificate (common/tls.h peer_certificate) the prefill worker proved to the frontend;
  // when set, the KV is taken from the peer proving it, wherever it connects from, and from no
  // other (mTLS). Empty: kv_senders decides (plaintext, --insecure).
  std::string kv_sender_certificate;
  // The n choices of one prompt (OpenAI's n) share its KV here. The first choice's Admit says how
  // many forks of it will follow (n_forks); once its KV is complete, the blocks of its prompt are
  // held for them (DecodeConfig::fork_hold at most). A fork's Admit names that request (fork_of) instead of
  // sending KV or tokens: it takes the prompt's full blocks as they are, copies the positions of
  // the last partial one before the prompt's last (copy-on-write: the first choice goes on
  // writing there), computes the prompt's last position itself and samples its own first token.
  int32_t n_forks = 0;  // in [0, kMaxForks]; with fork_of, 0
  std::string fork_of;  // a request admitted here with n_forks > 0, by the same owner
  static constexpr int32_t kMaxForks = 255;

  // INVALID_ARGUMENT naming the field when the request does not fit `model` (counts, the context,
  // sampling, the ids to prefill): DecodeEngine::admit's one check of what the model allows.
  Status validate_against(const ModelConfig& model) const;
};

// One event of a request's stream. An event with no tokens, not done, is a beat: the sequence is
// runnable but waits for one of max_batch slots (DecodeConfig::slot_wait_beat apart), so that the
// frontend's progress watchdog hears the worker moves. token_ids are new tokens (tokens 2..N: the first token reached
// the frontend from the prefill worker and is never repeated here), except for a request
// prefilled here: its first event starts with the first token (first_token_included).
struct DecodeOutput {
  std::vector<int32_t> token_ids;
  std::vector<TokenLogprobs> logprobs;  // one per token id when the request asks (sampling.top_logprobs >= 0)
  bool done = false;
  Status status;                    // on the final event: ok, or why it ended abnormally
  std::string finish_reason;        // on an ok final event: "stop" | "length"
  double decode_queue_seconds = 0;  // on the first event: KV complete → first decode step
  double kv_transfer_seconds = 0;   // on the first event: kv_begin → kv_end
  bool first_token_included = false;  // local prefill: token_ids[0] is the first token
  double queue_seconds = 0;           // local prefill, first event: admitted → its first chunk's step
  double prefill_seconds = 0;         // local prefill, first event: that step's start → the prompt done
  int32_t cached_tokens = 0;          // a fork, first event: the prompt positions whose KV it shared
};

using DecodeSink = std::function<void(const DecodeOutput&)>;

struct DecodeLoad {
  int64_t free_blocks = 0;
  int64_t total_blocks = 0;
  int32_t block_size = 0;
  int32_t n_running = 0;  // KV complete: generating (in the step, or waiting for one of max_batch slots)
  int32_t n_waiting = 0;  // admitted, KV not yet complete (or not yet prefilled here)
  int32_t local_prefill_max_tokens = 0;  // DecodeConfig's: the longest prompt this worker prefills
  int64_t queued_prompt_tokens = 0;      // local prefill: prompt tokens admitted here, not yet prefilled
  double step_seconds = 0;               // the slowest recent step (common/step_stats.h)
  double prefill_tokens_per_second = 0;  // local prefill: prompt tokens per second of its steps (0: none yet)
};

}  // namespace baton
