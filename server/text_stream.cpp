#include "server/text_stream.h"

#include <algorithm>

namespace baton {

TextStream::TextStream(const Tokenizer& tokenizer, std::vector<std::string> stop)
    : tokenizer_(tokenizer), decoder_(tokenizer), stop_(std::move(stop)) {
  stop_.erase(std::remove(stop_.begin(), stop_.end(), std::string()), stop_.end());
}

std::string TextStream::push(int32_t id) {
  if (stopped_) return {};
  if (!tokenizer_.is_control(id)) pending_ += decoder_.push(id);
  // The earliest stop string occurrence ends the text there.
  size_t cut = std::string::npos;
  for (const std::string& s : stop_) cut = std::min(cut, pending_.find(s));
  if (cut != std::string::npos) {
    std::string out = pending_.substr(0, cut);
    pending_.clear();
    stopped_ = true;
    return out;
  }
  const size_t keep = held_suffix();
  std::string out = pending_.substr(0, pending_.size() - keep);
  pending_.erase(0, pending_.size() - keep);
  return out;
}

std::string TextStream::finish() {
  if (stopped_) return {};
  std::string out = pending_ + decoder_.flush();
  pending_.clear();
  return out;
}

size_t TextStream::held_suffix() const {
  size_t best = 0;
  for (const std::string& s : stop_) {
    for (size_t len = std::min(s.size() - 1, pending_.size()); len > best; --len) {
      if (pending_.compare(pending_.size() - len, len, s, 0, len) == 0) {
        best = len;
        break;
      }
    }
  }
  return best;
}

}  // namespace baton
