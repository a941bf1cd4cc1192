// Token ids → the text a client sees: incremental UTF-8-safe detokenisation plus stop strings.
// Text that might be the start of a stop string is held back until it is known not to be, so the
// stop text itself never reaches the client.
#pragma once

#include <string>
#include <vector>

#include "model/tokenizer.h"

namespace baton {

class TextStream {
 public:
  TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop);

  // Feeds one generated token; returns the text that can be sent now. Control tokens (EOS,
  // end-of-turn) add no text. After a stop string matched, stopped() is true and further
  // tokens add nothing.
  std::string push(int32_t id);
  // The held-back rest at the end of generation (nothing after a stop match).
  std::string finish();
  bool stopped() const { return stopped_; }

 private:
  // Length of the longest suffix of pending_ that is a proper prefix of some stop string.
  size_t held_suffix() const;

  const Tokenizer& tokenizer_;
  StreamDecoder decoder_;
  std::vector<std::string> stop_;
  std::string pending_;  // decoded text not yet released
  bool stopped_ = false;
};

}  // namespace baton
