#include "model/stop_rule.h"

#include <algorithm>

namespace baton {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kNone: break;
  }
  return "";
}

bool StopRule::is_stop(int32_t id) const {
  return !ignore_eos && std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end();
}

FinishReason StopRule::after(int32_t id, int64_t n_generated) const {
  if (is_stop(id)) return FinishReason::kStop;  // checked first: a stop id at max_tokens is "stop"
  if (n_generated >= max_tokens) return FinishReason::kLength;
  return FinishReason::kNone;
}

StopRule::Taken StopRule::take(std::span<const int32_t> ids, int64_t n_before) const {
  const int64_t room = std::max<int64_t>(0, max_tokens - n_before);
  const size_t n_room = std::min(ids.size(), static_cast<size_t>(room));
  for (size_t i = 0; i < n_room; ++i) {
    if (is_stop(ids[i])) return {i + 1, FinishReason::kStop};
  }
  const bool full = n_before + static_cast<int64_t>(n_room) >= max_tokens;
  return {n_room, full ? FinishReason::kLength : FinishReason::kNone};
}

}  // namespace baton
