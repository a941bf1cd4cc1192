// A step's batch as the host builds it: the new tokens of every sequence, concatenated, with
// positions, per-sequence KV offsets and block tables, and which rows need logits (only the last
// position of each finished prompt or decoding sequence: the LM head never runs for every token).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/check.h"
#include "kernels/backend.h"

namespace baton {

// Which of a sequence's new tokens get logits.
enum class Logits { kNone, kLast, kAll };

class StepBatch {
 public:
  // Appends a sequence's new tokens at positions [kv_offset, kv_offset + tokens.size()).
  // `block_table` must cover every position up to the last new one and outlive the batch.
  // Logits rows are returned in add order (kAll: one per new token, for tests and analysis).
  void add(std::span<const int32_t> tokens, int32_t kv_offset, std::span<const int32_t> block_table, Logits logits) {
    BATON_CHECK(!tokens.empty(), "a sequence in a step needs at least one token");
    SeqView s;
    s.row0 = static_cast<int32_t>(tokens_.size());
    s.n_new = static_cast<int32_t>(tokens.size());
    s.kv_offset = kv_offset;
    s.block_table = block_table.data();
    s.n_blocks = static_cast<int32_t>(block_table.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens_.push_back(tokens[i]);
      positions_.push_back(kv_offset + static_cast<int32_t>(i));
    }
    if (logits == Logits::kLast) logit_rows_.push_back(s.row0 + s.n_new - 1);
    if (logits == Logits::kAll) {
      for (int32_t r = s.row0; r < s.row0 + s.n_new; ++r) logit_rows_.push_back(r);
    }
    seqs_.push_back(s);
  }
  void clear() {
    tokens_.clear();
    positions_.clear();
    seqs_.clear();
    logit_rows_.clear();
  }

  int64_t n_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  bool empty() const { return tokens_.empty(); }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  const std::vector<int32_t>& logit_rows() const { return logit_rows_; }
  const std::vector<SeqView>& seqs() const { return seqs_; }
  BatchView view() const { return {n_tokens(), tokens_.data(), positions_.data(), seqs_}; }

 private:
  std::vector<int32_t> tokens_;
  std::vector<int32_t> positions_;
  std::vector<SeqView> seqs_;
  std::vector<int32_t> logit_rows_;
};

}  // namespace baton
