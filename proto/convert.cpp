#include "proto/convert.h"

#include <chrono>

#include "common/version.h"

namespace baton {

SamplingParams sampling_from_proto(const v1::SamplingParams& p) {
  SamplingParams s;
  s.temperature = p.temperature();
  s.top_k = p.top_k();
  s.top_p = p.has_top_p() ? p.top_p() : 1.0f;
  s.seed = p.seed();
  return s;
}

void sampling_to_proto(const SamplingParams& s, v1::SamplingParams* p) {
  p->set_temperature(s.temperature);
  p->set_top_k(s.top_k);
  p->set_top_p(s.top_p);
  p->set_seed(s.seed);
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
