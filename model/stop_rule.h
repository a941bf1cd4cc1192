// Where a generation ends: the one rule that the decode engine, the single-process generator and
// the frontend's request pipeline all apply, so that the three agree token for token. A generated
// id in stop_ids ends it ("stop", that id included) unless ignore_eos; reaching max_tokens
// generated tokens ends it ("length"). When the max_tokens-th token is a stop id, "stop" wins.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace baton {

enum class FinishReason { kNone, kStop, kLength };

// "stop", "length"; "" for kNone. The names the public API reports.
const char* finish_reason_name(FinishReason reason);

// A view: stop_ids must outlive the rule (build one where it is applied, it costs nothing).
struct StopRule {
  std::span<const int32_t> stop_ids;  // ids that end generation (EOS, end-of-turn)
  bool ignore_eos = false;            // keep going past stop_ids
  int64_t max_tokens = 0;             // most tokens generated, counting the first

  // Whether `id` ends the generation by itself (in stop_ids, and ignore_eos is off).
  bool is_stop(int32_t id) const;

  // The end reached once `id` has been generated as the n_generated-th token (n_generated counts
  // it): kStop for a stop id, else kLength at max_tokens, else kNone.
  FinishReason after(int32_t id, int64_t n_generated) const;

  // Of `ids`, offered after n_before generated tokens: how many are kept (never past max_tokens,
  // nothing after a stop id, which is kept) and the end they reach (kNone: generation goes on).
  struct Taken {
    size_t n = 0;
    FinishReason end = FinishReason::kNone;
  };
  Taken take(std::span<const int32_t> ids, int64_t n_before) const;
};

}  // namespace baton
