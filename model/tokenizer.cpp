#include "model/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/gguf.h"
#include "model/utf8.h"

namespace baton {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// GPT-2's bytes_to_unicode, inverted: code point -> byte, or -1. Printable bytes spell themselves;
// the others (controls, space, 0x7F-0xA0, 0xAD) are shifted to U+0100.. so no token holds
// whitespace or control characters.
const std::array<int16_t, 324>& byte_of_code_point() {
  static const std::array<int16_t, 324> table = [] {
    std::array<int16_t, 324> t;
    t.fill(-1);
    int shifted = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      t[printable ? b : 256 + shifted++] = static_cast<int16_t>(b);
    }
    return t;
  }();
  return table;
}

// The bytes a token text stands for: undo the byte-level spelling, or, for a text using any other
// character (an added token stored as plain text), its own bytes.
std::string unspell(std::string_view token) {
  const auto& table = byte_of_code_point();
  std::string out;
  for (size_t pos = 0; pos < token.size();) {
    const Utf8Step step = utf8_step(token, pos);
    if (step.kind != Utf8Step::kValid || step.len > 2) return std::string(token);
    const auto b0 = static_cast<uint8_t>(token[pos]);
    const uint32_t cp = step.len == 1 ? b0 : ((b0 & 0x1Fu) << 6) | (static_cast<uint8_t>(token[pos + 1]) & 0x3Fu);
    if (cp >= table.size() || table[cp] < 0) return std::string(token);
    out.push_back(static_cast<char>(table[cp]));
    pos += step.len;
  }
  return out;
}

// GPT-2's pattern, as HF's ByteLevel pre-tokenizer (use_regex) has it.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// Qwen2 is Llama 3's pattern with single digits.
constexpr const char* kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// HF's Digits(individual_digits=True) isolates chars for which Rust's char::is_numeric holds, i.e.
// general category Nd, Nl or No: "²", "Ⅻ" and "٣" too, not only ASCII digits.
constexpr const char* kDigitPattern = R"(\p{N})";

// The patterns above are HF's text (from_hf_json compares them); PCRE2 sees them with \s and \S
// spelled out as Unicode White_Space, which Oniguruma (HF's engine) uses. PCRE2's own \s also takes
// U+180E MONGOLIAN VOWEL SEPARATOR (its \h list predates Unicode 6.3), and that split differently.
constexpr std::string_view kWhiteSpace =
    R"(\t\n\x0B\f\r\x20\x85\xA0\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

std::string spell_out_whitespace(std::string_view pattern) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      const std::string ws(kWhiteSpace);
      out += e == 's' ? (in_class ? ws : "[" + ws + "]") : e == 'S' && !in_class ? "[^" + ws + "]" : std::string{c, e};
      continue;
    }
    if (c == '[') in_class = true;
    if (c == ']') in_class = false;
    out += c;
  }
  return out;
}

// "left right" -> the pair. Byte-level texts hold no space (it is spelled "Ġ"), so the first space
// after the first character separates them, as in llama.cpp (a raw-text left token may be " ").
Result<std::pair<std::string, std::string>> split_merge(const std::string& merge) {
  const size_t space = merge.find(' ', 1);
  if (space == std::string::npos) return invalid_argument("merge '" + merge + "' is not a pair of tokens");
  return std::pair{merge.substr(0, space), merge.substr(space + 1)};
}

struct PreTokenizerSpec {
  const char* name;
  const char* pattern;
  bool isolate_digits;
};
constexpr PreTokenizerSpec kPreTokenizers[] = {
    {"default", kGpt2Pattern, false},  {"gpt-2", kGpt2Pattern, false},       {"smollm", kGpt2Pattern, true},
    {"llama3", kLlama3Pattern, false}, {"llama-bpe", kLlama3Pattern, false}, {"llama-v3", kLlama3Pattern, false},
    {"qwen2", kQwen2Pattern, false},
};

}  // namespace

// Compiled PCRE2 patterns of one pre-tokenizer. Compiled code is read-only while matching, so one
// instance serves concurrent encode() calls; match data is per call.
class PreTokenizerRegex {
 public:
  static Result<std::unique_ptr<PreTokenizerRegex>> create(const PreTokenizerSpec& spec) {
    auto regex = std::unique_ptr<PreTokenizerRegex>(new PreTokenizerRegex());
    BATON_ASSIGN_OR_RETURN(regex->main_, compile(spec.pattern));
    if (spec.isolate_digits) {
      BATON_ASSIGN_OR_RETURN(regex->digits_, compile(kDigitPattern));
    }
    return regex;
  }
  ~PreTokenizerRegex() {
    pcre2_code_free(main_);
    pcre2_code_free(digits_);
  }

  // Calls `emit` with each piece of `text` (valid UTF-8), in order; the pieces tile the text.
  template <typename F>
  Status split(std::string_view text, F&& emit) const {
    if (digits_ == nullptr) return split_by(main_, text, emit);
    return split_by(digits_, text, [&](std::string_view piece) { return split_by(main_, piece, emit); });
  }

 private:
  PreTokenizerRegex() = default;

  static Result<pcre2_code*> compile(const char* pattern) {
    int error = 0;
    PCRE2_SIZE error_offset = 0;
    const std::string spelled = spell_out_whitespace(pattern);
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(spelled.data()), spelled.size(),
                                     PCRE2_UTF | PCRE2_UCP, &error, &error_offset, nullptr);
    if (code == nullptr) return Status(StatusCode::kInternal, "pre-tokenizer regex: " + error_text(error));
    // JIT is an optimisation: without it (no JIT support in this PCRE2 build) matching still works.
    (void)pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
    return code;
  }

  static std::string error_text(int error) {
    PCRE2_UCHAR buffer[256];
    return pcre2_get_error_message(error, buffer, sizeof(buffer)) < 0 ? "?" : reinterpret_cast<const char*>(buffer);
  }

  // HF's Split with behavior "isolated": every match is a piece, and so is every gap between them.
  // The subject is `text` alone, so lookaheads such as (?!\S) see its end, not what follows it.
  template <typename F>
  static Status split_by(const pcre2_code* code, std::string_view text, F&& emit) {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match(
        pcre2_match_data_create_from_pattern(code, nullptr), &pcre2_match_data_free);
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    for (size_t pos = 0; pos < text.size();) {
      const int rc = pcre2_match(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, match.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) return emit(text.substr(pos));
      if (rc < 0) return Status(StatusCode::kInternal, "pre-tokenizer regex match: " + error_text(rc));
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match.get());
      const size_t begin = ovector[0], end = ovector[1];
      BATON_CHECK(end > begin, "pre-tokenizer patterns never match the empty string");
      if (begin > pos) BATON_RETURN_IF_ERROR(emit(text.substr(pos, begin - pos)));
      BATON_RETURN_IF_ERROR(emit(text.substr(begin, end - begin)));
      pos = end;
    }
    return Status::ok_status();
  }

  pcre2_code* main_ = nullptr;
  pcre2_code* digits_ = nullptr;  // set when digits are isolated first (smollm)
};

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

Result<std::unique_ptr<Tokenizer>> Tokenizer::from_vocab(TokenizerVocab vocab) {
  const size_t n = vocab.tokens.size();
  if (n == 0 || n > static_cast<size_t>(INT32_MAX)) return invalid_argument("vocabulary size " + std::to_string(n));
  if (!vocab.types.empty() && vocab.types.size() != n) {
    return invalid_argument("tokenizer has " + std::to_string(vocab.types.size()) + " token types for " +
                            std::to_string(n) + " tokens");
  }
  const auto* spec = std::ranges::find_if(kPreTokenizers, [&](const auto& p) { return vocab.pre == p.name; });
  if (spec == std::end(kPreTokenizers)) {
    return unimplemented("pre-tokenizer '" + vocab.pre +
                         "' is not supported (known: default, gpt-2, smollm, llama3, llama-bpe, llama-v3, qwen2)");
  }
  for (int32_t id : {vocab.bos_id, vocab.eos_id}) {
    if (id < -1 || id >= static_cast<int64_t>(n)) {
      return invalid_argument("bos/eos token id " + std::to_string(id) + " is outside the vocabulary of " +
                              std::to_string(n) + " tokens");
    }
  }
  auto tok = std::unique_ptr<Tokenizer>(new Tokenizer());
  BATON_ASSIGN_OR_RETURN(tok->pre_, PreTokenizerRegex::create(*spec));
  tok->types_ = vocab.types.empty() ? std::vector<TokenType>(n, TokenType::kNormal) : std::move(vocab.types);
  tok->bytes_.reserve(n);
  tok->ids_.reserve(n);
  for (size_t id = 0; id < n; ++id) {
    tok->bytes_.push_back(unspell(vocab.tokens[id]));
    tok->ids_[tok->bytes_.back()] = static_cast<int32_t>(id);
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = tok->ids_.find(std::string(1, static_cast<char>(b)));
    tok->byte_ids_[b] = it == tok->ids_.end() ? -1 : it->second;
  }
  tok->merges_.reserve(vocab.merges.size());
  for (size_t rank = 0; rank < vocab.merges.size(); ++rank) {
    const auto& [left_text, right_text] = vocab.merges[rank];
    std::string left = unspell(left_text), right = unspell(right_text);
    const auto l = tok->ids_.find(left), r = tok->ids_.find(right), m = tok->ids_.find(left + right);
    if (l == tok->ids_.end() || r == tok->ids_.end() || m == tok->ids_.end()) {
      return invalid_argument("merge #" + std::to_string(rank) + " '" + left_text + " " + right_text +
                              "' names a token that is not in the vocabulary");
    }
    // A repeated pair keeps its last rank, as HF's merge map (built by successive inserts) does.
    tok->merges_[static_cast<uint64_t>(l->second) << 32 | static_cast<uint32_t>(r->second)] =
        Merge{static_cast<int32_t>(rank), m->second};
  }
  for (size_t id = 0; id < n; ++id) {
    const std::string& text = tok->bytes_[id];
    const bool special = tok->types_[id] == TokenType::kControl || tok->types_[id] == TokenType::kUserDefined;
    // A match must start and end on character boundaries, so only valid UTF-8 texts take part.
    if (special && !text.empty() && utf8_invalid_offset(text) == std::string_view::npos) {
      tok->specials_by_byte_[static_cast<uint8_t>(text[0])].push_back(static_cast<int32_t>(id));
    }
  }
  for (auto& bucket : tok->specials_by_byte_) {
    std::stable_sort(bucket.begin(), bucket.end(),
                     [&](int32_t a, int32_t b) { return tok->bytes_[a].size() > tok->bytes_[b].size(); });
  }
  if (vocab.eos_id >= 0) tok->stop_ids_.push_back(vocab.eos_id);
  for (const char* end_of_turn : {"<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>"}) {
    const auto id = tok->find_token(end_of_turn);
    if (id && std::find(tok->stop_ids_.begin(), tok->stop_ids_.end(), *id) == tok->stop_ids_.end()) {
      tok->stop_ids_.push_back(*id);
    }
  }
  std::tie(tok->bos_id_, tok->eos_id_, tok->add_bos_) = std::tuple(vocab.bos_id, vocab.eos_id, vocab.add_bos);
  tok->ignore_merges_ = vocab.ignore_merges;
  return tok;
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::from_gguf(const GgufFile& file) {
  if (file.find("tokenizer.ggml.model") == nullptr) return not_found("the GGUF file has no tokenizer.ggml.model");
  BATON_ASSIGN_OR_RETURN(const std::string model_name, file.get_string("tokenizer.ggml.model"));
  if (model_name != "gpt2") {
    return unimplemented("tokenizer model '" + model_name +
                         "' is not supported: baton implements byte-level BPE (tokenizer.ggml.model \"gpt2\")");
  }
  TokenizerVocab vocab;
  BATON_ASSIGN_OR_RETURN(vocab.tokens, file.get_string_array("tokenizer.ggml.tokens"));
  if (file.find("tokenizer.ggml.token_type") != nullptr) {
    const std::vector<int64_t>* types = file.int_array("tokenizer.ggml.token_type");
    if (types == nullptr) return invalid_argument("tokenizer.ggml.token_type is not an integer array");
    for (int64_t t : *types) vocab.types.push_back(t >= 1 && t <= 6 ? static_cast<TokenType>(t) : TokenType::kNormal);
  }
  BATON_ASSIGN_OR_RETURN(const std::vector<std::string> merges, file.get_string_array("tokenizer.ggml.merges"));
  vocab.merges.reserve(merges.size());
  for (const std::string& merge : merges) {
    BATON_ASSIGN_OR_RETURN(auto pair, split_merge(merge));
    vocab.merges.push_back(std::move(pair));
  }
  vocab.pre = "default";
  if (file.find("tokenizer.ggml.pre") != nullptr) {
    BATON_ASSIGN_OR_RETURN(vocab.pre, file.get_string("tokenizer.ggml.pre"));
  }
  const bool llama3 = vocab.pre == "llama3" || vocab.pre == "llama-bpe" || vocab.pre == "llama-v3";
  vocab.ignore_merges = llama3;  // Llama 3's tokenizer.json sets ignore_merges
  for (auto [key, id] : {std::pair{"tokenizer.ggml.bos_token_id", &vocab.bos_id},
                         std::pair{"tokenizer.ggml.eos_token_id", &vocab.eos_id}}) {
    if (file.find(key) == nullptr) continue;
    BATON_ASSIGN_OR_RETURN(const int64_t value, file.get_int(key));
    // Range-checked by from_vocab; clamping keeps a huge value from wrapping into range.
    *id = static_cast<int32_t>(std::clamp<int64_t>(value, -2, INT32_MAX));
  }
  // llama.cpp's default when the key is absent: Llama 3 prompts start with <|begin_of_text|>.
  vocab.add_bos = llama3;
  if (file.find("tokenizer.ggml.add_bos_token") != nullptr) {
    BATON_ASSIGN_OR_RETURN(vocab.add_bos, file.get_bool("tokenizer.ggml.add_bos_token"));
  }
  return from_vocab(std::move(vocab));
}

namespace {
using Json = nlohmann::json;

std::string json_type(const Json& j) {
  return j.is_object() ? j.value("type", "") : "";
}

// The `tokenizer.ggml.pre` name of a tokenizer.json pre-tokenizer baton implements.
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
      const std::string regex = first.at("pattern").value("Regex", "");
      if (regex == kLlama3Pattern) return std::string("llama3");
      if (regex == kQwen2Pattern) return std::string("qwen2");
    }
  }
  return unimplemented("tokenizer.json pre-tokenizer is not supported: " + pre.dump().substr(0, 300));
}

// The token text of a tokenizer_config.json entry ("<s>" or {"content": "<s>", ...}).
std::string config_token(const Json& config, const char* key) {
  const Json v = config.value(key, Json());
  return v.is_string() ? v.get<std::string>() : v.is_object() ? v.value("content", "") : "";
}

// The first special token HF's post-processor puts before a single sequence (Llama 3's
// <|begin_of_text|>), or "" when it adds none.
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
  if (json_type(model) != "BPE" || model.value("byte_fallback", false)) {
    return unimplemented("tokenizer.json model is not a byte-level BPE (model.type " + json_type(model) + ")");
  }
  if (!j.at("normalizer").is_null()) {
    return unimplemented("tokenizer.json normalizer " + json_type(j.at("normalizer")) + " is not supported");
  }
  TokenizerVocab vocab;
  BATON_ASSIGN_OR_RETURN(vocab.pre, pre_tokenizer_name(j.at("pre_tokenizer")));
  vocab.ignore_merges = model.value("ignore_merges", false);

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
    const TokenType type = added.value("special", false) ? TokenType::kControl : TokenType::kUserDefined;
    BATON_RETURN_IF_ERROR(place(added.at("id").get<int64_t>(), added.at("content").get<std::string>(), type));
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

// Per-encode() work arrays for the merge loop, reused across pieces.
struct Tokenizer::BpeScratch {
  struct Symbol {
    int32_t id, prev, next;  // prev/next: neighbouring live symbols, -1 at the ends
    bool alive;
  };
  struct Candidate {
    int32_t rank, pos, id;  // pos: the left symbol; id: the merged token (a stale one no longer matches)
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<Symbol> symbols;
  std::vector<Candidate> heap;  // a min-heap on (rank, pos): HF's order
};

const Tokenizer::Merge* Tokenizer::find_merge(int32_t left, int32_t right) const {
  const auto it = merges_.find(static_cast<uint64_t>(left) << 32 | static_cast<uint32_t>(right));
  return it == merges_.end() ? nullptr : &it->second;
}

// BPE as HF's Word::merge_all: repeatedly apply the lowest-ranked merge among adjacent symbols
// (leftmost on ties). A heap of candidate pairs, checked for staleness when popped, keeps a piece
// of n bytes at O(n log n).
void Tokenizer::encode_piece(std::string_view piece, BpeScratch& scratch, std::vector<int32_t>& ids) const {
  if (const auto whole = ignore_merges_ ? find_token(piece) : std::nullopt) {
    ids.push_back(*whole);
    return;
  }
  auto& symbols = scratch.symbols;
  auto& heap = scratch.heap;
  const auto greater = std::greater<BpeScratch::Candidate>();
  symbols.clear();
  heap.clear();
  for (char c : piece) {
    // A byte the vocabulary lacks is dropped and its neighbours become adjacent, as in HF's BPE
    // without an unk token (SmolLM2 has no token for 0x04, for instance).
    if (const int32_t id = byte_ids_[static_cast<uint8_t>(c)]; id >= 0) {
      const auto i = static_cast<int32_t>(symbols.size());
      symbols.push_back({id, i - 1, i + 1, true});
    }
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;
  const auto n = static_cast<int32_t>(symbols.size());
  const auto push_candidate = [&](int32_t pos) {
    const int32_t next = symbols[pos].next;
    if (next < 0) return;
    if (const Merge* m = find_merge(symbols[pos].id, symbols[next].id)) {
      heap.push_back({m->rank, pos, m->id});
      std::push_heap(heap.begin(), heap.end(), greater);
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_candidate(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), greater);
    const BpeScratch::Candidate top = heap.back();
    heap.pop_back();
    auto& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    const Merge* m = find_merge(left.id, symbols[left.next].id);
    if (m == nullptr || m->id != top.id) continue;
    auto& right = symbols[left.next];
    right.alive = false;
    left.id = top.id;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) push_candidate(left.prev);
    push_candidate(top.pos);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) ids.push_back(symbols[i].id);
}

Status Tokenizer::encode_text(std::string_view text, BpeScratch& scratch, std::vector<int32_t>& ids) const {
  return pre_->split(text, [&](std::string_view piece) {
    encode_piece(piece, scratch, ids);
    return Status::ok_status();
  });
}

Result<std::vector<int32_t>> Tokenizer::encode(std::string_view text, bool parse_special) const {
  if (const size_t bad = utf8_invalid_offset(text); bad != std::string_view::npos) {
    char byte[8];
    std::snprintf(byte, sizeof(byte), "0x%02X", static_cast<uint8_t>(text[bad]));
    return invalid_argument("text is not valid UTF-8: byte " + std::string(byte) + " at offset " + std::to_string(bad));
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  BpeScratch scratch;
  size_t start = 0;  // the text not yet encoded begins here
  for (size_t pos = 0; parse_special && pos < text.size();) {
    // The bucket is longest first, and HF matches added tokens leftmost-longest.
    const auto& bucket = specials_by_byte_[static_cast<uint8_t>(text[pos])];
    const auto hit_it = std::find_if(bucket.begin(), bucket.end(),
                                     [&](int32_t id) { return text.substr(pos).starts_with(bytes_[id]); });
    if (hit_it == bucket.end()) {
      ++pos;
      continue;
    }
    const int32_t hit = *hit_it;
    BATON_RETURN_IF_ERROR(encode_text(text.substr(start, pos - start), scratch, ids));
    ids.push_back(hit);
    pos += bytes_[hit].size();
    start = pos;
  }
  BATON_RETURN_IF_ERROR(encode_text(text.substr(start), scratch, ids));
  return ids;
}

const std::string& Tokenizer::token_bytes(int32_t id) const {
  static const std::string kEmpty;
  return id >= 0 && id < n_vocab() ? bytes_[id] : kEmpty;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) out += token_bytes(id);
  return out;
}

bool Tokenizer::is_control(int32_t id) const {
  return id >= 0 && id < n_vocab() && types_[id] == TokenType::kControl;
}

std::optional<int32_t> Tokenizer::find_token(std::string_view text) const {
  const auto it = ids_.find(text);
  return it == ids_.end() ? std::nullopt : std::optional<int32_t>(it->second);
}

std::string StreamDecoder::push(int32_t id) {
  pending_ += tokenizer_.token_bytes(id);
  std::string out;
  size_t pos = 0;
  while (pos < pending_.size()) {
    const Utf8Step step = utf8_step(pending_, pos);
    if (step.kind == Utf8Step::kIncomplete) break;  // wait for the next token
    out += step.kind == Utf8Step::kValid ? std::string_view(pending_).substr(pos, step.len) : kReplacement;
    pos += step.len;
  }
  pending_.erase(0, pos);
  return out;
}

std::string StreamDecoder::flush() {
  const bool incomplete = !pending_.empty();  // pending_ only ever holds one cut-off character
  pending_.clear();
  return incomplete ? std::string(kReplacement) : std::string();
}

}  // namespace baton
