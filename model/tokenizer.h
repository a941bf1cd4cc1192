// BPE tokenizers of two families, and a UTF-8-safe streaming detokeniser:
//   byte-level BPE (GPT-2 family: SmolLM2, Llama 3, Qwen2), and
//   SentencePiece-style BPE (Llama 2, Mistral, TinyLlama: spaces spelled "▁", byte fallback).
//
// Truth is Hugging Face `tokenizers` on the same vocabulary: encode() must give the ids HF's
// `encode(text, add_special_tokens=False)` gives, and decode() the text HF's
// `decode(ids, skip_special_tokens=False)` gives. The pipeline is HF's:
//   1. control / user-defined token texts found in the text become their single id (leftmost,
//      longest first), when parse_special is set;
//   2. each stretch of text between them is pre-tokenized. Byte-level: split into pieces by the
//      regex of `tokenizer.ggml.pre` (SmolLM2 first isolates every \p{N} character).
//      SentencePiece: spaces become "▁", a "▁" goes in front (SpacePrefix), and the stretch
//      is one piece (or one per "▁word" with split_words);
//   3. each piece is BPE-merged, lowest merge rank first, leftmost on ties: byte-level over its
//      bytes; SentencePiece over its characters, a character the vocabulary lacks becoming the
//      <0xXX> tokens of its bytes (byte fallback) or <unk>.
// Tokens are kept as the raw bytes they stand for (the byte-level spelling, "▁" and <0xXX> are
// undone at load), so token_bytes() is what a stream concatenates.
//
// Thread-safety: a Tokenizer is immutable after construction; encode() and decode() may run
// concurrently. A StreamDecoder belongs to one sequence.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/status.h"

namespace baton {

class GgufFile;

// llama.cpp's token types, as stored in `tokenizer.ggml.token_type`.
enum class TokenType : int32_t {
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,      // special (<|im_start|>): matched whole in text, ends turns, never merged
  kUserDefined = 4,  // added, not special (<think>): matched whole in text
  kUnused = 5,
  kByte = 6,
};

// How a vocabulary turns text into the symbols BPE merges (tokenizer.json's model and
// pre-tokenizer; GGUF's tokenizer.ggml.model "gpt2" or "llama").
enum class TokenizerFamily {
  kByteLevel,      // the text's bytes, in GPT-2's byte alphabet, split by a regex first
  kSentencePiece,  // the text's characters with spaces spelled "▁", byte fallback
};

// SentencePiece: which stretches of text between added tokens get a "▁" in front.
enum class SpacePrefix {
  kAlways,  // every one (HF's Prepend normalizer, Metaspace "always"; llama.cpp's add_space_prefix)
  kFirst,   // only one that starts the text (Metaspace "first")
  kNever,
};

// SentencePiece: the space a decoded text loses at its start (HF's decoder).
enum class DecodeStrip {
  kNone,
  kText,        // one leading space of the whole text (Strip(" ", 1, 0) after Fuse)
  kFirstToken,  // one leading space of the first token's text (the Metaspace decoder)
};

// Everything a Tokenizer is built from; from_gguf and from_hf_json fill it, tests build it by hand.
struct TokenizerVocab {
  TokenizerFamily family = TokenizerFamily::kByteLevel;
  // Token texts in the GPT-2 byte-level spelling ("Ġthe" for " the"), as tokenizer.json and GGUF
  // store them. A text using any character outside that alphabet (an added token such as
  // "<|reserved special token 0|>") stands for its own UTF-8 bytes, as in HF's GGUF import.
  std::vector<std::string> tokens;
  std::vector<TokenType> types;  // empty (all normal) or one per token
  // Merge rules in rank order (index = rank), each a pair of token texts in the same spelling.
  std::vector<std::pair<std::string, std::string>> merges;
  int32_t bos_id = -1;   // -1: none
  int32_t eos_id = -1;   // -1: none
  bool add_bos = false;  // whether callers should prepend bos_id to a prompt
  // Pre-tokenizer, by `tokenizer.ggml.pre` name: "gpt-2"/"default", "smollm", "llama3"/"llama-bpe",
  // "qwen2".
  std::string pre = "gpt-2";
  // HF's BPE `ignore_merges` (Llama 3): a piece that is itself a token is emitted whole.
  bool ignore_merges = false;

  // SentencePiece only. Token texts spell a space "▁"; <0xXX> texts are byte tokens.
  SpacePrefix space_prefix = SpacePrefix::kAlways;
  // Also in front of a stretch that starts with a space (HF's Prepend normalizer; llama.cpp),
  // which Metaspace leaves without one.
  bool prefix_before_space = true;
  bool split_words = false;   // Metaspace `split`: each "▁word" is merged alone
  bool byte_fallback = true;  // a character without a token becomes its bytes' <0xXX> tokens
  int32_t unk_id = -1;        // <unk> for a character without a token (-1: it is dropped)
  bool fuse_unk = true;       // consecutive unknown characters become one <unk>
  // When `merges` is empty (a GGUF "llama" vocabulary): every pair of tokens whose texts join to a
  // token is a merge into it, ranked by that token's score, highest first (SentencePiece's BPE).
  std::vector<float> scores;
  DecodeStrip decode_strip = DecodeStrip::kText;
};

class PreTokenizerRegex;  // PCRE2 state, defined in tokenizer.cpp

class Tokenizer {
 public:
  // Validates the vocabulary: INVALID_ARGUMENT for a merge naming a missing token or a bad
  // bos/eos/unk id; UNIMPLEMENTED for an unknown pre-tokenizer. A byte with no single-byte token is
  // legal (HF drops it when encoding, and so does encode()).
  static Result<std::unique_ptr<Tokenizer>> from_vocab(TokenizerVocab vocab);
  // From GGUF metadata (`tokenizer.ggml.*`): `tokenizer.ggml.model` "gpt2" (byte-level BPE) or
  // "llama" (SentencePiece BPE, with llama.cpp's add_space_prefix). tokenizer_vocab.cpp.
  static Result<std::unique_ptr<Tokenizer>> from_gguf(const GgufFile& file);
  // From a Hugging Face tokenizer.json (byte-level or SentencePiece-style BPE); bos/eos/add_bos
  // come from its post-processor and a tokenizer_config.json next to it. Anything in it that would
  // change the ids and that baton does not implement is refused, naming it. tokenizer_vocab.cpp.
  static Result<std::unique_ptr<Tokenizer>> from_hf_json(const std::string& path);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // UTF-8 text -> ids. INVALID_ARGUMENT naming the byte offset for invalid UTF-8. Never adds BOS
  // (add_bos() tells the caller whether to).
  Result<std::vector<int32_t>> encode(std::string_view text, bool parse_special = true) const;
  // The raw bytes token `id` stands for; empty for an id outside [0, n_vocab). A stream of them
  // keeps the space a SentencePiece word starts with ("▁Paris" -> " Paris"): the text continues
  // the prompt.
  const std::string& token_bytes(int32_t id) const;
  // The text HF's decode(ids, skip_special_tokens=False) gives: byte-level, the token bytes with
  // each invalid UTF-8 sequence as one U+FFFD; SentencePiece, each run of byte tokens as its text
  // when valid UTF-8 (else one U+FFFD per byte token), and the leading space DecodeStrip removes.
  std::string decode(std::span<const int32_t> ids) const;

  int32_t n_vocab() const { return static_cast<int32_t>(bytes_.size()); }
  TokenizerFamily family() const { return family_; }
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  bool add_bos() const { return add_bos_; }
  bool is_control(int32_t id) const;
  TokenType type(int32_t id) const { return types_[static_cast<size_t>(id)]; }  // id in [0, n_vocab)
  // Ids that end a generation: eos plus whichever end-of-turn tokens the vocabulary has
  // (<|im_end|>, <|eot_id|>, <|end_of_text|>, <|endoftext|>).
  const std::vector<int32_t>& stop_ids() const { return stop_ids_; }
  // The id of the token standing for exactly these bytes ("<|im_end|>", " the").
  std::optional<int32_t> find_token(std::string_view text) const;

 private:
  Tokenizer();
  struct Merge {
    int32_t rank;
    int32_t id;  // the merged token
  };
  // Hashes std::string and std::string_view alike, so lookups by view do not allocate.
  struct TextHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  struct BpeScratch;
  // One stretch of text between added tokens; `at_start`: it begins the text.
  Status encode_text(std::string_view text, bool at_start, BpeScratch& scratch, std::vector<int32_t>& ids) const;
  void encode_piece(std::string_view piece, BpeScratch& scratch, std::vector<int32_t>& ids) const;
  void encode_word(std::string_view word, BpeScratch& scratch, std::vector<int32_t>& ids) const;
  void merge_symbols(BpeScratch& scratch, std::vector<int32_t>& ids) const;
  const Merge* find_merge(int32_t left, int32_t right) const;
  Status add_merges_from_scores(const std::vector<float>& scores);

  std::vector<std::string> bytes_;  // id -> raw bytes
  std::vector<TokenType> types_;    // id -> type
  // raw bytes -> id (the last id on duplicates, like HF's vocabulary map)
  std::unordered_map<std::string, int32_t, TextHash, std::equal_to<>> ids_;
  std::array<int32_t, 256> byte_ids_{};         // byte -> its single-byte token, or -1
  std::unordered_map<uint64_t, Merge> merges_;  // (left id << 32 | right id) -> merge
  // Control and user-defined tokens by first byte, longest first: the candidates at a position.
  std::array<std::vector<int32_t>, 256> specials_by_byte_;
  std::unique_ptr<PreTokenizerRegex> pre_;
  std::vector<int32_t> stop_ids_;
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  bool add_bos_ = false;
  bool ignore_merges_ = false;

  // SentencePiece only.
  TokenizerFamily family_ = TokenizerFamily::kByteLevel;
  // token text as the vocabulary spells it ("▁the") -> id (the last id on duplicates)
  std::unordered_map<std::string, int32_t, TextHash, std::equal_to<>> spelled_ids_;
  std::array<int32_t, 256> fallback_ids_{};  // byte -> its <0xXX> token, or -1
  std::vector<int16_t> byte_of_token_;       // id -> the byte a <0xXX> token stands for, or -1
  SpacePrefix space_prefix_ = SpacePrefix::kAlways;
  bool prefix_before_space_ = true;
  bool split_words_ = false;
  bool byte_fallback_ = true;
  int32_t unk_id_ = -1;
  bool fuse_unk_ = true;
  DecodeStrip decode_strip_ = DecodeStrip::kText;
};

// The `tokenizer.ggml.pre` name of the byte-level pre-tokenizer whose split pattern is `regex`, as
// tokenizer.json spells it ("llama3", "qwen2"), or "" for a pattern baton does not implement.
std::string_view pre_tokenizer_of_regex(std::string_view regex);

// Incremental detokenisation for streaming. push() returns only complete UTF-8 characters: bytes of
// a character split across tokens are held until it completes. Bytes that can never form a valid
// character come out as U+FFFD at once; flush() returns what is held, an incomplete trailing
// character becoming one U+FFFD.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  std::string push(int32_t id);
  std::string flush();

 private:
  const Tokenizer& tokenizer_;
  std::string pending_;  // an incomplete UTF-8 character (at most 3 bytes)
};

}  // namespace baton
