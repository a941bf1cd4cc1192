// The SentencePiece-style tokenizer (Llama 2, Mistral, TinyLlama) on small in-memory vocabularies:
// merges derived from scores against a naive SentencePiece BPE on random vocabularies and texts,
// the space prefix of each convention, byte fallback and <unk>, HF's decode rules, streaming
// that never splits a character, and the tokenizer.json and GGUF readers with their refusals.
// Agreement with HF `tokenizers` on trained vocabularies is tests/e2e/test_tokenizer_sentencepiece.py's.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/tokenizer.h"
#include "model/utf8.h"

using namespace baton;

namespace {

const std::string kMark = "\xE2\x96\x81";  // "▁"

std::string byte_token(int b) {
  char text[8];
  std::snprintf(text, sizeof(text), "<0x%02X>", b);
  return text;
}

// <unk>, <s>, </s>, the 256 byte tokens, then what a test adds (with a score each).
struct SpmBuilder {
  TokenizerVocab vocab;
  std::map<std::string, int32_t> ids;  // spelled text -> id

  SpmBuilder() {
    vocab.family = TokenizerFamily::kSentencePiece;
    add("<unk>", 0, TokenType::kUnknown);
    add("<s>", 0, TokenType::kControl);
    add("</s>", 0, TokenType::kControl);
    for (int b = 0; b < 256; ++b) add(byte_token(b), 0, TokenType::kByte);
    vocab.unk_id = 0;
    vocab.bos_id = 1;
    vocab.eos_id = 2;
  }
  int32_t add(const std::string& text, float score, TokenType type = TokenType::kNormal) {
    const auto id = static_cast<int32_t>(vocab.tokens.size());
    vocab.tokens.push_back(text);
    vocab.types.push_back(type);
    vocab.scores.push_back(score);
    ids[text] = id;
    return id;
  }
  std::unique_ptr<Tokenizer> build() const {
    auto tok = Tokenizer::from_vocab(vocab);
    REQUIRE(tok.ok());
    return std::move(tok).value();
  }
};

std::vector<std::string> chars_of(const std::string& s) {
  std::vector<std::string> out;
  for (size_t pos = 0; pos < s.size();) {
    const size_t len = utf8_step(s, pos).len;
    out.push_back(s.substr(pos, len));
    pos += len;
  }
  return out;
}

// SentencePiece's BPE, textbook: characters (a missing one as its bytes' tokens), then merge the
// adjacent pair whose join is a normal token of the highest score, leftmost first, until none is.
std::vector<int32_t> naive_spm(const SpmBuilder& b, const std::string& text) {
  std::string spelled = kMark;  // SentencePiece's dummy prefix
  for (const char c : text) spelled += c == ' ' ? kMark : std::string(1, c);
  std::vector<std::string> parts;
  for (const std::string& ch : chars_of(spelled)) {
    if (b.ids.contains(ch)) {
      parts.push_back(ch);
    } else {
      for (const char c : ch) parts.push_back(byte_token(static_cast<uint8_t>(c)));
    }
  }
  const auto normal = [&](const std::string& t) {
    const auto it = b.ids.find(t);
    return it != b.ids.end() && b.vocab.types[it->second] == TokenType::kNormal;
  };
  while (true) {
    float best = -1e30f;
    size_t at = SIZE_MAX;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      const std::string joined = parts[i] + parts[i + 1];
      if (normal(parts[i]) && normal(parts[i + 1]) && normal(joined) && b.vocab.scores[b.ids.at(joined)] > best) {
        best = b.vocab.scores[b.ids.at(joined)];
        at = i;
      }
    }
    if (at == SIZE_MAX) break;
    parts[at] += parts[at + 1];
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(at) + 1);
  }
  std::vector<int32_t> out;
  for (const auto& p : parts) out.push_back(b.ids.at(p));
  return out;
}

std::vector<int32_t> encode_ok(const Tokenizer& tok, std::string_view text, bool parse_special = true) {
  auto ids = tok.encode(text, parse_special);
  REQUIRE(ids.ok());
  return ids.value();
}

}  // namespace

TEST_CASE("SentencePiece BPE from scores equals a naive SentencePiece on random vocabularies") {
  const uint32_t seed = std::random_device{}();
  INFO("seed " << seed);
  std::mt19937 rng(seed);
  const std::vector<std::string> alphabet = {kMark, "a", "b", "c", "\xC3\xA9" /* é */, "\xE6\x97\xA5" /* 日 */};
  for (int round = 0; round < 5; ++round) {
    SpmBuilder b;
    for (const auto& ch : alphabet) b.add(ch, -1e6f);
    // Random multi-character tokens, each with its own score: distinct, as SentencePiece's are.
    std::vector<std::string> pool = alphabet;
    std::uniform_real_distribution<float> score(-1000.0f, 0.0f);
    for (int i = 0; i < 60; ++i) {
      const std::string t = pool[rng() % pool.size()] + pool[rng() % pool.size()];
      if (b.ids.contains(t) || t.size() > 12) continue;
      b.add(t, score(rng));
      pool.push_back(t);
    }
    auto tok = b.build();
    const std::vector<std::string> letters = {
        " ", "a", "b", "c", "\xC3\xA9", "\xE6\x97\xA5", "\xC3\xBC" /* ü: no token */, "\xF0\x9F\x98\x80" /* 😀 */};
    for (int i = 0; i < 300; ++i) {
      std::string text;
      for (size_t n = 1 + rng() % 20; n > 0; --n) text += letters[rng() % letters.size()];
      INFO("text '" << text << "'");
      CHECK(encode_ok(*tok, text) == naive_spm(b, text));
      CHECK(tok->decode(encode_ok(*tok, text)) == text);  // the prefix's space stripped again
    }
  }
}

TEST_CASE("the space in front: legacy (every stretch), Metaspace first/always/never, split words") {
  SpmBuilder b;
  const int32_t mark = b.add(kMark, -1), x = b.add("x", -1), y = b.add("y", -1);
  const int32_t mx = b.add(kMark + "x", -2), my = b.add(kMark + "y", -3), mm = b.add(kMark + kMark, -1.5f);
  SECTION("legacy: Prepend normalizer (and llama.cpp): every stretch, even one starting with a space") {
    auto tok = b.build();
    CHECK(encode_ok(*tok, "x y") == std::vector<int32_t>{mx, my});
    CHECK(encode_ok(*tok, " x") == std::vector<int32_t>{mm, x});  // "▁▁x": ▁▁ scores above ▁x
    CHECK(encode_ok(*tok, "x<s>y") == std::vector<int32_t>{mx, 1, my});
    CHECK(encode_ok(*tok, "<s>") == std::vector<int32_t>{1});  // an empty stretch gets nothing
  }
  SECTION("Metaspace first: only the stretch that starts the text, and not before a space") {
    b.vocab.space_prefix = SpacePrefix::kFirst;
    b.vocab.prefix_before_space = false;
    auto tok = b.build();
    CHECK(encode_ok(*tok, " x") == std::vector<int32_t>{mx});
    CHECK(encode_ok(*tok, "x<s>y") == std::vector<int32_t>{mx, 1, y});
    CHECK(encode_ok(*tok, "<s>x") == std::vector<int32_t>{1, x});
  }
  SECTION("Metaspace always, never") {
    b.vocab.prefix_before_space = false;
    b.vocab.space_prefix = SpacePrefix::kAlways;
    CHECK(encode_ok(*b.build(), "x<s>y") == std::vector<int32_t>{mx, 1, my});
    b.vocab.space_prefix = SpacePrefix::kNever;
    CHECK(encode_ok(*b.build(), "x<s>y") == std::vector<int32_t>{x, 1, y});
  }
  SECTION("split: each ▁word merged alone") {
    b.vocab.split_words = true;
    auto tok = b.build();
    CHECK(encode_ok(*tok, "x y") == std::vector<int32_t>{mx, my});  // "x▁y" cannot form across words
    CHECK(encode_ok(*tok, "x  y") == std::vector<int32_t>{mx, mark, my});
  }
}

TEST_CASE("byte fallback for a character without a token, else <unk> (fused)") {
  SpmBuilder b;
  const int32_t mark = b.add(kMark, -1), a = b.add("a", -1);
  auto tok = b.build();
  // ü (C3 BC) has no token: its bytes' tokens; 😀 too.
  CHECK(encode_ok(*tok, "a\xC3\xBC") == std::vector<int32_t>{mark, a, 3 + 0xC3, 3 + 0xBC});
  b.vocab.byte_fallback = false;
  CHECK(encode_ok(*b.build(), "a\xC3\xBC\xC3\xBC") == std::vector<int32_t>{mark, a, 0});  // fused
  b.vocab.fuse_unk = false;
  CHECK(encode_ok(*b.build(), "a\xC3\xBC\xC3\xBC") == std::vector<int32_t>{mark, a, 0, 0});
  b.vocab.unk_id = -1;
  CHECK(encode_ok(*b.build(), "a\xC3\xBC") == std::vector<int32_t>{mark, a});  // dropped
}

TEST_CASE("decode as HF's decoders: byte runs, U+FFFD per byte token of an invalid run, the leading space") {
  SpmBuilder b;
  const int32_t mark = b.add(kMark, -1), a = b.add(kMark + "a", -1), z = b.add("z", -1);
  const auto byte = [](int v) { return 3 + v; };
  auto tok = b.build();
  CHECK(tok->decode(std::vector<int32_t>{a, z}) == "az");  // "▁a" starts the text: its space goes
  CHECK(tok->decode(std::vector<int32_t>{z, a}) == "z a");
  CHECK(tok->decode(std::vector<int32_t>{mark, mark, z}) == " z");  // one space only
  CHECK(tok->decode(std::vector<int32_t>{z, byte(0xC3), byte(0xBC), z}) == "z\xC3\xBCz");
  // An incomplete character (E6 97 of 日) is one U+FFFD per byte token, then the rest.
  CHECK(tok->decode(std::vector<int32_t>{z, byte(0xE6), byte(0x97), a}) == "z\xEF\xBF\xBD\xEF\xBF\xBD a");
  CHECK(tok->decode(std::vector<int32_t>{byte(0x20), z}) == "z");  // Strip sees the fused text
  CHECK(tok->decode(std::vector<int32_t>{1, a}) == "<s> a");
  b.vocab.decode_strip = DecodeStrip::kFirstToken;  // the Metaspace decoder: the first token's space
  CHECK(b.build()->decode(std::vector<int32_t>{byte(0x20), z}) == " z");
  CHECK(b.build()->decode(std::vector<int32_t>{a, a}) == "a a");
  b.vocab.decode_strip = DecodeStrip::kNone;
  CHECK(b.build()->decode(std::vector<int32_t>{a, z}) == " az");
  // A stream keeps the space: the text continues the prompt.
  CHECK(tok->token_bytes(a) == " a");
}

TEST_CASE("streaming byte-fallback pieces never splits a character") {
  SpmBuilder b;
  b.add(kMark, -1);
  auto tok = b.build();
  const uint32_t seed = std::random_device{}();
  INFO("seed " << seed);
  std::mt19937 rng(seed);
  const std::vector<std::string> chars = {"a", "\xC3\xBC", "\xE6\x97\xA5", "\xF0\x9F\x98\x80", " "};
  for (int i = 0; i < 200; ++i) {
    std::string text;
    for (size_t n = 1 + rng() % 12; n > 0; --n) text += chars[rng() % chars.size()];
    StreamDecoder stream(*tok);
    std::string out;
    for (int32_t id : encode_ok(*tok, text)) {
      const std::string piece = stream.push(id);
      CHECK(utf8_invalid_offset(piece) == std::string_view::npos);  // whole characters only
      out += piece;
    }
    out += stream.flush();
    CHECK(out == " " + text);  // the stream keeps the prefix's space
  }
}

namespace {

nlohmann::json legacy_tokenizer_json(const SpmBuilder& b) {
  nlohmann::json vocab = nlohmann::json::object();
  for (size_t id = 0; id < b.vocab.tokens.size(); ++id) vocab[b.vocab.tokens[id]] = id;
  nlohmann::json added = nlohmann::json::array();
  for (int id = 0; id < 3; ++id) {
    added.push_back({{"id", id},
                     {"content", b.vocab.tokens[id]},
                     {"special", true},
                     {"normalized", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"single_word", false}});
  }
  return {
      {"added_tokens", added},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers",
         {{{"type", "Prepend"}, {"prepend", kMark}},
          {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kMark}}}}}},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {{{"type", "Replace"}, {"pattern", {{"String", kMark}}}, {"content", " "}},
          {{"type", "ByteFallback"}},
          {{"type", "Fuse"}},
          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model",
       {{"type", "BPE"},
        {"unk_token", "<unk>"},
        {"byte_fallback", true},
        {"fuse_unk", true},
        {"vocab", vocab},
        {"merges", nlohmann::json::array({kMark + " x", "x y"})}}},
  };
}

Result<std::unique_ptr<Tokenizer>> load_json(const nlohmann::json& j) {
  const auto dir = std::filesystem::temp_directory_path() / ("baton_spm_" + std::to_string(std::random_device{}()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "tokenizer.json") << j.dump();
  std::ofstream(dir / "tokenizer_config.json") << R"({"bos_token": "<s>", "eos_token": "</s>"})";
  auto tok = Tokenizer::from_hf_json((dir / "tokenizer.json").string());
  std::filesystem::remove_all(dir);
  return tok;
}

}  // namespace

TEST_CASE("from_hf_json reads SentencePiece-style tokenizer.json files and refuses what it cannot honour") {
  SpmBuilder b;
  const int32_t mark = b.add(kMark, 0), x = b.add("x", 0), y = b.add("y", 0);
  const int32_t mx = b.add(kMark + "x", 0), xy = b.add("xy", 0);
  const nlohmann::json legacy = legacy_tokenizer_json(b);
  auto tok = load_json(legacy);
  REQUIRE(tok.ok());
  CHECK((*tok)->family() == TokenizerFamily::kSentencePiece);
  CHECK(encode_ok(**tok, "xy x") == std::vector<int32_t>{mx, y, mx});  // by rank: ▁x before xy
  CHECK(encode_ok(**tok, "yxy") == std::vector<int32_t>{mark, y, xy});
  CHECK(encode_ok(**tok, "yx") == std::vector<int32_t>{mark, y, x});
  CHECK(((*tok)->bos_id() == 1 && (*tok)->eos_id() == 2 && (*tok)->add_bos()));
  CHECK((*tok)->decode(encode_ok(**tok, "xy x")) == "xy x");

  nlohmann::json metaspace = legacy;  // transformers' LlamaTokenizer layout
  metaspace["normalizer"] = nullptr;
  metaspace["pre_tokenizer"] = {
      {"type", "Metaspace"}, {"replacement", kMark}, {"prepend_scheme", "first"}, {"split", false}};
  auto meta = load_json(metaspace);
  REQUIRE(meta.ok());
  CHECK(encode_ok(**meta, " x") == std::vector<int32_t>{mx});
  CHECK(encode_ok(**meta, "x<s>y") == std::vector<int32_t>{mx, 1, y});

  const auto refused = [&](nlohmann::json j, const std::string& why) {
    auto r = load_json(j);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kUnimplemented);
    CHECK_THAT(r.status().message(), Catch::Contains(why));
  };
  nlohmann::json j = legacy;
  j["added_tokens"][1]["normalized"] = true;
  refused(j, "normalized");
  j = legacy;
  j["added_tokens"][1]["lstrip"] = true;
  refused(j, "lstrip");
  j = legacy;
  j["model"]["dropout"] = 0.1;
  refused(j, "dropout");
  j = legacy;
  j["decoder"]["decoders"][3]["start"] = 2;
  refused(j, "decoder step");
  j = legacy;
  j["normalizer"]["normalizers"].push_back({{"type", "NFKC"}});
  refused(j, "normalizer");
  j = legacy;
  j["decoder"]["decoders"].erase(1);  // no ByteFallback: byte tokens would come out as "<0xC3>"
  refused(j, "decoder does not undo");
}

TEST_CASE("from_gguf reads a SentencePiece (\"llama\") vocabulary: merges from its scores") {
  SpmBuilder b;
  const int32_t mark = b.add(kMark, -1), x = b.add("x", -1), y = b.add("y", -1);
  const int32_t xy = b.add("xy", -10), mx = b.add(kMark + "x", -20), mxy = b.add(kMark + "xy", -30);
  std::vector<int32_t> types;
  for (TokenType t : b.vocab.types) types.push_back(static_cast<int32_t>(t));
  GgufWriter w;
  w.add_string("tokenizer.ggml.model", "llama");
  w.add_string_array("tokenizer.ggml.tokens", b.vocab.tokens);
  w.add_f32_array("tokenizer.ggml.scores", b.vocab.scores);
  w.add_i32_array("tokenizer.ggml.token_type", types);
  w.add_u32("tokenizer.ggml.bos_token_id", 1);
  w.add_u32("tokenizer.ggml.eos_token_id", 2);
  w.add_u32("tokenizer.ggml.unknown_token_id", 0);
  auto file = GgufFile::parse(w.to_bytes());
  REQUIRE(file.ok());
  auto tok = Tokenizer::from_gguf(**file);
  REQUIRE(tok.ok());
  // "▁xy": x+y (score -10) beats ▁+x (-20); then ▁+xy (-30).
  CHECK(encode_ok(**tok, "xy") == std::vector<int32_t>{mxy});
  CHECK(encode_ok(**tok, "x") == std::vector<int32_t>{mx});
  CHECK(encode_ok(**tok, "y xy") == std::vector<int32_t>{mark, y, mxy});
  CHECK(encode_ok(**tok, "yx y") == std::vector<int32_t>{mark, y, x, mark, y});  // x+▁ is no token
  CHECK(encode_ok(**tok, "xyxy") == std::vector<int32_t>{mxy, xy});
  CHECK(((*tok)->add_bos() && (*tok)->bos_id() == 1 && (*tok)->stop_ids() == std::vector<int32_t>{2}));
}
