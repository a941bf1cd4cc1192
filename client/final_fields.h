// Fields of a Generate stream's final message that this client reads when the server's schema
// has them, by name through protobuf reflection: a field added to generate.proto later is read
// without a change here, and a build whose generate.proto lacks it reports "not reported".
#pragma once

#include <google/protobuf/message.h>

#include <cstdint>
#include <optional>

namespace baton::ctl {

// The field this reads: the prompt tokens whose KV came from a prefix cache (not prefilled).
constexpr const char* kCachedPromptTokensField = "cached_prompt_tokens";

// `message`'s (Timing's, or Usage's) cached_prompt_tokens: nullopt when the message type has no
// such integer field, or the field tracks presence and is unset.
std::optional<int64_t> cached_prompt_tokens(const google::protobuf::Message& message);

}  // namespace baton::ctl
