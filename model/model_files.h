// What --model names, opened: a GGUF file, or a Hugging Face model directory (config.json,
// model.safetensors or its shards, tokenizer.json, tokenizer_config.json). The model's config
// and weights (a ModelSource), its tokenizer and its chat template all come from it.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "model/chat_template.h"
#include "model/gguf.h"
#include "model/model_source.h"
#include "model/tokenizer.h"

namespace baton {

struct ModelFiles {
  std::string path;
  std::unique_ptr<GgufFile> gguf;       // a GGUF file's (null for a directory); `source` reads it
  std::unique_ptr<ModelSource> source;  // config, tensors, fingerprint
  std::unique_ptr<Tokenizer> tokenizer;
  // The model's chat template, or why there is none to use: NOT_FOUND (the model has none), or
  // the parse or probe error of one baton cannot render; both say to give --chat-template.
  Result<ChatTemplate> chat_template = not_found("no chat template");
  // The special tokens' text the model's templates print (bos_token, eos_token).
  ChatTemplateTokens chat_tokens;
  // The template --chat-template `flag` names (a built-in or a Jinja file, with this model's
  // special tokens), or the model's own when `flag` is empty.
  Result<ChatTemplate> chat_template_for(const std::string& flag) const;
  // A short name for the model: the GGUF file's or the directory's name without extension.
  std::string name() const;
};

// Opens `path`: a directory with a config.json is a Hugging Face model, anything else a GGUF file.
// Errors name the file and what is wrong with it.
Result<ModelFiles> open_model_files(const std::string& path);

}  // namespace baton
