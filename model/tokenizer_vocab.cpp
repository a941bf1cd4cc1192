// Reading a vocabulary: Tokenizer::from_gguf (GGUF `tokenizer.ggml.*` metadata) and
// Tokenizer::from_hf_json (a Hugging Face tokenizer.json and the tokenizer_config.json beside it).
// Both fill a TokenizerVocab for Tokenizer::from_vocab. What either format can say that changes
// the ids and baton does not implement is refused here, naming it: a silently different
// tokenizer is the failure to avoid.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/gguf.h"
#include "model/tokenizer.h"

namespace baton {
namespace {

// "left right" -> the pair. Byte-level texts hold no space (it is spelled "Ġ"), so the first space
// after the first character separates them, as in llama.cpp (a raw-text left token may be " ").
Result<std::pair<std::string, std::string>> split_merge(const std::string& merge) {
  const size_t space = merge.find(' ', 1);
  if (space == std::string::npos) return invalid_argument("merge '" + merge + "' is not a pair of tokens");
  return std::pair{merge.substr(0, space), merge.substr(space + 1)};
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> Tokenizer::from_gguf(const GgufFile& file) {
  if (file.find("tokenizer.ggml.model") == nullptr) return not_found("the GGUF file has no tokenizer.ggml.model");
  BATON_ASSIGN_OR_RETURN(const std::string model_name, file.get_string("tokenizer.ggml.model"));
  if (model_name != "gpt2" && model_name != "llama") {
    return unimplemented("tokenizer model '" + model_name +
                         "' is not supported: baton implements byte-level BPE (tokenizer.ggml.model \"gpt2\") and "
                         "SentencePiece BPE (\"llama\")");
  }
  const bool sentencepiece = model_name == "llama";
  TokenizerVocab vocab;
  vocab.family = sentencepiece ? TokenizerFamily::kSentencePiece : TokenizerFamily::kByteLevel;
  BATON_ASSIGN_OR_RETURN(vocab.tokens, file.get_string_array("tokenizer.ggml.tokens"));
  if (file.find("tokenizer.ggml.token_type") != nullptr) {
    const std::vector<int64_t>* types = file.int_array("tokenizer.ggml.token_type");
    if (types == nullptr) return invalid_argument("tokenizer.ggml.token_type is not an integer array");
    for (int64_t t : *types) vocab.types.push_back(t >= 1 && t <= 6 ? static_cast<TokenType>(t) : TokenType::kNormal);
  }
  if (!sentencepiece || file.find("tokenizer.ggml.merges") != nullptr) {
    BATON_ASSIGN_OR_RETURN(const std::vector<std::string> merges, file.get_string_array("tokenizer.ggml.merges"));
    vocab.merges.reserve(merges.size());
    for (const std::string& merge : merges) {
      BATON_ASSIGN_OR_RETURN(auto pair, split_merge(merge));
      vocab.merges.push_back(std::move(pair));
    }
  }
  if (sentencepiece && vocab.merges.empty()) {
    // SentencePiece's BPE ranks merges by the merged token's score.
    const std::vector<double>* scores = file.float_array("tokenizer.ggml.scores");
    if (scores == nullptr) {
      return invalid_argument("a \"llama\" tokenizer needs tokenizer.ggml.scores (or tokenizer.ggml.merges)");
    }
    vocab.scores.assign(scores->begin(), scores->end());
  }
  vocab.pre = "default";
  if (file.find("tokenizer.ggml.pre") != nullptr) {
    BATON_ASSIGN_OR_RETURN(vocab.pre, file.get_string("tokenizer.ggml.pre"));
  }
  const bool llama3 = !sentencepiece && (vocab.pre == "llama3" || vocab.pre == "llama-bpe" || vocab.pre == "llama-v3");
  vocab.ignore_merges = llama3;  // Llama 3's tokenizer.json sets ignore_merges
  for (auto [key, id] : {std::pair{"tokenizer.ggml.bos_token_id", &vocab.bos_id},
                         std::pair{"tokenizer.ggml.eos_token_id", &vocab.eos_id},
                         std::pair{"tokenizer.ggml.unknown_token_id", &vocab.unk_id}}) {
    if (file.find(key) == nullptr) continue;
    BATON_ASSIGN_OR_RETURN(const int64_t value, file.get_int(key));
    // Range-checked by from_vocab; clamping keeps a huge value from wrapping into range.
    *id = static_cast<int32_t>(std::clamp<int64_t>(value, -2, INT32_MAX));
  }
  // llama.cpp's defaults when the keys are absent: Llama 3 and SentencePiece prompts start with BOS.
  vocab.add_bos = llama3 || sentencepiece;
  if (file.find("tokenizer.ggml.add_bos_token") != nullptr) {
    BATON_ASSIGN_OR_RETURN(vocab.add_bos, file.get_bool("tokenizer.ggml.add_bos_token"));
  }
  if (sentencepiece) {
    // As llama.cpp (and SentencePiece's dummy prefix): a space in front of the text and of each
    // stretch after an added token, even one that starts with a space.
    bool add_space_prefix = true;
    if (file.find("tokenizer.ggml.add_space_prefix") != nullptr) {
      BATON_ASSIGN_OR_RETURN(add_space_prefix, file.get_bool("tokenizer.ggml.add_space_prefix"));
    }
    vocab.space_prefix = add_space_prefix ? SpacePrefix::kAlways : SpacePrefix::kNever;
    vocab.prefix_before_space = true;
    vocab.decode_strip = add_space_prefix ? DecodeStrip::kText : DecodeStrip::kNone;
  }
  return from_vocab(std::move(vocab));
}

namespace {
using Json = nlohmann::json;

std::string json_type(const Json& j) {
  return j.is_object() ? j.value("type", "") : "";
}

constexpr std::string_view kSpaceMark = "\xE2\x96\x81";  // "▁"

// The `tokenizer.ggml.pre` name of a tokenizer.json byte-level pre-tokenizer baton implements.
Result<std::string> pre_tokenizer_name(const Json& pre) {
  const auto byte_level = [](const Json& j, bool use_regex) {
    return json_type(j) == "ByteLevel" && !j.value("add_prefix_space", false) &&
           j.value("use_regex", true) == use_regex;
  };
  if (byte_level(pre, true)) return std::string("gpt-2");
  if (json_type(pre) == "Sequence" && pre.at("pretokenizers").size() == 2) {
    const Json &first = pre.at("pretokenizers")[0], &second = pre.at("pretokenizers")[1];
    if (json_type(first) == "Digits" && first.value("individual_digits", false) && byte_level(second, true)) {
      return std::string("smollm");
    }
    if (json_type(first) == "Split" && first.value("behavior", "") == "Isolated" && !first.value("invert", false) &&
        byte_level(second, false) && first.at("pattern").is_object()) {
      const std::string name(pre_tokenizer_of_regex(first.at("pattern").value("Regex", "")));
      if (!name.empty()) return name;
    }
  }
  return unimplemented("tokenizer.json pre-tokenizer is not supported: " + pre.dump().substr(0, 300));
}

// A Replace normalizer or decoder replacing the literal `from` with `to`.
bool is_replace(const Json& j, std::string_view from, std::string_view to) {
  return json_type(j) == "Replace" && j.at("pattern").is_object() && j.at("pattern").value("String", "") == from &&
         j.value("content", "") == to;
}

// SentencePiece-style text handling: HF's legacy Llama normalizer, Sequence[Prepend("▁"),
// Replace(" ", "▁")] without a pre-tokenizer, or the Metaspace pre-tokenizer without a normalizer;
// and the decoder that undoes it.
Status read_sentencepiece_text(const Json& j, TokenizerVocab& vocab) {
  const Json& norm = j.at("normalizer");
  const Json& pre = j.at("pre_tokenizer");
  if (json_type(norm) == "Sequence" && pre.is_null()) {
    const Json& list = norm.at("normalizers");
    const bool legacy = list.size() == 2 && json_type(list[0]) == "Prepend" &&
                        list[0].value("prepend", "") == kSpaceMark && is_replace(list[1], " ", kSpaceMark);
    if (!legacy) return unimplemented("tokenizer.json normalizer is not supported: " + norm.dump().substr(0, 300));
    vocab.space_prefix = SpacePrefix::kAlways;
    vocab.prefix_before_space = true;  // Prepend does not look at what follows
  } else if (norm.is_null() && json_type(pre) == "Metaspace") {
    if (pre.value("replacement", "") != kSpaceMark) {
      return unimplemented("tokenizer.json Metaspace replacement '" + pre.value("replacement", "") +
                           "' is not supported (only \"▁\")");
    }
    const std::string scheme = pre.value("prepend_scheme", pre.value("add_prefix_space", true) ? "always" : "never");
    if (scheme == "always") {
      vocab.space_prefix = SpacePrefix::kAlways;
    } else if (scheme == "first") {
      vocab.space_prefix = SpacePrefix::kFirst;
    } else if (scheme == "never") {
      vocab.space_prefix = SpacePrefix::kNever;
    } else {
      return unimplemented("tokenizer.json Metaspace prepend_scheme '" + scheme + "' is not supported");
    }
    vocab.prefix_before_space = false;  // Metaspace adds none to text that starts with "▁"
    vocab.split_words = pre.value("split", true);
  } else {
    return unimplemented("tokenizer.json normalizer " + norm.dump().substr(0, 200) + " with pre-tokenizer " +
                         pre.dump().substr(0, 200) + " is not supported for a SentencePiece-style BPE");
  }
  // The decoder: "▁" back to spaces (Replace, or Metaspace), byte tokens back to bytes
  // (ByteFallback), joined (Fuse), and one leading space stripped (Strip, or Metaspace).
  const Json& dec = j.at("decoder");
  const std::vector<Json> steps =
      json_type(dec) == "Sequence" ? dec.at("decoders").get<std::vector<Json>>() : std::vector<Json>{dec};
  bool spaces = false, bytes = false;
  vocab.decode_strip = DecodeStrip::kNone;
  for (const Json& step : steps) {
    const std::string type = json_type(step);
    if (is_replace(step, kSpaceMark, " ")) {
      spaces = true;
    } else if (type == "ByteFallback") {
      bytes = true;
    } else if (type == "Fuse") {
    } else if (type == "Strip" && step.value("content", "") == " " && step.value("start", 0) <= 1 &&
               step.value("stop", 0) == 0) {
      if (step.value("start", 0) == 1) vocab.decode_strip = DecodeStrip::kText;
    } else if (type == "Metaspace" && step.value("replacement", "") == kSpaceMark) {
      spaces = true;
      if (step.value("prepend_scheme", "always") != "never") vocab.decode_strip = DecodeStrip::kFirstToken;
    } else {
      return unimplemented("tokenizer.json decoder step is not supported: " + step.dump().substr(0, 200));
    }
  }
  if (!spaces || (vocab.byte_fallback && !bytes)) {
    return unimplemented("tokenizer.json decoder does not undo the SentencePiece spelling: " +
                         dec.dump().substr(0, 300));
  }
  return Status::ok_status();
}

// The token text of a tokenizer_config.json entry ("<s>" or {"content": "<s>", ...}).
std::string config_token(const Json& config, const char* key) {
  const Json v = config.value(key, Json());
  return v.is_string() ? v.get<std::string>() : v.is_object() ? v.value("content", "") : "";
}

// The first special token HF's post-processor puts before a single sequence (Llama 3's
// <|begin_of_text|>, Llama 2's <s>), or "" when it adds none.
std::string post_processor_prefix(const Json& post) {
  if (json_type(post) == "Sequence") {
    for (const Json& p : post.at("processors")) {
      if (std::string prefix = post_processor_prefix(p); !prefix.empty()) return prefix;
    }
  }
  if (json_type(post) == "TemplateProcessing" && !post.at("single").empty() &&
      post.at("single")[0].contains("SpecialToken")) {
    return post.at("single")[0].at("SpecialToken").at("id").get<std::string>();
  }
  return "";
}

Result<TokenizerVocab> vocab_from_hf_json(const Json& j, const Json& config) {
  const Json& model = j.at("model");
  if (json_type(model) != "BPE") return unimplemented("tokenizer.json model " + json_type(model) + " is not a BPE");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && !model.at(key).is_null() && model.at(key) != "") {
      return unimplemented(std::string("tokenizer.json model.") + key + " is not supported");
    }
  }
  if (model.contains("dropout") && !model.at("dropout").is_null() && model.at("dropout").get<double>() != 0) {
    return unimplemented("tokenizer.json model.dropout (BPE-dropout) is not supported: it samples the merges");
  }
  TokenizerVocab vocab;
  vocab.byte_fallback = model.value("byte_fallback", false);
  vocab.ignore_merges = model.value("ignore_merges", false);
  vocab.fuse_unk = model.value("fuse_unk", false);
  const Json& norm = j.at("normalizer");
  const bool byte_level = norm.is_null() && !vocab.byte_fallback && json_type(j.at("pre_tokenizer")) != "Metaspace";
  if (byte_level) {
    BATON_ASSIGN_OR_RETURN(vocab.pre, pre_tokenizer_name(j.at("pre_tokenizer")));
  } else {
    vocab.family = TokenizerFamily::kSentencePiece;
    BATON_RETURN_IF_ERROR(read_sentencepiece_text(j, vocab));
  }

  constexpr int64_t kMaxVocab = 1 << 24;
  const auto place = [&](int64_t id, std::string text, TokenType type) -> Status {
    if (id < 0 || id >= kMaxVocab) return invalid_argument("token id " + std::to_string(id) + " is out of range");
    if (static_cast<size_t>(id) >= vocab.tokens.size()) {
      vocab.tokens.resize(id + 1);
      vocab.types.resize(id + 1, TokenType::kUnused);  // ids no entry names stay unused
    }
    vocab.tokens[id] = std::move(text);
    vocab.types[id] = type;
    return Status::ok_status();
  };
  for (const auto& [text, id] : model.at("vocab").items()) {
    BATON_RETURN_IF_ERROR(place(id.get<int64_t>(), text, TokenType::kNormal));
  }
  for (const Json& added : j.value("added_tokens", Json::array())) {
    const std::string content = added.at("content").get<std::string>();
    for (const char* flag : {"lstrip", "rstrip", "single_word"}) {
      if (added.value(flag, false)) {
        return unimplemented("added token '" + content + "' sets " + flag + ", which baton does not implement");
      }
    }
    // HF matches such a token in the normalized text, after the SentencePiece spelling and the
    // prefix ("<x> y" -> "▁", "<x>", "▁y"); baton matches added tokens in the text.
    if (!byte_level && added.value("normalized", false)) {
      return unimplemented("added token '" + content +
                           "' is matched after normalization (\"normalized\": true), "
                           "which baton does not implement for a SentencePiece-style vocabulary");
    }
    const TokenType type = added.value("special", false) ? TokenType::kControl : TokenType::kUserDefined;
    BATON_RETURN_IF_ERROR(place(added.at("id").get<int64_t>(), content, type));
  }
  for (const Json& merge : model.at("merges")) {
    if (merge.is_array() && merge.size() == 2) {  // newer files: ["a", "b"]
      vocab.merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
      continue;
    }
    BATON_ASSIGN_OR_RETURN(auto pair, split_merge(merge.get<std::string>()));
    vocab.merges.push_back(std::move(pair));
  }
  const auto id_of = [&](const std::string& text) {  // the last id, as in HF's vocabulary map
    const auto it = std::find(vocab.tokens.rbegin(), vocab.tokens.rend(), text);
    return text.empty() || it == vocab.tokens.rend() ? -1 : static_cast<int32_t>(vocab.tokens.rend() - it - 1);
  };
  if (model.contains("unk_token") && model.at("unk_token").is_string()) {
    const std::string unk = model.at("unk_token").get<std::string>();
    vocab.unk_id = id_of(unk);
    if (vocab.unk_id < 0) return invalid_argument("tokenizer.json model.unk_token '" + unk + "' is not a token");
  }
  const std::string prefix = post_processor_prefix(j.value("post_processor", Json()));
  vocab.add_bos = !prefix.empty();
  vocab.bos_id = id_of(config_token(config, "bos_token"));
  if (vocab.bos_id < 0) vocab.bos_id = id_of(prefix);
  vocab.eos_id = id_of(config_token(config, "eos_token"));
  if (config.contains("add_bos_token") && config.at("add_bos_token").is_boolean()) {
    vocab.add_bos = config.at("add_bos_token").get<bool>();
  }
  return vocab;
}
}  // namespace

Result<std::unique_ptr<Tokenizer>> Tokenizer::from_hf_json(const std::string& path) {
  const auto read_json = [](const std::string& file, Json& out) -> Status {
    std::ifstream in(file);
    if (!in) return not_found("cannot open " + file);
    out = Json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (out.is_discarded()) return invalid_argument(file + " is not valid JSON");
    return Status::ok_status();
  };
  Json j, config = Json::object();
  BATON_RETURN_IF_ERROR(read_json(path, j));
  const std::string config_path = std::filesystem::path(path).replace_filename("tokenizer_config.json");
  if (std::ifstream(config_path)) BATON_RETURN_IF_ERROR(read_json(config_path, config));
  Result<TokenizerVocab> vocab = [&]() -> Result<TokenizerVocab> {
    try {
      return vocab_from_hf_json(j, config);
    } catch (const Json::exception& e) {  // a missing key or a value of the wrong type
      return invalid_argument("not a tokenizer.json baton understands: " + std::string(e.what()));
    }
  }();
  if (!vocab.ok()) return Status(vocab.status().code(), path + ": " + vocab.status().message());
  return from_vocab(std::move(vocab).value());
}

}  // namespace baton
