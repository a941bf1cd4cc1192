#include "model/chat_template.h"

#include <array>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/json_bounds.h"
#include "common/json_parse.h"
#include "model/gguf.h"

namespace baton {
namespace {

// The families' own templates, as their models ship them (ChatML as Qwen2 writes it, without
// the default system prompt).
constexpr std::string_view kChatML =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

// Llama-2-chat: the system prompt inside the first [INST] between <<SYS>> markers; roles must
// alternate starting with the user.
constexpr std::string_view kLlama2 =
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif "
    "%}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ "
    "raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if "
    "loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if "
    "message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] "
    "== 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}";

// Meta-Llama-3-Instruct (3.0).
constexpr std::string_view kLlama3 =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% "
    "endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

// Mistral-7B-Instruct v0.2 (and v0.1 since 2024): [INST] turns, an optional system message
// joined to the first user turn; roles must alternate.
constexpr std::string_view kMistral = R"({%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
)";

// Zephyr: <|role|> headers, each turn closed by EOS.
constexpr std::string_view kZephyr =
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + "
    "eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n{% "
    "elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif "
    "%}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}";

constexpr std::array<std::pair<std::string_view, std::string_view>, 5> kBuiltins = {{
    {"chatml", kChatML},
    {"llama2", kLlama2},
    {"llama3", kLlama3},
    {"mistral", kMistral},
    {"zephyr", kZephyr},
}};

constexpr std::string_view kNames = "chatml, llama2, llama3, mistral, zephyr";

std::string suggestion() {
  return "; give --chat-template NAME (" + std::string(kNames) + ") or --chat-template FILE.jinja";
}

// JSON → the template's values (objects keep their member order, as Python's json does).
jinja::Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::boolean: return jinja::Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
    case nlohmann::ordered_json::value_t::number_unsigned: return jinja::Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_float: return jinja::Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return jinja::Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      jinja::Value::List items;
      for (const auto& x : j) items.push_back(from_json(x));
      return jinja::Value::list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      jinja::Value::Dict items;
      for (const auto& [k, x] : j.items()) items.emplace_back(k, from_json(x));
      return jinja::Value::dict(std::move(items));
    }
    default: return jinja::Value::none();
  }
}

// Text that should be JSON (validated where it came in, and its depth by render); a value that is
// not stays a string.
jinja::Value from_json_text(std::string_view text) {
  nlohmann::ordered_json j;
  return parse_ordered_json(text, &j) ? from_json(j) : jinja::Value(std::string(text));
}

jinja::Value globals(std::span<const ChatMessage> messages, bool add_generation_prompt,
                     const ChatTemplateTokens& tokens, std::string_view tools_json) {
  jinja::Value::List list;
  for (const ChatMessage& m : messages) {
    jinja::Value::Dict d = {{"role", jinja::Value(m.role)},
                            {"content", jinja::Value(m.content)}};
    if (!m.tool_calls.empty()) {
      jinja::Value::List calls;
      for (const ToolCall& c : m.tool_calls) {
        calls.push_back(jinja::Value::dict(
            {{"id", jinja::Value(c.id)},
             {"type", jinja::Value("function")},
             {"function", jinja::Value::dict({{"name", jinja::Value(c.name)}, {"arguments", from_json_text(c.arguments)}})}}));
      }
      d.emplace_back("tool_calls", jinja::Value::list(std::move(calls)));
    }
    if (!m.tool_call_id.empty()) d.emplace_back("tool_call_id", jinja::Value(m.tool_call_id));
    list.push_back(jinja::Value::dict(std::move(d)));
  }
  jinja::Value::Dict g = {
      {"messages", jinja::Value::list(std::move(list))},
      {"add_generation_prompt", jinja::Value(add_generation_prompt)},
      {"tools", tools_json.empty() ? jinja::Value::none() : from_json_text(tools_json)},
      {"documents", jinja::Value::none()},
  };
  if (!tokens.bos_token.empty()) g.emplace_back("bos_token", jinja::Value(tokens.bos_token));
  if (!tokens.eos_token.empty()) g.emplace_back("eos_token", jinja::Value(tokens.eos_token));
  return jinja::Value::dict(std::move(g));
}

}  // namespace

Result<ChatTemplate> ChatTemplate::from_jinja(std::string_view source, std::string name, ChatTemplateTokens tokens) {
  const std::string where = name == "model" ? "the model's chat template" : "the chat template " + name;
  auto parsed = jinja::Template::parse(source);
  if (!parsed.ok()) {
    return Status(parsed.status().code(), where + ", " + parsed.status().message() + suggestion());
  }
  // Llama 3.1's template writes calls as {"name": ..., "parameters": ...} with no tags around them;
  // Mistral's after [TOOL_CALLS].
  ToolCallSyntax syntax = ToolCallSyntax::kTagged;
  if (source.find("<tool_call>") == std::string_view::npos) {
    if (source.find("[TOOL_CALLS]") != std::string_view::npos) {
      syntax = ToolCallSyntax::kMistral;
    } else if (source.find("\"parameters\": ") != std::string_view::npos) {
      syntax = ToolCallSyntax::kJson;
    }
  }
  ChatTemplate t(std::move(*parsed), std::move(name), std::move(tokens), syntax);
  const ChatMessage probe[] = {{"user", "Hello"}};
  auto rendered = t.render(probe, /*add_generation_prompt=*/true);
  if (!rendered.ok()) {
    return Status(rendered.status().code(),
                  where + " cannot render a one-message chat: " + rendered.status().message() + suggestion());
  }
  return t;
}

Result<ChatTemplate> ChatTemplate::builtin(std::string_view name, ChatTemplateTokens tokens) {
  for (const auto& [n, source] : kBuiltins) {
    if (n == name) return from_jinja(source, std::string(n), std::move(tokens));
  }
  return invalid_argument("--chat-template: unknown template '" + std::string(name) + "' (built in: " +
                          std::string(kNames) + "; or the path of a Jinja file)");
}

Result<ChatTemplate> ChatTemplate::from_flag(std::string_view value, ChatTemplateTokens tokens) {
  const std::filesystem::path path(value);
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return builtin(value, std::move(tokens));
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) return not_found("--chat-template: cannot read " + std::string(value));
  return from_jinja(text.str(), std::string(value), std::move(tokens));
}

Result<std::string> ChatTemplate::render(std::span<const ChatMessage> messages, bool add_generation_prompt,
                                         std::string_view tools_json) const {
  if (messages.empty()) return invalid_argument("there are no messages to render");  // as transformers refuses
  // The JSON the template is given as values is walked recursively: bounded here for every caller.
  BATON_RETURN_IF_ERROR(check_json_bounds(tools_json, "tools"));
  for (size_t i = 0; i < messages.size(); ++i) {
    for (size_t c = 0; c < messages[i].tool_calls.size(); ++c) {
      BATON_RETURN_IF_ERROR(check_json_bounds(messages[i].tool_calls[c].arguments, "messages[" + std::to_string(i) +
                                                                                      "].tool_calls[" + std::to_string(c) +
                                                                                      "].function.arguments"));
    }
  }
  auto text = template_.render(globals(messages, add_generation_prompt, tokens_, tools_json));
  if (!text.ok() && text.status().code() == StatusCode::kFailedPrecondition) {
    return invalid_argument("the chat template refuses these messages: " + text.status().message());
  }
  if (!text.ok()) return invalid_argument("the chat template failed at " + text.status().message());
  return text;
}

std::string_view chat_template_builtin_names() { return kNames; }

ChatTemplateTokens chat_template_tokens_from_gguf(const GgufFile& file) {
  ChatTemplateTokens tokens;
  const std::vector<std::string>* vocab = file.string_array("tokenizer.ggml.tokens");
  const auto text_of = [&](const char* key) -> std::string {
    if (vocab == nullptr || file.find(key) == nullptr) return "";
    auto id = file.get_int(key);
    if (!id.ok() || *id < 0 || *id >= static_cast<int64_t>(vocab->size())) return "";
    return (*vocab)[static_cast<size_t>(*id)];
  };
  tokens.bos_token = text_of("tokenizer.ggml.bos_token_id");
  tokens.eos_token = text_of("tokenizer.ggml.eos_token_id");
  return tokens;
}

Result<ChatTemplate> chat_template_from_gguf(const GgufFile& file) {
  if (file.find("tokenizer.chat_template") == nullptr) {
    return not_found("the model has no chat template (no tokenizer.chat_template)" + suggestion());
  }
  BATON_ASSIGN_OR_RETURN(const std::string source, file.get_string("tokenizer.chat_template"));
  return ChatTemplate::from_jinja(source, "model", chat_template_tokens_from_gguf(file));
}

}  // namespace baton
