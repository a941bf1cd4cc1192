// Chat templates: messages -> the prompt text a chat model was trained on.
//
// A GGUF carries its template as Jinja source (`tokenizer.chat_template`). baton does not embed a
// Jinja engine: it recognises the known formats (ChatML, Llama 3) in that source, pulls out the one
// parameter that varies between models (ChatML's default system prompt), and renders natively.
// Contract: render() returns exactly what HF's apply_chat_template(messages, tokenize=False,
// add_generation_prompt) renders with the recognised template. The Llama 3 text begins with the BOS
// token's text, so a caller that encodes it must not prepend BOS as well (add_bos() is for raw
// prompts), just as HF's apply_chat_template(tokenize=True) adds no special tokens.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"

namespace baton {

class GgufFile;

enum class ChatTemplateKind {
  kChatML,  // <|im_start|>role\ncontent<|im_end|>\n (SmolLM2, Qwen2)
  kLlama3,  // <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> (Llama 3.0)
};

struct ChatMessage {
  std::string role;  // "system", "user", "assistant" (rendered as given)
  std::string content;
};

class ChatTemplate {
 public:
  // ChatML. When `default_system` is set, a system turn with that text comes first whenever the
  // first message is not a system message (SmolLM2's and Qwen2's templates do this).
  static ChatTemplate chatml(std::optional<std::string> default_system = std::nullopt);
  // Llama 3.0: `bos_token` text first, then each turn with its content trimmed (Jinja's `trim`).
  static ChatTemplate llama3(std::string bos_token = "<|begin_of_text|>");
  // The format with default parameters (no default system prompt), as --chat-template names it.
  static ChatTemplate for_kind(ChatTemplateKind kind);

  ChatTemplateKind kind() const { return kind_; }
  const std::optional<std::string>& default_system() const { return default_system_; }
  std::string render(std::span<const ChatMessage> messages, bool add_generation_prompt) const;

 private:
  ChatTemplate(ChatTemplateKind kind, std::optional<std::string> default_system, std::string bos_token)
      : kind_(kind), default_system_(std::move(default_system)), bos_token_(std::move(bos_token)) {}

  ChatTemplateKind kind_;
  std::optional<std::string> default_system_;  // ChatML only
  std::string bos_token_;                      // Llama 3 only
};

// "chatml" | "llama3"; anything else -> INVALID_ARGUMENT listing the known names.
Result<ChatTemplateKind> chat_template_from_name(std::string_view name);
const char* chat_template_name(ChatTemplateKind kind);

// Recognises a Jinja chat template: ChatML (uses <|im_start|>), Llama 3 (uses <|start_header_id|>).
// UNIMPLEMENTED, suggesting --chat-template, for any other (Llama 3.1's dated system turn included).
// `bos_token` is the text the template's `bos_token` stands for.
Result<ChatTemplate> chat_template_from_jinja(std::string_view source, std::string_view bos_token);
// The same for `tokenizer.chat_template`; NOT_FOUND, suggesting --chat-template, when it is absent.
Result<ChatTemplate> chat_template_from_gguf(const GgufFile& file);

}  // namespace baton
