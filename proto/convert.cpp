#include "proto/convert.h"

#include <algorithm>
#include <chrono>

#include "common/version.h"

namespace baton {

SamplingParams sampling_from_proto(const v1::SamplingParams& p) {
  SamplingParams s;
  s.temperature = p.temperature();
  s.top_k = p.top_k();
  s.top_p = p.has_top_p() ? p.top_p() : 1.0f;
  s.seed = p.seed();
  s.presence_penalty = p.presence_penalty();
  s.frequency_penalty = p.frequency_penalty();
  s.repetition_penalty = p.has_repetition_penalty() ? p.repetition_penalty() : 1.0f;
  s.top_logprobs = p.has_top_logprobs() ? p.top_logprobs() : -1;
  // An unknown type keeps its number, for validate_sampling to refuse.
  s.format.kind = static_cast<OutputFormat::Kind>(p.response_format().type());
  s.format.schema = p.response_format().json_schema();
  s.format.prefix = p.response_format().prefix();
  s.format.suffix = p.response_format().suffix();
  s.cache_scope = p.cache_scope();
  return s;
}

void sampling_to_proto(const SamplingParams& s, v1::SamplingParams* p) {
  p->set_temperature(s.temperature);
  p->set_top_k(s.top_k);
  p->set_top_p(s.top_p);
  p->set_seed(s.seed);
  p->set_presence_penalty(s.presence_penalty);
  p->set_frequency_penalty(s.frequency_penalty);
  if (s.repetition_penalty != 1.0f) p->set_repetition_penalty(s.repetition_penalty);
  if (s.top_logprobs >= 0) p->set_top_logprobs(s.top_logprobs);
  if (s.format.kind != OutputFormat::Kind::kText) {
    p->mutable_response_format()->set_type(static_cast<v1::ResponseFormat::Type>(s.format.kind));
    p->mutable_response_format()->set_json_schema(s.format.schema);
    p->mutable_response_format()->set_prefix(s.format.prefix);
    p->mutable_response_format()->set_suffix(s.format.suffix);
  }
  if (!s.cache_scope.empty()) p->set_cache_scope(s.cache_scope);
}

void logprob_to_proto(int32_t token, const TokenLogprobs& lp, v1::TokenLogprob* p) {
  p->set_token_id(token);
  p->set_logprob(lp.logprob);
  for (int i = 0; i < lp.n_top; ++i) {
    p->add_top_token_ids(lp.top_ids[i]);
    p->add_top_logprobs(lp.top_logprobs[i]);
  }
}

TokenLogprobs logprob_from_proto(const v1::TokenLogprob& p) {
  TokenLogprobs lp;
  lp.logprob = p.logprob();
  lp.n_top = std::min({p.top_token_ids_size(), p.top_logprobs_size(), kMaxTopLogprobs});
  for (int i = 0; i < lp.n_top; ++i) {
    lp.top_ids[i] = p.top_token_ids(i);
    lp.top_logprobs[i] = p.top_logprobs(i);
  }
  return lp;
}

void model_info_to_proto(const std::string& name, const ModelConfig& c, const std::string& fingerprint,
                         const std::string& chat_template, v1::ModelInfo* info) {
  info->set_name(name);
  info->set_architecture(c.arch);
  info->set_fingerprint(fingerprint);
  info->set_context_length(c.n_ctx);
  info->set_vocab_size(c.n_vocab);
  info->set_chat_template(chat_template);
}

int64_t wall_time_unix_nanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void worker_identity_to_proto(const std::string& kv_dtype, v1::LoadReport* report) {
  report->set_kv_dtype(kv_dtype);
  report->set_wall_time_unix_nanos(wall_time_unix_nanos());
  report->set_version(baton_version());
}

}  // namespace baton
