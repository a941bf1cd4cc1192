// The protobuf ↔ baton conversions that more than one service needs (sampling parameters, model
// info). Each service keeps its own request/response conversions next to it; these are shared.
#pragma once

#include <string>

#include "baton/v1/generate.pb.h"
#include "model/config.h"
#include "model/sampler.h"

namespace baton {

// Unset top_p means 1 (no nucleus cut).
SamplingParams sampling_from_proto(const v1::SamplingParams& p);
void sampling_to_proto(const SamplingParams& s, v1::SamplingParams* p);

// `chat_template` may be empty (no template baton knows).
void model_info_to_proto(const std::string& name, const ModelConfig& config, const std::string& fingerprint,
                         const std::string& chat_template, v1::ModelInfo* info);

}  // namespace baton
