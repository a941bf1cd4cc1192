// Chat templates: messages -> the prompt text a chat model was trained on.
//
// A model carries its template as Jinja source (GGUF `tokenizer.chat_template`, or a Hugging Face
// directory's tokenizer_config.json / chat_template.jinja). baton renders that source with its
// own Jinja engine (model/jinja.h), so the text is exactly what transformers'
// apply_chat_template(messages, tokenize=False, add_generation_prompt=...) gives: the model's
// default system prompt, its role checks and its special tokens included. Templates that begin
// with the BOS token's text (Llama 2, Llama 3, Mistral) leave it to the text: a caller that
// encodes the result must not prepend BOS as well, just as apply_chat_template(tokenize=True)
// adds no special tokens.
//
// `--chat-template NAME|FILE` replaces the model's template: a built-in one by name, or a Jinja
// file. A template baton cannot render fails at load, never at a request.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "model/jinja.h"

namespace baton {

class GgufFile;

// A function call an assistant message made (OpenAI's tool_calls[i]).
struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // a JSON object, as text
};

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", "tool" (rendered as given)
  std::string content;  // "" also for OpenAI's null (an assistant message that only calls tools)
  std::vector<ToolCall> tool_calls = {};  // assistant: the calls it made
  std::string tool_call_id = {};          // tool: the call this is the result of
};

// How a template's model writes a tool call, read from the template's source: kTagged, a JSON
// object {"name", "arguments"} between <tool_call> and </tool_call> lines (Hermes, Qwen 2.5 and 3,
// SmolLM3; also the default for templates that render no tools); kJson, a bare JSON object
// {"name", "parameters"} (Llama 3.1 and 3.2); kMistral, [TOOL_CALLS] and a JSON list of
// {"name", "arguments"} objects (Mistral 7B v0.3, Nemo, Small).
enum class ToolCallSyntax { kTagged, kJson, kMistral };

// The special tokens' text a template may print ({{ bos_token }}); empty: the model has none,
// and the template sees an undefined name, as with transformers.
struct ChatTemplateTokens {
  std::string bos_token;
  std::string eos_token;
};

class ChatTemplate {
 public:
  // Parses `source` and renders a one-message conversation with it, so a template that uses
  // Jinja baton does not render, or that cannot render the simplest chat, fails here.
  // `name` says where it came from ("model", a built-in's name, a file's path).
  static Result<ChatTemplate> from_jinja(std::string_view source, std::string name, ChatTemplateTokens tokens);
  // A built-in template: chatml, llama2, llama3, mistral, zephyr (the families' own templates).
  static Result<ChatTemplate> builtin(std::string_view name, ChatTemplateTokens tokens);
  // What --chat-template VALUE names: a Jinja file when VALUE is an existing path, else a built-in.
  static Result<ChatTemplate> from_flag(std::string_view value, ChatTemplateTokens tokens);

  const std::string& name() const { return name_; }
  // The prompt text. INVALID_ARGUMENT with the template's own words when it refuses the
  // conversation (roles that do not alternate, a system message it does not take).
  // `tools_json`: OpenAI's tools array as JSON text, given to the template as `tools` (a list of
  // {"type": "function", "function": {...}}, as transformers' apply_chat_template(tools=...)
  // takes them); empty: none. A message's tool call arguments reach the template as a mapping.
  Result<std::string> render(std::span<const ChatMessage> messages, bool add_generation_prompt,
                             std::string_view tools_json = {}) const;
  ToolCallSyntax tool_call_syntax() const { return tool_call_syntax_; }

 private:
  ChatTemplate(jinja::Template t, std::string name, ChatTemplateTokens tokens, ToolCallSyntax syntax)
      : template_(std::move(t)), name_(std::move(name)), tokens_(std::move(tokens)), tool_call_syntax_(syntax) {}

  jinja::Template template_;
  std::string name_;
  ChatTemplateTokens tokens_;
  ToolCallSyntax tool_call_syntax_ = ToolCallSyntax::kTagged;
};

// The built-in templates' names, for help texts and errors.
std::string_view chat_template_builtin_names();

// The GGUF's template and its special tokens. NOT_FOUND, suggesting --chat-template, when the
// file has none; the parse or probe error, naming --chat-template, when baton cannot render it.
Result<ChatTemplate> chat_template_from_gguf(const GgufFile& file);
ChatTemplateTokens chat_template_tokens_from_gguf(const GgufFile& file);

}  // namespace baton
