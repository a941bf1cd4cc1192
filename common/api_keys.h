// Public API keys (--api-key-file): a client proves it may use the frontend by sending
// `authorization: Bearer <key>` (gRPC metadata, or the HTTP header OpenAI clients send). The file
// holds one key per line (blank lines and lines starting with '#' are skipped), optionally followed by
// options, separated by spaces: `max-priority=N`, the highest request priority that key may ask
// for (a privileged caller; keys without it get the frontend's --max-priority), and `admin`, which
// lets the key call the Admin service (admin.proto: the deployment's workers, for batonctl
// doctor). The file is read again when it changes, so keys rotate without a restart. Keys are
// compared in constant time.
#pragma once

#include <grpcpp/server_context.h>

#include <chrono>
#include <ctime>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace baton {

struct ApiKey {
  std::string secret;
  // Who the key's caller is, for what requests may share (the prefix cache, structured output's
  // automata: SamplingParams::cache_scope): 32 hex digits of SHA-256 over the secret, which itself
  // never leaves the frontend.
  std::string tenant;
  std::optional<int32_t> max_priority;  // nullopt: the frontend's --max-priority
  bool admin = false;                   // may call the Admin service
};

class ApiKeys {
 public:
  // NOT_FOUND when the file cannot be read, INVALID_ARGUMENT when it holds no key or a key
  // shorter than kMinKeyLength.
  static Result<std::unique_ptr<ApiKeys>> load(const std::string& path);
  static constexpr size_t kMinKeyLength = 16;

  // OK when the call carries one of the keys (and `*max_priority` = that key's bound, when it
  // has one; `*admin` = whether it is marked admin; `*tenant` = its ApiKey::tenant);
  // UNAUTHENTICATED with what to send otherwise.
  Status check(const grpc::ServerContextBase& context, std::optional<int32_t>* max_priority = nullptr,
               bool* admin = nullptr, std::string* tenant = nullptr);
  // The same for an `authorization` header value ("Bearer <key>"; "" = absent).
  Status check_authorization(std::string_view authorization, std::optional<int32_t>* max_priority = nullptr,
                             bool* admin = nullptr, std::string* tenant = nullptr);

 private:
  explicit ApiKeys(std::string path) : path_(std::move(path)) {}
  // Reads the file again when its modification time or size changed (looked at most once a
  // second); a file that became unreadable or empty keeps the keys in use, with a warning.
  void refresh();

  const std::string path_;
  std::mutex mu_;
  std::vector<ApiKey> keys_;       // guarded by mu_
  struct timespec mtime_ {};       // guarded by mu_
  off_t size_ = -1;                // guarded by mu_
  std::chrono::steady_clock::time_point checked_{};  // guarded by mu_
};

// Parses a key file's text: its keys, or INVALID_ARGUMENT naming `path` and the line.
Result<std::vector<ApiKey>> parse_api_keys(const std::string& text, const std::string& path);

// a == b without an early exit: the time taken depends on a's length only (a is the presented
// token, b the secret).
bool constant_time_equal(std::string_view a, std::string_view b);

}  // namespace baton
