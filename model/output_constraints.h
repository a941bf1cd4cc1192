// Structured output on a worker: response formats compiled against this model's vocabulary,
// kept so that requests with the same schema and the same tenant scope (SamplingParams::cache_scope)
// share one constraint (its states and masks).
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "common/status.h"
#include "grammar/token_constraint.h"
#include "model/sampler.h"

namespace baton {

class Tokenizer;

// INVALID_ARGUMENT naming what the format's schema uses outside the supported subset, or the
// bound of the schema budget it passes (the frontend's check; compiles the grammar without a
// vocabulary, once for each format among the last 256 that compiled: they are kept by hash).
Status validate_output_format(const OutputFormat& format);

class OutputConstraints {
 public:
  // Constraints kept (least recently used dropped first; a dropped one lives on in the requests
  // that hold it), at most kCached of them and kCachedBytes of their automata in all (a distinct
  // large schema per request otherwise grew a worker by its automaton every time).
  static constexpr size_t kCached = 64;
  static constexpr size_t kCachedBytes = size_t{256} << 20;

  // `n_vocab`: the model's logits per row (masks cover that many; ids past the tokenizer's are
  // never allowed). Control, unknown and unused tokens are never allowed; the tokenizer's stop
  // ids end a complete output.
  OutputConstraints(const Tokenizer& tokenizer, int32_t n_vocab);

  // Sets params->constraint from params->format (null for text). INVALID_ARGUMENT for a schema
  // outside the subset.
  Status resolve(SamplingParams* params);
  const grammar::TokenVocabulary& vocabulary() const { return *vocabulary_; }

 private:
  std::shared_ptr<const grammar::TokenVocabulary> vocabulary_;
  std::mutex mu_;
  std::list<std::pair<std::string, std::shared_ptr<grammar::TokenConstraint>>> cached_;  // most recent first
};

// A worker's admission: params->constraint from params->format through `constraints`;
// FAILED_PRECONDITION naming `worker` when it has none and the format is not text.
Status resolve_format(OutputConstraints* constraints, const std::string& worker, SamplingParams* params);

}  // namespace baton
