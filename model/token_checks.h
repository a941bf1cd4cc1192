// The checks every process applies to token ids it is sent: each id inside the model's vocabulary,
// and the positions a request will occupy inside the model's context. One wording wherever a
// request is refused, naming what the caller sent, so a message reads the same from any process.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "common/status.h"
#include "model/config.h"

namespace baton {

// INVALID_ARGUMENT "<name> = <id> is outside the vocabulary [0, n_vocab)" unless
// 0 <= id < model.n_vocab. `name` says which id: "first_token", "request r1: first token".
Status check_token_id(int32_t id, const ModelConfig& model, std::string_view name);

// check_token_id for each of `ids`, named "<name>[i]"; the first id outside refuses them all.
// `name` leads the message: a field name there ("prompt_token_ids") names the field to the client.
Status check_token_ids(std::span<const int32_t> ids, const ModelConfig& model, std::string_view name);

// INVALID_ARGUMENT "<what>: <n_positions> tokens, more than the model's context of <n_ctx>" unless
// n_positions <= model.n_ctx. n_positions: every position the request will occupy, its tokens and
// those it may add; `what` spells out that sum ("prompt (12 tokens) + max_tokens (20)").
Status check_context(int64_t n_positions, const ModelConfig& model, std::string_view what);

}  // namespace baton
