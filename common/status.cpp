#include "common/status.h"

namespace baton {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kNotFound: return "NOT_FOUND";
    case StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kDataLoss: return "DATA_LOSS";
    case StatusCode::kInternal: return "INTERNAL";
    case StatusCode::kCancelled: return "CANCELLED";
    case StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case StatusCode::kUnauthenticated: return "UNAUTHENTICATED";
  }
  return "UNKNOWN";
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  return std::string(status_code_name(code_)) + ": " + message_;
}

std::string quote_input(std::string_view s) {
  static const char* hex = "0123456789abcdef";
  std::string body;
  size_t i = 0;
  for (; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const bool plain = c >= 0x20 && c < 0x7F && c != '\\' && c != '\'';
    if (body.size() + (plain ? 1 : 4) > kMaxEchoBytes) break;
    if (plain) {
      body += static_cast<char>(c);
    } else {
      body += "\\x";
      body += hex[c >> 4];
      body += hex[c & 15];
    }
  }
  std::string out = "'" + body + "'";
  if (i < s.size()) out += " (cut, " + std::to_string(s.size()) + " bytes)";
  return out;
}

Status check_length(std::string_view s, std::string_view field, size_t max) {
  if (s.size() <= max) return {};
  return invalid_argument(std::string(field) + " is " + std::to_string(s.size()) + " bytes; at most " +
                          std::to_string(max));
}

}  // namespace baton
