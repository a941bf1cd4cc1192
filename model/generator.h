// Single-process generation (`baton generate`, and the reference the serving path is tested
// against): chunked prefill of one prompt into a paged KV cache, then one token per step until
// EOS, a stop string or max_tokens.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "kv/block_pool.h"
#include "model/model.h"
#include "model/sampler.h"

namespace baton {

struct GenerateOptions {
  int max_tokens = 256;           // tokens to generate after the prompt (0: prefill only)
  SamplingParams sampling;
  int prefill_chunk = 0;          // prompt tokens per prefill step (0: the whole prompt in one step)
  bool ignore_eos = false;        // keep going past stop ids
  std::vector<int32_t> stop_ids;  // ids that end generation (EOS, end-of-turn)
  int block_size = 16;            // KV block size in tokens
  DType kv_dtype = DType::kF32;   // KV cache element type
  bool all_prompt_logits = false; // keep logits of every prompt position (tests, --logits-all-out)
};

struct GenerateResult {
  std::vector<int32_t> tokens;       // generated ids (stop id included when it ended generation)
  std::vector<TokenLogprobs> logprobs;  // one per token when sampling.top_logprobs >= 0
  std::string finish_reason;         // "stop" | "length"
  int n_prompt = 0;
  double prefill_seconds = 0;
  double decode_seconds = 0;
  std::vector<float> last_logits;    // [n_vocab] at the last prompt position
  std::vector<float> prompt_logits;  // [n_prompt, n_vocab] when all_prompt_logits
};

class Generator {
 public:
  explicit Generator(Model& model) : model_(model) {}

  // INVALID_ARGUMENT for an empty prompt, an out-of-vocab id, or prompt + max_tokens beyond the
  // model's context. `on_token` is called with every generated id as soon as it is sampled;
  // returning false stops generation early (finish_reason "stop").
  Result<GenerateResult> generate(const std::vector<int32_t>& prompt, const GenerateOptions& options,
                                  const std::function<bool(int32_t)>& on_token = {});

 private:
  Model& model_;
};

}  // namespace baton
