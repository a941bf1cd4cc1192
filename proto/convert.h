// The protobuf ↔ baton conversions that more than one service needs (sampling parameters, model
// info). Each service keeps its own request/response conversions next to it; these are shared.
#pragma once

#include <string>

#include "baton/v1/generate.pb.h"
#include "baton/v1/worker.pb.h"
#include "model/config.h"
#include "model/sampler.h"

namespace baton {

// Unset top_p means 1 (no nucleus cut), unset repetition_penalty 1, unset top_logprobs -1 (none).
SamplingParams sampling_from_proto(const v1::SamplingParams& p);
void sampling_to_proto(const SamplingParams& s, v1::SamplingParams* p);

// A token's log-probabilities on the wire. From the wire, at most kMaxTopLogprobs alternatives
// are kept (the shorter of the two lists).
void logprob_to_proto(int32_t token, const TokenLogprobs& lp, v1::TokenLogprob* p);
TokenLogprobs logprob_from_proto(const v1::TokenLogprob& p);

// `chat_template` may be empty (no template baton knows).
void model_info_to_proto(const std::string& name, const ModelConfig& config, const std::string& fingerprint,
                         const std::string& chat_template, v1::ModelInfo* info);

// Unix time in nanoseconds (the system clock): the wall clock that load reports carry.
int64_t wall_time_unix_nanos();

// What every worker's load report says about the worker itself, for batonctl doctor: its KV
// dtype ("f32", "bf16", "f16"), its wall clock now and baton's version.
void worker_identity_to_proto(const std::string& kv_dtype, v1::LoadReport* report);

}  // namespace baton
