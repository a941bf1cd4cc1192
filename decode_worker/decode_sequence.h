// What DecodeEngine keeps per request, shared by its files (decode_engine.cpp: admission and the
// step loop; decode_engine_kv.cpp: the KV hand-off). Not part of the engine's interface.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/seconds.h"
#include "decode_worker/decode_engine.h"
#include "model/sampler.h"

namespace baton {

inline std::string n_str(int64_t n) { return std::to_string(n); }

enum class SeqState {
  kWaitingKv,  // admitted: blocks reserved, KV not (completely) arrived
  kPrefilling, // admitted with its prompt: prefilled here, chunk by chunk, in the decode steps
  kRunning,    // KV complete: in running_, generating
  kFinished,   // ended; blocks freed (or freed when the last import returns); events may wait for a sink
};

// One request. Fields marked (engine) are touched only by the engine thread once the sequence is
// running; everything else is guarded by DecodeEngine::mu_.
struct DecodeEngine::Sequence {
  explicit Sequence(const DecodeAdmit& a) : admit(a), sampler(a.sampling) {}

  // The penalties' history from the tokens whose KV this worker holds (the KV's or the local
  // prefill's): the last admit.n_output_tokens of them are earlier output.
  void set_sampler_history(std::span<const int32_t> tokens) {
    const size_t n_out = std::min(tokens.size(), static_cast<size_t>(std::max(admit.n_output_tokens, 0)));
    sampler.set_history(tokens.first(tokens.size() - n_out), tokens.last(n_out));
  }

  DecodeAdmit admit;
  SeqState state = SeqState::kWaitingKv;
  std::vector<int32_t> table;  // blocks covering n_prompt_tokens + max_tokens positions
  DecodeClock::time_point admitted_at = DecodeClock::now();

  // ---- KV transfer (kWaitingKv) ----
  bool kv_begun = false;
  int32_t first_token = 0;
  int n_importing = 0;          // kv_import calls in flight (outside the lock) into `table`
  bool free_when_idle = false;  // finished while importing: the last import frees the blocks
  DecodeClock::time_point kv_begin_at, kv_end_at;
  std::vector<int32_t> kv_tokens;  // with admit.n_forks: the KV's token ids, which its forks prefill after

  // ---- a fork (admit.fork_of) ----
  int32_t n_forked = 0;    // leading prompt positions whose blocks it shares (or copies) from its source
  int32_t copy_from = -1;  // (engine) the source's block with the positions it copies (held until copied)
  int32_t n_copy = 0;      // (engine) how many: those of its first own block, before the prompt's last

  // ---- local prefill (kPrefilling) ----
  int32_t n_prefilled = 0;                  // (engine) prompt tokens whose KV is in the cache
  bool prefill_started = false;             // a chunk has been planned
  DecodeClock::time_point prefill_start_at;  // the step that took its first chunk began
  double queue_seconds = 0, prefill_seconds = 0;

  // ---- decoding ----
  Sampler sampler;                   // (engine)
  int32_t next_token = 0;            // (engine) input of the next step
  int32_t position = 0;              // (engine) its position
  int32_t n_generated = 0;           // tokens produced, counting the first (from prefill)
  bool stepped = false;              // the first decode step ran
  std::optional<Status> cancel_why;  // a running sequence ends with this at the next step boundary

  // ---- output ----
  DecodeSink sink;       // set once by attach()
  DecodeOutput pending;  // events not yet handed to the sink, merged
  bool has_pending = false;
  bool timing_sent = false;           // the timings go on the first delivered event with tokens (or the end)
  DecodeClock::time_point last_beat;  // (guarded) its last event while it waited for a batch slot
  double decode_queue_seconds = 0;
  double kv_transfer_seconds = 0;
  DecodeClock::time_point finished_at;
};

}  // namespace baton
