#include "model/chat_template.h"

#include <cstdint>
#include <vector>

#include "model/gguf.h"

namespace baton {
namespace {

constexpr std::string_view kChatMLSystemStart = "<|im_start|>system\n";
constexpr std::string_view kChatMLEnd = "<|im_end|>";
constexpr std::string_view kSuggestion = "; choose one with --chat-template chatml|llama3";

// Python's str.isspace() code points: Jinja's `trim` is Python's str.strip(), which also strips the
// separators U+001C..U+001F that Unicode's White_Space does not list.
bool is_python_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// The code point starting at `pos` and its length; an invalid byte counts as one non-space unit,
// which is all trim() needs.
std::pair<uint32_t, size_t> code_point_at(std::string_view s, size_t pos) {
  const auto b0 = static_cast<uint8_t>(s[pos]);
  const size_t len = b0 < 0x80 ? 1 : b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : b0 >= 0xC0 ? 2 : 1;
  if (len == 1 || pos + len > s.size()) return {len == 1 ? b0 : 0xFFFD, 1};
  uint32_t cp = b0 & (0x7F >> len);
  for (size_t k = 1; k < len; ++k) cp = cp << 6 | (static_cast<uint8_t>(s[pos + k]) & 0x3F);
  return {cp, len};
}

std::string_view python_strip(std::string_view s) {
  size_t begin = 0;
  while (begin < s.size()) {
    const auto [cp, len] = code_point_at(s, begin);
    if (!is_python_space(cp)) break;
    begin += len;
  }
  size_t end = begin;  // one past the last non-space character
  for (size_t pos = begin; pos < s.size();) {
    const auto [cp, len] = code_point_at(s, pos);
    pos += len;
    if (!is_python_space(cp)) end = pos;
  }
  return s.substr(begin, end - begin);
}

// The string literals inside the template's {{ }} and {% %} tags, unescaped as Jinja (Python)
// does. Text outside tags is output, not code, so a quote there starts no literal.
std::vector<std::string> jinja_string_literals(std::string_view source) {
  std::vector<std::string> literals;
  size_t pos = 0;
  while ((pos = source.find('{', pos)) != std::string_view::npos) {
    if (pos + 1 >= source.size() || (source[pos + 1] != '{' && source[pos + 1] != '%')) {
      ++pos;
      continue;
    }
    const char close = source[pos + 1] == '{' ? '}' : '%';
    for (pos += 2; pos < source.size(); ++pos) {
      const char c = source[pos];
      if (c == close && pos + 1 < source.size() && source[pos + 1] == '}') break;
      if (c != '\'' && c != '"') continue;
      std::string literal;
      for (++pos; pos < source.size() && source[pos] != c; ++pos) {
        if (source[pos] != '\\' || pos + 1 >= source.size()) {
          literal += source[pos];
          continue;
        }
        const char e = source[++pos];
        switch (e) {
          case 'n': literal += '\n'; break;
          case 't': literal += '\t'; break;
          case 'r': literal += '\r'; break;
          case '\\':
          case '\'':
          case '"': literal += e; break;
          default: literal += {'\\', e};  // Python keeps unknown escapes verbatim
        }
      }
      literals.push_back(std::move(literal));
    }
  }
  return literals;
}

// ChatML's default system prompt: the text of a literal that is a whole system turn,
// '<|im_start|>system\n...<|im_end|>\n', which such templates emit when messages[0] is no system
// message. Templates that never insert one have no such literal.
std::optional<std::string> chatml_default_system(std::string_view source) {
  for (std::string_view literal : jinja_string_literals(source)) {
    if (!literal.starts_with(kChatMLSystemStart)) continue;
    if (literal.ends_with('\n')) literal.remove_suffix(1);
    if (!literal.ends_with(kChatMLEnd)) continue;
    literal.remove_prefix(kChatMLSystemStart.size());
    literal.remove_suffix(kChatMLEnd.size());
    return std::string(literal);
  }
  return std::nullopt;
}

}  // namespace

ChatTemplate ChatTemplate::chatml(std::optional<std::string> default_system) {
  return ChatTemplate(ChatTemplateKind::kChatML, std::move(default_system), "");
}

ChatTemplate ChatTemplate::llama3(std::string bos_token) {
  return ChatTemplate(ChatTemplateKind::kLlama3, std::nullopt, std::move(bos_token));
}

ChatTemplate ChatTemplate::for_kind(ChatTemplateKind kind) {
  return kind == ChatTemplateKind::kChatML ? chatml() : llama3();
}

std::string ChatTemplate::render(std::span<const ChatMessage> messages, bool add_generation_prompt) const {
  std::string out;
  if (kind_ == ChatTemplateKind::kChatML) {
    // The default system turn is emitted inside the loop on its first pass, so an empty
    // conversation gets none.
    if (!messages.empty() && messages[0].role != "system" && default_system_) {
      out += std::string(kChatMLSystemStart) + *default_system_ + std::string(kChatMLEnd) + "\n";
    }
    for (const ChatMessage& m : messages) {
      out += "<|im_start|>" + m.role + "\n" + m.content + std::string(kChatMLEnd) + "\n";
    }
    if (add_generation_prompt) out += "<|im_start|>assistant\n";
    return out;
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    if (i == 0) out += bos_token_;
    out += "<|start_header_id|>" + messages[i].role + "<|end_header_id|>\n\n";
    out += python_strip(messages[i].content);
    out += "<|eot_id|>";
  }
  if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

Result<ChatTemplateKind> chat_template_from_name(std::string_view name) {
  if (name == "chatml") return ChatTemplateKind::kChatML;
  if (name == "llama3") return ChatTemplateKind::kLlama3;
  return invalid_argument("unknown chat template '" + std::string(name) + "' (known: chatml, llama3)");
}

const char* chat_template_name(ChatTemplateKind kind) {
  return kind == ChatTemplateKind::kChatML ? "chatml" : "llama3";
}

Result<ChatTemplate> chat_template_from_jinja(std::string_view source, std::string_view bos_token) {
  if (source.find("<|start_header_id|>") != std::string_view::npos) {
    // Llama 3.1 and later always open with a system turn carrying dates and tool instructions;
    // rendering them as 3.0 would silently change the prompt.
    if (source.find("Cutting Knowledge Date") != std::string_view::npos) {
      return unimplemented(
          "the model's chat template is Llama 3.1-style (it opens with a dated system turn), which baton does "
          "not render; --chat-template llama3 renders the Llama 3.0 format instead");
    }
    return ChatTemplate::llama3(std::string(bos_token));
  }
  if (source.find("<|im_start|>") != std::string_view::npos) {
    return ChatTemplate::chatml(chatml_default_system(source));
  }
  return unimplemented("the model's chat template is not one baton recognises (ChatML, Llama 3)" +
                       std::string(kSuggestion));
}

Result<ChatTemplate> chat_template_from_gguf(const GgufFile& file) {
  if (file.find("tokenizer.chat_template") == nullptr) {
    return not_found("the model has no chat template (no tokenizer.chat_template)" + std::string(kSuggestion));
  }
  BATON_ASSIGN_OR_RETURN(const std::string source, file.get_string("tokenizer.chat_template"));
  std::string bos_token = "<|begin_of_text|>";
  const std::vector<std::string>* tokens = file.string_array("tokenizer.ggml.tokens");
  if (file.find("tokenizer.ggml.bos_token_id") != nullptr && tokens != nullptr) {
    BATON_ASSIGN_OR_RETURN(const int64_t bos, file.get_int("tokenizer.ggml.bos_token_id"));
    if (bos >= 0 && bos < static_cast<int64_t>(tokens->size())) bos_token = (*tokens)[bos];
  }
  return chat_template_from_jinja(source, bos_token);
}

}  // namespace baton
