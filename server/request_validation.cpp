#include "server/request_validation.h"

#include "model/token_checks.h"
#include "proto/convert.h"

#include <algorithm>
#include <cmath>
#include <span>

namespace baton {
namespace {

constexpr size_t kMaxRequestIdBytes = 128;
constexpr size_t kMaxStopStrings = 16;
constexpr size_t kMaxStopBytes = 256;

bool printable_ascii(const std::string& s) {
  for (unsigned char c : s) {
    if (c < 0x21 || c > 0x7E) return false;
  }
  return true;
}

}  // namespace

std::string quote_input(const std::string& s) {
  static const char* hex = "0123456789abcdef";
  std::string body;
  size_t i = 0;
  for (; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const bool plain = c >= 0x20 && c < 0x7F && c != '\\' && c != '\'';
    if (body.size() + (plain ? 1 : 4) > kMaxEchoBytes) break;
    if (plain) {
      body += static_cast<char>(c);
    } else {
      body += "\\x";
      body += hex[c >> 4];
      body += hex[c & 15];
    }
  }
  std::string out = "'" + body + "'";
  if (i < s.size()) out += " (cut, " + std::to_string(s.size()) + " bytes)";
  return out;
}

size_t max_prompt_bytes(const Tokenizer& tokenizer, int64_t n_ctx) {
  size_t longest = 1;
  for (int32_t id = 0; id < tokenizer.n_vocab(); ++id) longest = std::max(longest, tokenizer.token_bytes(id).size());
  return static_cast<size_t>(n_ctx) * longest;
}

Result<ValidRequest> validate_request(const v1::GenerateRequest& r, const ServedModel& m,
                                        const std::string& generated_id, const ValidationOptions& options) {
  ValidRequest valid;
  PipelineRequest& spec = valid.pipeline;
  spec.label = r.request_id().empty() ? generated_id : r.request_id();
  if (spec.label.size() > kMaxRequestIdBytes || !printable_ascii(spec.label)) {
    return invalid_argument("request_id must be at most 128 printable ASCII characters without spaces");
  }
  if (!r.model().empty() && r.model() != m.name) {
    return invalid_argument("model " + quote_input(r.model()) + " is not served here (ListModels: '" + m.name + "')");
  }
  const int n_forms = (r.prompt().empty() ? 0 : 1) + (r.prompt_token_ids_size() > 0 ? 1 : 0) + (r.messages_size() > 0 ? 1 : 0);
  if (n_forms == 0) {
    return invalid_argument("the prompt is empty: set one of prompt, prompt_token_ids or messages");
  }
  if (n_forms > 1) {
    return invalid_argument("set only one of prompt, prompt_token_ids and messages (the request sets several)");
  }
  // Every token stands for at most the longest token's bytes: text over n_ctx times that cannot
  // fit, and is refused before tokenising it costs anything.
  size_t text_bytes = r.prompt().size();
  for (const auto& msg : r.messages()) text_bytes += msg.content().size();
  if (m.max_prompt_bytes > 0 && text_bytes > m.max_prompt_bytes) {
    return invalid_argument("the prompt is " + std::to_string(text_bytes) + " bytes: more than the context of " +
                            std::to_string(m.config.n_ctx) + " tokens can hold (at most " +
                            std::to_string(m.max_prompt_bytes) + " bytes); shorten it");
  }
  if (!r.prompt().empty()) {
    auto ids = m.tokenizer->encode(r.prompt(), /*parse_special=*/true);
    if (!ids.ok()) return invalid_argument("prompt: " + ids.status().message());
    spec.prompt_ids = std::move(*ids);
    if (m.tokenizer->add_bos()) spec.prompt_ids.insert(spec.prompt_ids.begin(), m.tokenizer->bos_id());
  } else if (r.prompt_token_ids_size() > 0) {
    const std::span<const int32_t> ids(r.prompt_token_ids().data(), static_cast<size_t>(r.prompt_token_ids_size()));
    // Counted before any is checked or copied.
    BATON_RETURN_IF_ERROR(check_context(static_cast<int64_t>(ids.size()) + 1, m.config,
                                        "prompt_token_ids (" + std::to_string(ids.size()) + " ids) + one new token"));
    BATON_RETURN_IF_ERROR(check_token_ids(ids, m.config, "prompt_token_ids"));
    spec.prompt_ids.assign(ids.begin(), ids.end());
  } else {
    if (!m.chat_template) {
      return invalid_argument("messages: this model has no chat template baton knows; send prompt text instead");
    }
    std::vector<ChatMessage> messages;
    for (int i = 0; i < r.messages_size(); ++i) {
      const auto& msg = r.messages(i);
      if (msg.role() != "system" && msg.role() != "user" && msg.role() != "assistant") {
        return invalid_argument("messages[" + std::to_string(i) + "].role must be system, user or assistant, got " +
                                quote_input(msg.role()));
      }
      messages.push_back({msg.role(), msg.content()});
    }
    auto text = m.chat_template->render(messages, /*add_generation_prompt=*/true);
    if (!text.ok()) return invalid_argument("messages: " + text.status().message());
    auto ids = m.tokenizer->encode(*text, true);
    if (!ids.ok()) return invalid_argument("messages: " + ids.status().message());
    spec.prompt_ids = std::move(*ids);
  }
  if (spec.prompt_ids.empty()) return invalid_argument("the prompt is empty after tokenization");

  const int64_t n_prompt = static_cast<int64_t>(spec.prompt_ids.size());
  if (r.max_tokens() < 0 || (r.max_tokens() == 0 && !options.max_tokens_zero_fills_context)) {
    return invalid_argument("max_tokens must be >= 1, got " + std::to_string(r.max_tokens()));
  }
  if (r.max_tokens() > 0) {
    // Named max_tokens first: that is the field a client lowers.
    BATON_RETURN_IF_ERROR(check_context(n_prompt + r.max_tokens(), m.config,
                                        "max_tokens (" + std::to_string(r.max_tokens()) + ") + prompt (" +
                                            std::to_string(n_prompt) + " tokens)"));
    spec.max_tokens = r.max_tokens();
  } else {
    // max_tokens 0 (chat's default here): the rest of the context, which must hold one token at least.
    BATON_RETURN_IF_ERROR(check_context(n_prompt + 1, m.config,
                                        "the prompt (" + std::to_string(n_prompt) + " tokens) + one new token"));
    spec.max_tokens = static_cast<int32_t>(m.config.n_ctx - n_prompt);
  }

  spec.sampling = sampling_from_proto(r.sampling());
  if (Status st = validate_sampling(spec.sampling); !st.ok()) return invalid_argument("sampling." + st.message());

  if (static_cast<size_t>(r.stop_size()) > kMaxStopStrings) {
    return invalid_argument("stop: at most " + std::to_string(kMaxStopStrings) + " stop strings");
  }
  for (int i = 0; i < r.stop_size(); ++i) {
    if (r.stop(i).empty() || r.stop(i).size() > kMaxStopBytes) {
      return invalid_argument("stop[" + std::to_string(i) + "] must be 1 to 256 bytes");
    }
    valid.stop.push_back(r.stop(i));
  }
  spec.ignore_eos = r.ignore_eos();
  if (r.priority() < -kPriorityBound || r.priority() > kPriorityBound) {
    return invalid_argument("priority must be in [" + std::to_string(-kPriorityBound) + ", " +
                            std::to_string(kPriorityBound) + "], got " + std::to_string(r.priority()));
  }
  const std::optional<int32_t>& key_max_priority = options.key_max_priority;
  const int32_t bound = key_max_priority.value_or(m.max_priority);
  if (r.priority() > bound) {
    return permission_denied("priority " + std::to_string(r.priority()) + " is above " + std::to_string(bound) +
                             (key_max_priority ? ", the highest this API key may ask for (its max-priority in "
                                                 "--api-key-file)"
                                               : ", the highest this frontend lets clients ask for (--max-priority, or "
                                                 "an API key's max-priority)") +
                             "; lower priorities are always allowed");
  }
  spec.priority = r.priority();
  spec.stop_ids = m.tokenizer->stop_ids();
  spec.model_fingerprint = m.fingerprint;
  return valid;
}

v1::ModelInfo model_info(const ServedModel& m) {
  v1::ModelInfo info;
  model_info_to_proto(m.name, m.config, m.fingerprint, m.chat_template ? m.chat_template->name() : "",
                      &info);
  return info;
}

}  // namespace baton
