#include "model/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cstdio>

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

// SentencePiece's spelling of a space, U+2581 LOWER ONE EIGHTH BLOCK.
constexpr std::string_view kSpaceMark = "\xE2\x96\x81";

// The byte a SentencePiece byte token stands for ("<0x0A>" -> 0x0A, as HF's ByteFallback reads it:
// either case of hex digit), or -1.
int byte_token_value(std::string_view text) {
  if (text.size() != 6 || !text.starts_with("<0x") || text.back() != '>') return -1;
  const auto hex = [](char c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
  };
  const int hi = hex(text[3]), lo = hex(text[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// `text` with every occurrence of `from` replaced by `to`.
std::string replace_all(std::string_view text, std::string_view from, std::string_view to) {
  std::string out;
  for (size_t pos = 0;;) {
    const size_t hit = text.find(from, pos);
    out.append(text.substr(pos, hit == std::string_view::npos ? std::string_view::npos : hit - pos));
    if (hit == std::string_view::npos) return out;
    out.append(to);
    pos = hit + from.size();
  }
}

// The bytes a SentencePiece token text stands for: its byte for <0xXX>, else its text with "▁" as a space.
std::string unspell_sentencepiece(std::string_view token) {
  const int byte = byte_token_value(token);
  return byte >= 0 ? std::string(1, static_cast<char>(byte)) : replace_all(token, kSpaceMark, " ");
}

// `bytes` as UTF-8 text, each invalid sequence (its maximal subpart) and a cut-off last character
// as one U+FFFD: Rust's String::from_utf8_lossy, which HF's ByteLevel decoder uses.
std::string lossy_utf8(std::string_view bytes) {
  std::string out;
  for (size_t pos = 0; pos < bytes.size();) {
    const Utf8Step step = utf8_step(bytes, pos);
    out += step.kind == Utf8Step::kValid ? bytes.substr(pos, step.len) : kReplacement;
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
  const bool sentencepiece = vocab.family == TokenizerFamily::kSentencePiece;
  const auto* spec = std::ranges::find_if(kPreTokenizers, [&](const auto& p) { return vocab.pre == p.name; });
  if (!sentencepiece && spec == std::end(kPreTokenizers)) {
    return unimplemented("pre-tokenizer '" + vocab.pre +
                         "' is not supported (known: default, gpt-2, smollm, llama3, llama-bpe, llama-v3, qwen2)");
  }
  for (int32_t id : {vocab.bos_id, vocab.eos_id, vocab.unk_id}) {
    if (id < -1 || id >= static_cast<int64_t>(n)) {
      return invalid_argument("bos/eos/unk token id " + std::to_string(id) + " is outside the vocabulary of " +
                              std::to_string(n) + " tokens");
    }
  }
  if (!vocab.scores.empty() && vocab.scores.size() != n) {
    return invalid_argument("tokenizer has " + std::to_string(vocab.scores.size()) + " scores for " +
                            std::to_string(n) + " tokens");
  }
  auto tok = std::unique_ptr<Tokenizer>(new Tokenizer());
  tok->family_ = vocab.family;
  if (!sentencepiece) {
    BATON_ASSIGN_OR_RETURN(tok->pre_, PreTokenizerRegex::create(*spec));
  }
  tok->types_ = vocab.types.empty() ? std::vector<TokenType>(n, TokenType::kNormal) : std::move(vocab.types);
  tok->bytes_.reserve(n);
  tok->ids_.reserve(n);
  tok->byte_of_token_.assign(n, -1);
  tok->fallback_ids_.fill(-1);
  for (size_t id = 0; id < n; ++id) {
    const auto i = static_cast<int32_t>(id);
    if (sentencepiece) {
      tok->bytes_.push_back(unspell_sentencepiece(vocab.tokens[id]));
      tok->spelled_ids_[vocab.tokens[id]] = i;
      if (const int byte = byte_token_value(vocab.tokens[id]); byte >= 0) {
        tok->byte_of_token_[id] = static_cast<int16_t>(byte);
        if (tok->fallback_ids_[byte] < 0) tok->fallback_ids_[byte] = i;  // the first, as HF's vocabulary lookup
        if (tok->types_[id] == TokenType::kNormal) tok->types_[id] = TokenType::kByte;
      }
    } else {
      tok->bytes_.push_back(unspell(vocab.tokens[id]));
    }
    // Byte tokens stand for a byte other tokens may spell too ("a", <0x61>): the text's own token
    // is the one a byte string names.
    if (tok->byte_of_token_[id] < 0 || !tok->ids_.contains(tok->bytes_.back())) tok->ids_[tok->bytes_.back()] = i;
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = tok->ids_.find(std::string(1, static_cast<char>(b)));
    tok->byte_ids_[b] = it == tok->ids_.end() ? -1 : it->second;
  }
  // Merge rules name tokens by their spelling: byte-level texts map to their bytes, SentencePiece
  // texts are looked up as spelled.
  const auto id_of = [&](const std::string& text) -> std::optional<int32_t> {
    if (sentencepiece) {
      const auto it = tok->spelled_ids_.find(text);
      return it == tok->spelled_ids_.end() ? std::nullopt : std::optional(it->second);
    }
    return tok->find_token(unspell(text));
  };
  tok->merges_.reserve(vocab.merges.size());
  for (size_t rank = 0; rank < vocab.merges.size(); ++rank) {
    const auto& [left_text, right_text] = vocab.merges[rank];
    const auto l = id_of(left_text), r = id_of(right_text);
    const auto m =
        sentencepiece ? id_of(left_text + right_text) : tok->find_token(unspell(left_text) + unspell(right_text));
    if (!l || !r || !m) {
      return invalid_argument("merge #" + std::to_string(rank) + " '" + left_text + " " + right_text +
                              "' names a token that is not in the vocabulary");
    }
    // A repeated pair keeps its last rank, as HF's merge map (built by successive inserts) does.
    tok->merges_[static_cast<uint64_t>(*l) << 32 | static_cast<uint32_t>(*r)] = Merge{static_cast<int32_t>(rank), *m};
  }
  if (sentencepiece && vocab.merges.empty() && !vocab.scores.empty()) {
    BATON_RETURN_IF_ERROR(tok->add_merges_from_scores(vocab.scores));
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
  tok->space_prefix_ = vocab.space_prefix;
  tok->prefix_before_space_ = vocab.prefix_before_space;
  tok->split_words_ = vocab.split_words;
  tok->byte_fallback_ = vocab.byte_fallback;
  tok->unk_id_ = vocab.unk_id;
  tok->fuse_unk_ = vocab.fuse_unk;
  tok->decode_strip_ = vocab.decode_strip;
  return tok;
}

// SentencePiece's BPE as merge rules: for every normal token, each way its text splits into two
// normal tokens is a merge into it. Ranked by the token's score, highest first (ties: lower id
// first), so the lowest rank among adjacent pairs is SentencePiece's best-scoring pair.
Status Tokenizer::add_merges_from_scores(const std::vector<float>& scores) {
  const auto n = static_cast<int32_t>(bytes_.size());
  std::vector<int32_t> order(n);
  for (int32_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return scores[a] > scores[b]; });
  std::vector<std::string> spelled(n);
  for (const auto& [text, id] : spelled_ids_) spelled[id] = text;
  const auto normal = [&](int32_t id) { return types_[id] == TokenType::kNormal; };
  for (int32_t rank = 0; rank < n; ++rank) {
    const int32_t id = order[rank];
    const std::string& text = spelled[id];
    if (!normal(id) || text.empty()) continue;
    for (size_t cut = utf8_step(text, 0).len; cut < text.size(); cut += utf8_step(text, cut).len) {
      const auto l = spelled_ids_.find(std::string_view(text).substr(0, cut));
      const auto r = spelled_ids_.find(std::string_view(text).substr(cut));
      if (l == spelled_ids_.end() || r == spelled_ids_.end() || !normal(l->second) || !normal(r->second)) continue;
      merges_.try_emplace(static_cast<uint64_t>(l->second) << 32 | static_cast<uint32_t>(r->second), Merge{rank, id});
    }
  }
  return Status::ok_status();
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

// Byte-level: one piece of pre-tokenized text, BPE-merged over its bytes.
void Tokenizer::encode_piece(std::string_view piece, BpeScratch& scratch, std::vector<int32_t>& ids) const {
  if (const auto whole = ignore_merges_ ? find_token(piece) : std::nullopt) {
    ids.push_back(*whole);
    return;
  }
  auto& symbols = scratch.symbols;
  symbols.clear();
  for (char c : piece) {
    // A byte the vocabulary lacks is dropped and its neighbours become adjacent, as in HF's BPE
    // without an unk token (SmolLM2 has no token for 0x04, for instance).
    if (const int32_t id = byte_ids_[static_cast<uint8_t>(c)]; id >= 0) {
      const auto i = static_cast<int32_t>(symbols.size());
      symbols.push_back({id, i - 1, i + 1, true});
    }
  }
  merge_symbols(scratch, ids);
}

// SentencePiece: one word ("▁"-spelled), BPE-merged over its characters as HF's BPE model with
// byte_fallback seeds them: a character's own token, else its bytes' <0xXX> tokens, else <unk>
// (consecutive ones fused), else nothing.
void Tokenizer::encode_word(std::string_view word, BpeScratch& scratch, std::vector<int32_t>& ids) const {
  if (const auto whole = ignore_merges_ ? spelled_ids_.find(word) : spelled_ids_.end(); whole != spelled_ids_.end()) {
    ids.push_back(whole->second);
    return;
  }
  auto& symbols = scratch.symbols;
  symbols.clear();
  const auto add = [&](int32_t id) {
    const auto i = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, i - 1, i + 1, true});
  };
  bool after_unk = false;
  for (size_t pos = 0; pos < word.size();) {
    const size_t len = utf8_step(word, pos).len;  // the text is valid UTF-8
    const std::string_view ch = word.substr(pos, len);
    pos += len;
    if (const auto it = spelled_ids_.find(ch); it != spelled_ids_.end()) {
      add(it->second);
      after_unk = false;
      continue;
    }
    const bool all_bytes = std::ranges::all_of(ch, [&](char c) { return fallback_ids_[static_cast<uint8_t>(c)] >= 0; });
    if (byte_fallback_ && all_bytes) {
      for (char c : ch) add(fallback_ids_[static_cast<uint8_t>(c)]);
      after_unk = false;
    } else if (unk_id_ >= 0 && !(fuse_unk_ && after_unk)) {
      add(unk_id_);
      after_unk = true;
    }
  }
  merge_symbols(scratch, ids);
}

// BPE as HF's Word::merge_all: repeatedly apply the lowest-ranked merge among adjacent symbols
// (leftmost on ties). A heap of candidate pairs, checked for staleness when popped, keeps a piece
// of n symbols at O(n log n). Appends the merged symbols' ids.
void Tokenizer::merge_symbols(BpeScratch& scratch, std::vector<int32_t>& ids) const {
  auto& symbols = scratch.symbols;
  auto& heap = scratch.heap;
  const auto greater = std::greater<BpeScratch::Candidate>();
  heap.clear();
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

Status Tokenizer::encode_text(std::string_view text, bool at_start, BpeScratch& scratch,
                              std::vector<int32_t>& ids) const {
  if (family_ == TokenizerFamily::kByteLevel) {
    return pre_->split(text, [&](std::string_view piece) {
      encode_piece(piece, scratch, ids);
      return Status::ok_status();
    });
  }
  // SentencePiece, as HF's Prepend + Replace normalizers or its Metaspace pre-tokenizer: spaces
  // spelled "▁", one more in front where SpacePrefix says (not of an empty stretch).
  if (text.empty()) return Status::ok_status();
  std::string spelled = replace_all(text, " ", kSpaceMark);
  const bool wants = space_prefix_ == SpacePrefix::kAlways || (space_prefix_ == SpacePrefix::kFirst && at_start);
  if (wants && (prefix_before_space_ || !text.starts_with(' '))) spelled.insert(0, kSpaceMark);
  if (!split_words_) {
    encode_word(spelled, scratch, ids);
    return Status::ok_status();
  }
  // Metaspace's split (MergedWithNext): a word begins at each "▁" and runs to the next one.
  const std::string_view all = spelled;
  for (size_t start = 0; start < all.size();) {
    const size_t from = all.substr(start).starts_with(kSpaceMark) ? start + kSpaceMark.size() : start;
    const size_t end = std::min(all.find(kSpaceMark, from), all.size());
    encode_word(all.substr(start, end - start), scratch, ids);
    start = end;
  }
  return Status::ok_status();
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
    BATON_RETURN_IF_ERROR(encode_text(text.substr(start, pos - start), start == 0, scratch, ids));
    ids.push_back(hit);
    pos += bytes_[hit].size();
    start = pos;
  }
  BATON_RETURN_IF_ERROR(encode_text(text.substr(start), start == 0, scratch, ids));
  return ids;
}

std::string_view pre_tokenizer_of_regex(std::string_view regex) {
  if (regex == kLlama3Pattern) return "llama3";
  if (regex == kQwen2Pattern) return "qwen2";
  return "";
}

const std::string& Tokenizer::token_bytes(int32_t id) const {
  static const std::string kEmpty;
  return id >= 0 && id < n_vocab() ? bytes_[id] : kEmpty;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  if (family_ == TokenizerFamily::kByteLevel) {
    std::string bytes;
    for (int32_t id : ids) bytes += token_bytes(id);
    return lossy_utf8(bytes);
  }
  // HF's SentencePiece decoders: "▁" as a space per token (unspelled at load), a run of byte
  // tokens as its text when that is valid UTF-8 and one U+FFFD per byte token otherwise (the
  // ByteFallback decoder), the pieces joined, then the leading space stripped.
  std::string out, run;
  size_t run_tokens = 0;
  const auto flush_run = [&] {
    if (utf8_invalid_offset(run) == std::string_view::npos) {
      out += run;
    } else {
      for (size_t i = 0; i < run_tokens; ++i) out += kReplacement;
    }
    run.clear();
    run_tokens = 0;
  };
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id >= 0 && id < n_vocab() && byte_of_token_[id] >= 0) {
      run += static_cast<char>(byte_of_token_[id]);
      ++run_tokens;
      continue;
    }
    flush_run();
    std::string_view text = token_bytes(id);
    if (i == 0 && decode_strip_ == DecodeStrip::kFirstToken && text.starts_with(' ')) text.remove_prefix(1);
    out += text;
  }
  flush_run();
  if (decode_strip_ == DecodeStrip::kText && out.starts_with(' ')) out.erase(0, 1);
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
