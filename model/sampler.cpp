#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

namespace baton {
namespace {

// %g: "1e-45" and "inf" rather than std::to_string's "0.000000".
std::string format_float(float x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(x));
  return buf;
}

}  // namespace

Status validate_sampling(const SamplingParams& p) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) {
    return invalid_argument("temperature must be a finite number >= 0 (0 means greedy), got " + format_float(p.temperature));
  }
  if (p.top_k < 0) return invalid_argument("top_k must be >= 0 (0 keeps every token), got " + std::to_string(p.top_k));
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return invalid_argument("top_p must be in (0, 1], got " + format_float(p.top_p));
  }
  if (!(std::fabs(p.presence_penalty) <= kMaxPenalty)) {
    return invalid_argument("presence_penalty must be in [-2, 2], got " + format_float(p.presence_penalty));
  }
  if (!(std::fabs(p.frequency_penalty) <= kMaxPenalty)) {
    return invalid_argument("frequency_penalty must be in [-2, 2], got " + format_float(p.frequency_penalty));
  }
  if (!(p.repetition_penalty >= kMinRepetitionPenalty && p.repetition_penalty <= kMaxRepetitionPenalty)) {
    return invalid_argument("repetition_penalty must be in [0.05, 20] (1: none), got " + format_float(p.repetition_penalty));
  }
  if (p.top_logprobs < -1 || p.top_logprobs > kMaxTopLogprobs) {
    return invalid_argument("top_logprobs must be in [0, 20] (or unset), got " + std::to_string(p.top_logprobs));
  }
  const auto kind = static_cast<int>(p.format.kind);
  if (kind < 0 || kind > static_cast<int>(OutputFormat::Kind::kJsonSchema)) {
    return invalid_argument("response_format.type must be TEXT, JSON_OBJECT or JSON_SCHEMA, got " + std::to_string(kind));
  }
  if (p.format.kind != OutputFormat::Kind::kJsonSchema && (!p.format.prefix.empty() || !p.format.suffix.empty())) {
    return invalid_argument("response_format.prefix and suffix go with JSON_SCHEMA only");
  }
  if ((p.format.kind == OutputFormat::Kind::kJsonSchema) == p.format.schema.empty()) {
    return invalid_argument(p.format.schema.empty() ? "response_format JSON_SCHEMA needs json_schema"
                                                    : "response_format.json_schema is set, but the type is not JSON_SCHEMA");
  }
  return {};
}

namespace {

// SplitMix64's finaliser: a bijection on 64 bits with full avalanche.
uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

}  // namespace

double sample_uniform(uint64_t seed, int64_t position) {
  // Two rounds, the position entering after the seed is mixed: nearby seeds and nearby
  // positions give unrelated numbers.
  const uint64_t x = mix64(mix64(seed + 0x9e3779b97f4a7c15ULL) ^ (static_cast<uint64_t>(position) * 0xd1b54a32d192ed03ULL));
  return static_cast<double>(x >> 11) * 0x1.0p-53;
}

Sampler::Sampler(const SamplingParams& params) : params_(params) {
  if (params_.constraint) grammar_state_ = params_.constraint->start();
}

SampleSpec Sampler::spec_at(int64_t position) const {
  SampleSpec spec;
  spec.temperature = params_.temperature;
  spec.top_k = params_.top_k;
  spec.top_p = params_.top_p;
  spec.u = params_.temperature == 0.0f ? 0.0 : sample_uniform(params_.seed, position);  // greedy draws nothing
  spec.top_logprobs = params_.top_logprobs;
  if (params_.constraint) spec.allowed = params_.constraint->mask(grammar_state_);
  return spec;
}

void Sampler::set_history(std::span<const int32_t> prompt, std::span<const int32_t> output) {
  if (params_.constraint) {
    grammar_state_ = params_.constraint->start();
    for (int32_t t : output) grammar_state_ = params_.constraint->advance(grammar_state_, t);
  }
  seen_.clear();
  if (!penalised()) return;
  if (params_.repetition_penalty != 1.0f) {
    for (int32_t t : prompt) seen_.try_emplace(t, 0);
  }
  for (int32_t t : output) ++seen_[t];
}

void Sampler::observe(int32_t token) {
  if (params_.constraint) grammar_state_ = params_.constraint->advance(grammar_state_, token);
  if (penalised()) ++seen_[token];
}

void Sampler::adjustments(int32_t row, std::vector<LogitAdjust>* out) const {
  const size_t first = out->size();
  for (const auto& [token, generated] : seen_) {
    LogitAdjust a{row, token, 1.0f, 0.0f};
    // repetition_penalty counts the prompt as well; presence and frequency the output only.
    a.repetition = params_.repetition_penalty;
    if (generated > 0) a.subtract = params_.frequency_penalty * static_cast<float>(generated) + params_.presence_penalty;
    if (a.repetition != 1.0f || a.subtract != 0.0f) out->push_back(a);
  }
  // Ascending token order: the same entries in the same order on every run, whatever the map's.
  std::sort(out->begin() + static_cast<std::ptrdiff_t>(first), out->end(),
            [](const LogitAdjust& x, const LogitAdjust& y) { return x.token < y.token; });
}

int32_t Sampler::sample(std::span<const float> logits, int64_t position, TokenLogprobs* logprobs) const {
  thread_local std::vector<float> row;
  thread_local std::vector<LogitAdjust> adjust;
  row.assign(logits.begin(), logits.end());
  adjust.clear();
  adjustments(0, &adjust);
  return sample_row(row, spec_at(position), adjust, logprobs);
}

}  // namespace baton
