// Token sampling from logits: greedy, temperature, top-k, top-p, seeded (same seed, same
// logits → same tokens on every run and machine).
//
// The random number of a draw is a function of (seed, position) alone, where position is the
// index in the sequence of the token being drawn (the number of tokens before it). So whichever
// process samples a position — the single-process Generator, the prefill worker (the first
// token), a decode worker, or a prefill worker re-prefilling prompt + earlier output after a
// failover — draws the same number, with no stream state to hand over.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "grammar/token_constraint.h"
#include "kernels/sampling.h"

namespace baton {

// What the output must be (OpenAI's response_format).
struct OutputFormat {
  enum class Kind { kText, kJsonObject, kJsonSchema };  // the numbers of v1.ResponseFormat.Type
  Kind kind = Kind::kText;
  std::string schema;  // kJsonSchema: the JSON Schema, as JSON text
  // Literal text before and after the JSON document (a forced tool call's tags); empty: none.
  std::string prefix = {}, suffix = {};
};

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax); > 0: softmax(logits / temperature)
  int top_k = 0;             // keep the k most likely tokens (0: all)
  float top_p = 1.0f;        // keep the smallest set whose probability reaches top_p, in (0, 1]
  uint64_t seed = 0;         // random stream seed
  // Penalties, as OpenAI and Hugging Face define them, applied to the logits before the above:
  // l -= frequency_penalty · (times the token was generated) + presence_penalty · (it was);
  // repetition_penalty divides a positive logit (multiplies a negative one) of every token in the
  // prompt or the output, and applies first. The output counts what was generated before a
  // failover too.
  float presence_penalty = 0.0f;    // [-2, 2]
  float frequency_penalty = 0.0f;   // [-2, 2]
  float repetition_penalty = 1.0f;  // [0.05, 20]; 1: none
  // >= 0: every token comes with its log-probability and this many alternatives' (<= 20).
  int top_logprobs = -1;
  OutputFormat format = {};
  // The tenant scope of what requests share on a worker: the prefix cache (kv/prefix_hash.h,
  // prefix_hash_scoped_seed) and structured output's automata (OutputConstraints). Set by the
  // frontend only (RequestBuilder: from the API key and the request's cache_salt); empty: shared
  // with every request that has none.
  std::string cache_scope = {};
  // `format` compiled against the worker's vocabulary (OutputConstraints::resolve, at admission);
  // null for plain text. Not sent anywhere: each worker resolves its own.
  std::shared_ptr<grammar::TokenConstraint> constraint = nullptr;
};

inline constexpr float kMaxPenalty = 2.0f;
inline constexpr float kMinRepetitionPenalty = 0.05f, kMaxRepetitionPenalty = 20.0f;

// INVALID_ARGUMENT naming the field when a value is out of range.
Status validate_sampling(const SamplingParams& params);

// One sequence's sampling. The random number of a draw depends on the position alone; the
// penalties on the tokens seen, which the owner reports (set_history, then observe).
// With a constraint, the draws are limited to the tokens that keep the output a prefix of its
// grammar (spec_at's `allowed`), and the grammar's state follows the output the same way.
class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // The tokens the penalties count: the prompt and the output so far (after a failover, what the
  // request generated before); the grammar's state is rebuilt from the output. Replaces what was
  // set or observed.
  void set_history(std::span<const int32_t> prompt, std::span<const int32_t> output);
  // A token generated (sampled here or handed over with the KV).
  void observe(int32_t token);
  bool penalised() const {
    return params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f || params_.repetition_penalty != 1.0f;
  }
  // Appends the penalties for logits row `row` (nothing when none is set).
  void adjustments(int32_t row, std::vector<LogitAdjust>* out) const;
  // Draws the token at sequence index `position` from that position's logits (sample_row).
  int32_t sample(std::span<const float> logits, int64_t position, TokenLogprobs* logprobs = nullptr) const;
  // The spec of that draw, for sampling on the device: Backend::sample(logits, {spec_at(p)},
  // adjustments) picks what sample(logits, p) would.
  SampleSpec spec_at(int64_t position) const;
  const SamplingParams& params() const { return params_; }

 private:
  SamplingParams params_;
  // Token → times in the output (0: in the prompt only); kept only while penalised().
  std::unordered_map<int32_t, int32_t> seen_;
  grammar::TokenConstraint::State grammar_state_ = grammar::TokenConstraint::kDead;
};

// The uniform number in [0, 1) of the draw at `position` for `seed` (53 random bits).
double sample_uniform(uint64_t seed, int64_t position);

}  // namespace baton
