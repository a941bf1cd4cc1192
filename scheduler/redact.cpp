#include "scheduler/redact.h"

#include <cctype>
#include <regex>

namespace baton {
namespace {

// Whether the `len` bytes at `pos` of `text` stand alone: no address or name character either
// side (so "d:1" is not found inside "d:10").
bool bounded_at(const std::string& text, size_t pos, size_t len) {
  auto part_of_address = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-'; };
  const bool left = pos == 0 || !part_of_address(text[pos - 1]);
  const bool right = pos + len >= text.size() || !std::isalnum(static_cast<unsigned char>(text[pos + len]));
  return left && right;
}

void replace_all(std::string& text, const std::string& from, const std::string& to) {
  if (from.empty()) return;
  for (size_t pos = text.find(from); pos != std::string::npos; pos = text.find(from, pos)) {
    if (!bounded_at(text, pos, from.size())) {
      pos += from.size();
      continue;
    }
    text.replace(pos, from.size(), to);
    pos += to.size();
  }
}

// IP literals as gRPC and the workers write them: 10.0.0.7:50051, ipv4:10.0.0.7, ipv6:[::1]:41234,
// ipv6:%5B::1%5D:41234.
const std::regex& ip_literal() {
  static const std::regex re(
      R"((ipv4:)?\b\d{1,3}(\.\d{1,3}){3}(:\d{1,5})?|(ipv6:)?(\[[0-9A-Fa-f:.%]*\]|%5B[0-9A-Fa-f:.%]*?%5D)(:\d{1,5})?)");
  return re;
}

}  // namespace

std::string redact_for_client(std::string text, const std::string& label, std::span<const std::string> attempt_ids,
                              std::span<const std::string> addresses) {
  const std::string name = label.empty() ? "(this request)" : label;
  for (const std::string& id : attempt_ids) replace_all(text, id, name);
  for (const std::string& address : addresses) replace_all(text, address, "<address>");
  return std::regex_replace(text, ip_literal(), "<address>");
}

}  // namespace baton
