#include "model/model_files.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "model/hf_model.h"

namespace baton {
namespace {

namespace fs = std::filesystem;
nlohmann::json read_json(const fs::path& file) {
  std::ifstream in(file);
  if (!in) return nlohmann::json();
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

// A special token as tokenizer_config.json or special_tokens_map.json writes it: a string, or an
// AddedToken object with its "content".
std::string special_token_text(const nlohmann::json& config, const char* key) {
  if (!config.is_object() || !config.contains(key)) return "";
  const auto& t = config.at(key);
  if (t.is_string()) return t.get<std::string>();
  if (t.is_object() && t.contains("content") && t.at("content").is_string()) return t.at("content").get<std::string>();
  return "";
}

// The text of bos_token and eos_token as transformers gives them to a template: from
// tokenizer_config.json, else special_tokens_map.json, else the tokenizer's own BOS/EOS.
ChatTemplateTokens hf_template_tokens(const fs::path& dir, const nlohmann::json& config, const Tokenizer& tokenizer) {
  const nlohmann::json map = read_json(dir / "special_tokens_map.json");
  ChatTemplateTokens tokens;
  const auto pick = [&](const char* key, int32_t id) {
    std::string text = special_token_text(config, key);
    if (text.empty()) text = special_token_text(map, key);
    if (text.empty() && id >= 0) text = tokenizer.token_bytes(id);
    return text;
  };
  tokens.bos_token = pick("bos_token", tokenizer.bos_id());
  tokens.eos_token = pick("eos_token", tokenizer.eos_id());
  return tokens;
}

// A Hugging Face directory's chat template: tokenizer_config.json's chat_template (a string, or
// a list whose "default" entry is the template), else chat_template.jinja beside it.
Result<ChatTemplate> hf_chat_template(const fs::path& dir, const ChatTemplateTokens& tokens,
                                      const nlohmann::json& config) {
  std::string source;
  if (config.is_object() && config.contains("chat_template")) {
    const auto& t = config.at("chat_template");
    if (t.is_string()) source = t.get<std::string>();
    if (t.is_array()) {
      for (const auto& entry : t) {
        if (entry.is_object() && entry.value("name", "") == "default") source = entry.value("template", "");
      }
    }
  }
  if (source.empty()) {
    if (std::ifstream in(dir / "chat_template.jinja"); in) {
      std::stringstream text;
      text << in.rdbuf();
      source = text.str();
    }
  }
  if (source.empty()) {
    return not_found("the model has no chat template (none in tokenizer_config.json or chat_template.jinja); give "
                     "--chat-template NAME (" + std::string(chat_template_builtin_names()) + ") or FILE.jinja");
  }
  return ChatTemplate::from_jinja(source, "model", tokens);
}

}  // namespace

Result<ChatTemplate> ModelFiles::chat_template_for(const std::string& flag) const {
  if (!flag.empty()) return ChatTemplate::from_flag(flag, chat_tokens);
  return chat_template;
}

std::string ModelFiles::name() const {
  const fs::path p(path);
  return (p.has_filename() ? p : p.parent_path()).stem().string();
}

Result<ModelFiles> open_model_files(const std::string& path) {
  ModelFiles files;
  files.path = path;
  if (is_hf_model_dir(path)) {
    BATON_ASSIGN_OR_RETURN(files.source, hf_model_source(path));
    const std::string tokenizer_json = (fs::path(path) / "tokenizer.json").string();
    if (!fs::exists(tokenizer_json)) {
      return not_found(path + " has no tokenizer.json (baton reads Hugging Face fast tokenizers, not tokenizer.model)");
    }
    BATON_ASSIGN_OR_RETURN(files.tokenizer, Tokenizer::from_hf_json(tokenizer_json));
    const nlohmann::json config = read_json(fs::path(path) / "tokenizer_config.json");
    files.chat_tokens = hf_template_tokens(path, config, *files.tokenizer);
    files.chat_template = hf_chat_template(path, files.chat_tokens, config);
  } else {
    BATON_ASSIGN_OR_RETURN(files.gguf, GgufFile::open(path));
    BATON_ASSIGN_OR_RETURN(files.source, gguf_model_source(*files.gguf));
    BATON_ASSIGN_OR_RETURN(files.tokenizer, Tokenizer::from_gguf(*files.gguf));
    files.chat_tokens = chat_template_tokens_from_gguf(*files.gguf);
    files.chat_template = chat_template_from_gguf(*files.gguf);
  }
  if (files.tokenizer->n_vocab() > files.source->config().n_vocab) {
    return invalid_argument(path + ": the tokenizer has " + std::to_string(files.tokenizer->n_vocab()) +
                            " tokens, the model's embeddings " + std::to_string(files.source->config().n_vocab));
  }
  return files;
}

}  // namespace baton
