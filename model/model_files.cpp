#include "model/model_files.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "model/hf_model.h"

namespace baton {
namespace {

namespace fs = std::filesystem;
constexpr const char* kSuggestion = "; choose one with --chat-template chatml|llama3";

// A Hugging Face directory's chat template: tokenizer_config.json's chat_template (a string, or
// a list whose "default" entry is the template), else chat_template.jinja beside it.
Result<ChatTemplate> hf_chat_template(const fs::path& dir, const Tokenizer& tokenizer) {
  std::string source;
  nlohmann::json config;
  if (std::ifstream in(dir / "tokenizer_config.json"); in) {
    config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  }
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
    return not_found("the model has no chat template (none in tokenizer_config.json or chat_template.jinja)" +
                     std::string(kSuggestion));
  }
  const std::string bos = tokenizer.bos_id() >= 0 ? tokenizer.token_bytes(tokenizer.bos_id()) : "";
  return chat_template_from_jinja(source, bos);
}

}  // namespace

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
    files.chat_template = hf_chat_template(path, *files.tokenizer);
  } else {
    BATON_ASSIGN_OR_RETURN(files.gguf, GgufFile::open(path));
    BATON_ASSIGN_OR_RETURN(files.source, gguf_model_source(*files.gguf));
    BATON_ASSIGN_OR_RETURN(files.tokenizer, Tokenizer::from_gguf(*files.gguf));
    files.chat_template = chat_template_from_gguf(*files.gguf);
  }
  if (files.tokenizer->n_vocab() > files.source->config().n_vocab) {
    return invalid_argument(path + ": the tokenizer has " + std::to_string(files.tokenizer->n_vocab()) +
                            " tokens, the model's embeddings " + std::to_string(files.source->config().n_vocab));
  }
  return files;
}

}  // namespace baton
