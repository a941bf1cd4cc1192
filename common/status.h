// Recoverable errors: a Status (code + message a user can act on) and Result<T> (a value or a
// Status). Codes mirror the gRPC ones the serving layer maps them to.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "common/check.h"

namespace baton {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,   // the caller's input is wrong (bad flag, bad prompt, lying file)
  kNotFound,          // a named thing (file, tensor, metadata key) is missing
  kUnimplemented,     // valid input baton does not support (architecture, quant type)
  kResourceExhausted, // over a size or capacity bound
  kDataLoss,          // a file is truncated or corrupt
  kInternal,
  kCancelled,           // the caller gave up (client cancellation)
  kDeadlineExceeded,    // the request's deadline passed
  kUnavailable,         // no healthy worker / a peer is down: retry later
  kFailedPrecondition,  // the system is not in a state to do this (model mismatch, not admitted)
  kPermissionDenied,    // the caller may not ask for this (a priority above what it may raise to)
  kUnauthenticated,     // the caller did not prove who it is (no or a wrong API key)
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status ok_status() { return {}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // When a refused request may be retried, in seconds (0: not said): HTTP's Retry-After, gRPC's
  // retry-after trailer. Kept by with_message.
  int32_t retry_after_seconds() const { return retry_after_seconds_; }
  Status& set_retry_after_seconds(int32_t seconds) {
    retry_after_seconds_ = seconds;
    return *this;
  }
  // The same status with another message (context added, or redacted for a client).
  Status with_message(std::string message) const {
    Status s = *this;
    s.message_ = std::move(message);
    return s;
  }
  // "INVALID_ARGUMENT: message" for logs and CLI errors.
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  int32_t retry_after_seconds_ = 0;
};

inline Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status data_loss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status resource_exhausted(std::string m) { return {StatusCode::kResourceExhausted, std::move(m)}; }
inline Status cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
inline Status deadline_exceeded(std::string m) { return {StatusCode::kDeadlineExceeded, std::move(m)}; }
inline Status unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status failed_precondition(std::string m) { return {StatusCode::kFailedPrecondition, std::move(m)}; }
inline Status permission_denied(std::string m) { return {StatusCode::kPermissionDenied, std::move(m)}; }
inline Status unauthenticated(std::string m) { return {StatusCode::kUnauthenticated, std::move(m)}; }
inline Status internal_error(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

// A client's (or a peer's) string as an error message quotes it: bytes outside printable ASCII as \xNN, at
// most kMaxEchoBytes characters of that between the quotes (so 16 bytes of a string that is all
// escapes), and the length when cut. (Echoed whole, a 5 MB model name made a 5 MB message and
// log line, and past 16 KB of metadata the client saw RESOURCE_EXHAUSTED instead.)
inline constexpr size_t kMaxEchoBytes = 64;
std::string quote_input(std::string_view s);

// The longest id, name or address a worker takes from a peer (request ids, model fingerprints,
// fork and sender names): the refusals quote them, and a status travels in 16 KiB of metadata.
inline constexpr size_t kMaxPeerStringBytes = 1024;
// INVALID_ARGUMENT "`field` is N bytes; at most `max`" when `s` is longer.
Status check_length(std::string_view s, std::string_view field, size_t max = kMaxPeerStringBytes);

// A value of type T or a non-ok Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    BATON_CHECK(!std::get<Status>(v_).ok(), "Result built from an ok Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & {
    BATON_CHECK(ok(), "value() of an error Result: %s", std::get<Status>(v_).to_string().c_str());
    return std::get<T>(v_);
  }
  const T& value() const& {
    BATON_CHECK(ok(), "value() of an error Result: %s", std::get<Status>(v_).to_string().c_str());
    return std::get<T>(v_);
  }
  T&& value() && {
    BATON_CHECK(ok(), "value() of an error Result: %s", std::get<Status>(v_).to_string().c_str());
    return std::get<T>(std::move(v_));
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace baton

#define BATON_CONCAT_INNER(a, b) a##b
#define BATON_CONCAT(a, b) BATON_CONCAT_INNER(a, b)

// Returns the Status from the enclosing function when `expr` (a Status) is not ok.
#define BATON_RETURN_IF_ERROR(expr)              \
  do {                                           \
    ::baton::Status baton_status_ = (expr);      \
    if (!baton_status_.ok()) return baton_status_; \
  } while (0)

// `BATON_ASSIGN_OR_RETURN(auto x, f())`: x = the value of f(), or return its Status.
#define BATON_ASSIGN_OR_RETURN(lhs, expr) \
  BATON_ASSIGN_OR_RETURN_IMPL(BATON_CONCAT(baton_result_, __LINE__), lhs, expr)
#define BATON_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()
