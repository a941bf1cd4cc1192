// The tokenizer on small in-memory vocabularies (no model file): BPE against a naive reference on
// random merges and words, byte coverage, special tokens, UTF-8 validation, streaming decode,
// round trips on random text, the GGUF and tokenizer.json loaders, and chat template rendering.
// Agreement with HF `tokenizers` on the real vocabulary is tests/e2e/test_tokenizer.py's job.
#include "model/tokenizer.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "model/chat_template.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"

using namespace baton;

namespace {

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += {static_cast<char>(0xC0 | cp >> 6), static_cast<char>(0x80 | (cp & 0x3F))};
  } else if (cp < 0x10000) {
    out += {static_cast<char>(0xE0 | cp >> 12), static_cast<char>(0x80 | (cp >> 6 & 0x3F)),
            static_cast<char>(0x80 | (cp & 0x3F))};
  } else {
    out += {static_cast<char>(0xF0 | cp >> 18), static_cast<char>(0x80 | (cp >> 12 & 0x3F)),
            static_cast<char>(0x80 | (cp >> 6 & 0x3F)), static_cast<char>(0x80 | (cp & 0x3F))};
  }
}

// GPT-2's bytes_to_unicode written from its definition: printable bytes stand for themselves, the
// n-th other byte (in byte order) becomes U+0100 + n.
std::string spell(std::string_view raw) {
  const auto printable = [](int b) { return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174; };
  std::string out;
  for (const char c : raw) {
    const int b = static_cast<uint8_t>(c);
    int cp = b;
    if (!printable(b)) {
      cp = 256;
      for (int other = 0; other < b; ++other) cp += printable(other) ? 0 : 1;
    }
    append_utf8(out, static_cast<uint32_t>(cp));
  }
  return out;
}

// A vocabulary of the 256 bytes (id = byte value) plus what a test adds, kept in raw bytes too.
struct VocabBuilder {
  TokenizerVocab vocab;
  std::vector<std::pair<std::string, std::string>> raw_merges;
  std::map<std::string, int32_t> ids;  // raw bytes -> id

  VocabBuilder() {
    for (int b = 0; b < 256; ++b) add(std::string(1, static_cast<char>(b)));
  }
  int32_t add(const std::string& raw, TokenType type = TokenType::kNormal) {
    const auto id = static_cast<int32_t>(vocab.tokens.size());
    vocab.tokens.push_back(type == TokenType::kNormal ? spell(raw) : raw);
    vocab.types.push_back(type);
    ids[raw] = id;
    return id;
  }
  int32_t merge(const std::string& left, const std::string& right) {
    vocab.merges.emplace_back(spell(left), spell(right));
    raw_merges.emplace_back(left, right);
    const auto it = ids.find(left + right);
    return it != ids.end() ? it->second : add(left + right);
  }
  std::unique_ptr<Tokenizer> build(const std::string& pre = "gpt-2") {
    TokenizerVocab v = vocab;
    v.pre = pre;
    auto tok = Tokenizer::from_vocab(std::move(v));
    REQUIRE(tok.ok());
    return std::move(tok).value();
  }
};

// The textbook BPE: merge the lowest-ranked adjacent pair, leftmost first, until none applies.
std::vector<int32_t> naive_bpe(const VocabBuilder& vb, const std::string& word) {
  std::vector<std::string> parts;
  for (const char c : word) parts.emplace_back(1, c);
  while (true) {
    size_t best_rank = SIZE_MAX, best_pos = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      for (size_t r = 0; r < vb.raw_merges.size() && r < best_rank; ++r) {
        if (vb.raw_merges[r] == std::pair{parts[i], parts[i + 1]}) best_rank = r, best_pos = i;
      }
    }
    if (best_rank == SIZE_MAX) break;
    parts[best_pos] += parts[best_pos + 1];
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(best_pos) + 1);
  }
  std::vector<int32_t> ids;
  for (const auto& p : parts) ids.push_back(vb.ids.at(p));
  return ids;
}

std::vector<int32_t> encode_ok(const Tokenizer& tok, std::string_view text, bool parse_special = true) {
  auto ids = tok.encode(text, parse_special);
  REQUIRE(ids.ok());
  return ids.value();
}

uint32_t fresh_seed() {
  return std::random_device{}();
}

}  // namespace

TEST_CASE("BPE applies merges by rank, leftmost first") {
  VocabBuilder vb;
  const int32_t ab = vb.merge("a", "b"), bc = vb.merge("b", "c"), abc = vb.merge("ab", "c");
  const int32_t aa = vb.merge("a", "a"), aaaa = vb.merge("aa", "aa");
  auto tok = vb.build();
  CHECK(encode_ok(*tok, "abc") == std::vector<int32_t>{abc});
  CHECK(encode_ok(*tok, "bc") == std::vector<int32_t>{bc});
  CHECK(encode_ok(*tok, "abbc") == std::vector<int32_t>{ab, bc});
  CHECK(encode_ok(*tok, "aaa") == std::vector<int32_t>{aa, 'a'});
  CHECK(encode_ok(*tok, "aaaaa") == std::vector<int32_t>{aaaa, 'a'});

  VocabBuilder reversed;  // the same tokens, ranks swapped: "bc" now wins over "ab"
  const int32_t bc2 = reversed.merge("b", "c");
  reversed.merge("a", "b");
  const int32_t abc2 = reversed.merge("a", "bc");
  auto tok2 = reversed.build();
  CHECK(encode_ok(*tok2, "abc") == std::vector<int32_t>{abc2});
  CHECK(encode_ok(*tok2, "abcc") == std::vector<int32_t>{abc2, 'c'});
  CHECK(encode_ok(*tok2, "bcab") == std::vector<int32_t>{bc2, reversed.ids.at("ab")});
}

TEST_CASE("BPE matches the naive reference on random merges and words") {
  const uint32_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937 rng(seed);
  VocabBuilder vb;
  std::vector<std::string> pool = {"a", "b", "c", "d"};
  for (int i = 0; i < 80; ++i) {
    const std::string& l = pool[rng() % pool.size()];
    const std::string& r = pool[rng() % pool.size()];
    if (l.size() + r.size() > 7) continue;
    bool known = false;
    for (const auto& m : vb.raw_merges) known |= m == std::pair{l, r};
    if (known) continue;
    const std::string merged = l + r;
    vb.merge(l, r);
    if (std::find(pool.begin(), pool.end(), merged) == pool.end()) pool.push_back(merged);
  }
  auto tok = vb.build();
  for (int i = 0; i < 500; ++i) {
    std::string word;
    for (size_t n = 1 + rng() % 24; n > 0; --n) word += static_cast<char>('a' + rng() % 4);
    INFO("word " << word);
    CHECK(encode_ok(*tok, word) == naive_bpe(vb, word));  // letters only: one pre-token
  }
}

TEST_CASE("every byte has its token and round-trips") {
  VocabBuilder vb;
  auto tok = vb.build();
  for (int b = 0; b < 256; ++b) {
    const std::string byte(1, static_cast<char>(b));
    CHECK(tok->token_bytes(b) == byte);
    CHECK(tok->find_token(byte) == b);
  }
  // Every byte valid UTF-8 can hold: ASCII, all continuation bytes, all lead bytes.
  std::string text;
  for (uint32_t cp = 0; cp < 0x80; ++cp) append_utf8(text, cp);
  for (uint32_t cp = 0x80; cp < 0x800; cp += 0x3F) append_utf8(text, cp);  // leads C2..DF, trails 80..BF
  // Lead bytes E0 and F0 only start code points from U+0800 and U+10000; ED only below U+D800.
  for (uint32_t lead = 0xE0; lead <= 0xEF; ++lead) {
    append_utf8(text, lead == 0xE0 ? 0x800 : (lead - 0xE0) << 12 | 0x123);
  }
  for (uint32_t lead = 0xF0; lead <= 0xF4; ++lead) {
    append_utf8(text, lead == 0xF0 ? 0x10000 : (lead - 0xF0) << 18 | 0x1234);
  }
  std::vector<int32_t> expected;
  for (const char c : text) expected.push_back(static_cast<uint8_t>(c));
  const auto ids = encode_ok(*tok, text);
  CHECK(ids == expected);
  CHECK(tok->decode(ids) == text);
  CHECK(tok->token_bytes(-1).empty());
  CHECK(tok->token_bytes(tok->n_vocab()).empty());
}

TEST_CASE("a byte without a token is dropped, as HF does") {
  VocabBuilder vb;
  vb.merge("!", "!");
  vb.vocab.tokens[4] = spell("\x04\x04");  // byte 0x04 loses its own token
  auto tok = vb.build();
  CHECK(encode_ok(*tok, "!\x04!") == std::vector<int32_t>{vb.ids.at("!!")});
}

TEST_CASE("control and user-defined tokens are matched whole, longest first") {
  VocabBuilder vb;
  const int32_t im_start = vb.add("<|im_start|>", TokenType::kControl);
  const int32_t im = vb.add("<|im", TokenType::kControl);
  const int32_t think = vb.add("<think>", TokenType::kUserDefined);
  const int32_t eos = vb.add("<|im_end|>", TokenType::kControl);
  const int32_t eot = vb.add("<|endoftext|>", TokenType::kControl);
  vb.vocab.eos_id = eos;
  auto tok = vb.build();
  CHECK(encode_ok(*tok, "x<|im_start|>y<think>") == std::vector<int32_t>{'x', im_start, 'y', think});
  CHECK(encode_ok(*tok, "<|im_start") == std::vector<int32_t>{im, '_', 's', 't', 'a', 'r', 't'});
  CHECK(encode_ok(*tok, "<|im_end|><|im_end|>") == std::vector<int32_t>{eos, eos});
  const auto plain = encode_ok(*tok, "<think>", /*parse_special=*/false);
  CHECK(plain == std::vector<int32_t>{'<', 't', 'h', 'i', 'n', 'k', '>'});
  CHECK(tok->is_control(im_start));
  CHECK_FALSE(tok->is_control(think));
  CHECK_FALSE(tok->is_control('a'));
  CHECK(tok->stop_ids() == std::vector<int32_t>{eos, eot});
  CHECK(tok->find_token("<|im_end|>") == eos);
  CHECK_FALSE(tok->find_token("<|nope|>").has_value());
}

TEST_CASE("invalid UTF-8 is rejected with its byte offset") {
  auto tok = VocabBuilder().build();
  const std::pair<std::string, size_t> cases[] = {
      {"\xff", 0},
      {"ab\xc3", 2},
      {"ok \xed\xa0\x80", 3},  // truncated; a surrogate
      {"\xc0\xaf", 0},
      {"x\xe0\x80\x80", 1},  // overlong
      {"\xf4\x90\x80\x80", 0},
      {"\x80", 0},
      {"a\xf0\x9f\x98", 1},  // > U+10FFFF; stray; cut emoji
  };
  for (const auto& [text, offset] : cases) {
    auto r = tok->encode(text);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(r.status().message(), Catch::Contains("UTF-8") && Catch::Contains("offset " + std::to_string(offset)));
  }
}

TEST_CASE("StreamDecoder holds a split character until it is complete") {
  auto tok = VocabBuilder().build();
  const std::string emoji = "\xF0\x9F\x98\x80";  // U+1F600, one token per byte here
  StreamDecoder dec(*tok);
  CHECK(dec.push('a') == "a");
  for (int i = 0; i < 3; ++i) CHECK(dec.push(static_cast<uint8_t>(emoji[i])).empty());
  CHECK(dec.push(static_cast<uint8_t>(emoji[3])) == emoji);
  CHECK(dec.flush().empty());

  CHECK(dec.push(0xC3).empty());  // a cut-off character becomes one U+FFFD at the end
  CHECK(dec.flush() == "\xEF\xBF\xBD");
  CHECK(dec.push(0xFF) == "\xEF\xBF\xBD");  // never valid: replaced at once
  CHECK(dec.push(0xE2).empty());
  CHECK(dec.push('b') ==
        "\xEF\xBF\xBD"
        "b");  // a lead byte cut short by another character
}

TEST_CASE("decode(encode(text)) == text on random text for every pre-tokenizer") {
  const uint32_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937 rng(seed);
  VocabBuilder vb;
  for (const auto& [l, r] : std::vector<std::pair<std::string, std::string>>{
           {" ", "t"}, {"h", "e"}, {" t", "he"}, {"1", "2"}, {"\xC3", "\xA9"}, {"\n", "\n"}, {" ", " "}}) {
    vb.merge(l, r);
  }
  vb.add("<|im_start|>", TokenType::kControl);
  const std::pair<uint32_t, uint32_t> blocks[] = {
      {0x20, 0x7E},   {0x9, 0xD},       {0xA0, 0x24F},    {0x300, 0x36F},   {0x400, 0x4FF},
      {0x660, 0x669}, {0x2000, 0x206F}, {0x3000, 0x30FF}, {0x4E00, 0x4FFF}, {0x1F300, 0x1F64F}};
  for (const char* pre : {"gpt-2", "smollm", "llama3", "qwen2"}) {
    auto tok = vb.build(pre);
    for (int i = 0; i < 200; ++i) {
      std::string text;
      for (size_t n = rng() % 40; n > 0; --n) {
        if (rng() % 16 == 0) {
          text += "<|im_start|>";
          continue;
        }
        const auto& [lo, hi] = blocks[rng() % std::size(blocks)];
        append_utf8(text, lo + static_cast<uint32_t>(rng() % (hi - lo + 1)));
      }
      INFO("pre-tokenizer " << pre << ", text " << text);
      CHECK(tok->decode(encode_ok(*tok, text)) == text);
      CHECK(tok->decode(encode_ok(*tok, text, /*parse_special=*/false)) == text);
    }
  }
}

TEST_CASE("pre-tokenizers split where HF does") {
  VocabBuilder vb;
  const int32_t n12 = vb.merge("1", "2"), n123 = vb.merge("12", "3");
  // smollm isolates every digit; gpt-2 keeps " 123" one piece; llama3 groups digits by three.
  CHECK(encode_ok(*vb.build("smollm"), "123") == std::vector<int32_t>{'1', '2', '3'});
  CHECK(encode_ok(*vb.build("gpt-2"), "123") == std::vector<int32_t>{n123});
  CHECK(encode_ok(*vb.build("llama3"), "1231") == std::vector<int32_t>{n123, '1'});
  CHECK(encode_ok(*vb.build("qwen2"), "12") == std::vector<int32_t>{'1', '2'});
  CHECK(encode_ok(*vb.build("gpt-2"), "12a") == std::vector<int32_t>{n12, 'a'});
  auto unknown = Tokenizer::from_vocab([&] {
    auto v = vb.vocab;
    v.pre = "bloom";
    return v;
  }());
  REQUIRE_FALSE(unknown.ok());
  CHECK(unknown.status().code() == StatusCode::kUnimplemented);
  CHECK_THAT(unknown.status().message(), Catch::Contains("bloom"));
}

TEST_CASE("from_gguf reads the tokenizer.ggml keys") {
  VocabBuilder vb;
  const int32_t he = vb.merge("h", "e");
  const int32_t eos = vb.add("<|im_end|>", TokenType::kControl);
  std::vector<std::string> merges;
  for (const auto& [l, r] : vb.vocab.merges) merges.push_back(l + " " + r);
  std::vector<int32_t> types;
  for (TokenType t : vb.vocab.types) types.push_back(static_cast<int32_t>(t));
  const auto file_with = [&](const std::string& model, const std::string& pre) {
    GgufWriter w;
    w.add_string("tokenizer.ggml.model", model);
    w.add_string("tokenizer.ggml.pre", pre);
    w.add_string_array("tokenizer.ggml.tokens", vb.vocab.tokens);
    w.add_string_array("tokenizer.ggml.merges", merges);
    w.add_i32_array("tokenizer.ggml.token_type", types);
    w.add_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(eos));
    w.add_bool("tokenizer.ggml.add_bos_token", false);
    auto file = GgufFile::parse(w.to_bytes());
    REQUIRE(file.ok());
    return std::move(file).value();
  };
  auto tok = Tokenizer::from_gguf(*file_with("gpt2", "smollm"));
  REQUIRE(tok.ok());
  CHECK(encode_ok(**tok, "he1<|im_end|>") == std::vector<int32_t>{he, '1', eos});
  CHECK((*tok)->eos_id() == eos);
  CHECK((*tok)->bos_id() == -1);
  CHECK_FALSE((*tok)->add_bos());
  auto bert = Tokenizer::from_gguf(*file_with("bert", "default"));  // WordPiece
  REQUIRE_FALSE(bert.ok());
  CHECK(bert.status().code() == StatusCode::kUnimplemented);
  CHECK_THAT(bert.status().message(), Catch::Contains("'bert'"));
  CHECK(Tokenizer::from_gguf(*file_with("gpt2", "no-such-pre")).status().code() == StatusCode::kUnimplemented);
  auto no_template = chat_template_from_gguf(*file_with("gpt2", "smollm"));
  CHECK(no_template.status().code() == StatusCode::kNotFound);
  CHECK_THAT(no_template.status().message(), Catch::Contains("--chat-template"));
}

TEST_CASE("from_hf_json reads a byte-level BPE tokenizer.json") {
  VocabBuilder vb;
  const int32_t he = vb.merge("h", "e");
  const auto dir = std::filesystem::temp_directory_path() / ("baton_tokenizer_test_" + std::to_string(fresh_seed()));
  std::filesystem::create_directories(dir);
  nlohmann::json vocab = nlohmann::json::object();
  for (size_t id = 0; id < vb.vocab.tokens.size(); ++id) vocab[vb.vocab.tokens[id]] = id;
  const auto eos = static_cast<int32_t>(vb.vocab.tokens.size());
  nlohmann::json merges = nlohmann::json::array();
  for (const auto& [l, r] : vb.vocab.merges) merges.push_back(l + " " + r);
  const nlohmann::json j = {
      {"added_tokens", {{{"id", eos}, {"content", "<|im_end|>"}, {"special", true}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Digits"}, {"individual_digits", true}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}}}}},
      {"post_processor", nullptr},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}},
  };
  std::ofstream(dir / "tokenizer.json") << j.dump();
  std::ofstream(dir / "tokenizer_config.json") << R"({"eos_token": "<|im_end|>", "add_bos_token": false})";
  auto tok = Tokenizer::from_hf_json((dir / "tokenizer.json").string());
  std::filesystem::remove_all(dir);
  REQUIRE(tok.ok());
  CHECK(encode_ok(**tok, "he12<|im_end|>") == std::vector<int32_t>{he, '1', '2', eos});
  CHECK((*tok)->eos_id() == eos);
  CHECK((*tok)->stop_ids() == std::vector<int32_t>{eos});
  CHECK(Tokenizer::from_hf_json("/nonexistent/tokenizer.json").status().code() == StatusCode::kNotFound);
}
