// The JSON helpers the OpenAI API's request and response files share (not a public interface).
#pragma once

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <limits>
#include <string>

#include "common/status.h"

namespace baton::openai_internal {

// ordered_json: objects keep their members in the order they came (a response_format schema's
// properties are generated in that order) and are written in the order they were built.
using Json = nlohmann::ordered_json;

// Output is always valid UTF-8 (the text stream guarantees it); `replace` keeps a bug from
// becoming an exception.
inline std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

inline const char* type_name(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "an integer";
    case Json::value_t::number_float: return "a number";
    case Json::value_t::string: return "a string";
    case Json::value_t::array: return "an array";
    case Json::value_t::object: return "an object";
    default: return "something else";
  }
}

inline Status wrong_type(const std::string& field, const char* want, const Json& got) {
  return invalid_argument(field + " must be " + want + ", got " + type_name(got));
}

// A member of the request object; null when absent or null (OpenAI treats null as unset).
inline const Json* member(const Json& object, const char* name) {
  const auto it = object.find(name);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

inline Result<std::string> as_string(const Json& v, const std::string& field) {
  if (!v.is_string()) return wrong_type(field, "a string", v);
  return v.get<std::string>();
}

inline Result<bool> as_bool(const Json& v, const std::string& field) {
  if (!v.is_boolean()) return wrong_type(field, "a boolean", v);
  return v.get<bool>();
}

inline Result<double> as_number(const Json& v, const std::string& field) {
  if (!v.is_number()) return wrong_type(field, "a number", v);
  return v.get<double>();
}

// An integer that fits int32 (the GenerateRequest fields are int32).
inline Result<int32_t> as_int32(const Json& v, const std::string& field) {
  if (!v.is_number_integer()) return wrong_type(field, "an integer", v);
  constexpr auto lo = std::numeric_limits<int32_t>::min(), hi = std::numeric_limits<int32_t>::max();
  if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(hi)
                             : (v.get<int64_t>() < lo || v.get<int64_t>() > hi)) {
    return invalid_argument(field + " = " + v.dump() + " is out of range");
  }
  return static_cast<int32_t>(v.get<int64_t>());
}

// nlohmann's message without the input it quotes ("; last read: '…'" can hold megabytes).
inline std::string json_error_reason(const std::string& what) {
  std::string reason = what;
  if (const size_t at = reason.find("] "); at != std::string::npos) reason.erase(0, at + 2);
  if (const size_t at = reason.find("; last read"); at != std::string::npos) reason.erase(at);
  if (reason.size() > 160) reason = reason.substr(0, 160) + "...";
  for (char& c : reason) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7F) c = '?';
  }
  return reason;
}

// The request field a message starts with, when it is one.
inline std::string param_of(const std::string& message) {
  static const char* const kFields[] = {
      "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
      "seed", "stop", "stream", "stream_options", "n", "best_of", "echo", "logprobs", "top_logprobs", "suffix",
      "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "tools", "tool_choice", "parallel_tool_calls",
      "functions", "response_format", "priority",
      "ignore_eos", "ttft_slo_seconds", "cache_salt"};
  size_t n = 0;
  while (n < message.size() && (std::islower(static_cast<unsigned char>(message[n])) || message[n] == '_')) ++n;
  const std::string word = message.substr(0, n);
  for (const char* f : kFields) {
    if (word == f) return word;
  }
  return {};
}


}  // namespace baton::openai_internal
