#include "common/api_keys.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <openssl/sha.h>

#include <charconv>
#include <fstream>
#include <sstream>

namespace baton {
namespace {

// ApiKey::tenant: 32 hex digits of SHA-256 over the secret.
std::string tenant_of(const std::string& secret) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(secret.data()), secret.size(), digest);
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (int i = 0; i < 16; ++i) {
    out += hex[digest[i] >> 4];
    out += hex[digest[i] & 15];
  }
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

// The whole of `s` as an int (no sign but '-', no spaces).
bool parse_int(std::string_view s, int* value) {
  return !s.empty() && std::from_chars(s.data(), s.data() + s.size(), *value).ptr == s.data() + s.size();
}

bool same_time(const struct timespec& a, const struct timespec& b) {
  return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec;
}

}  // namespace

bool constant_time_equal(std::string_view a, std::string_view b) {
  if (b.empty()) return false;
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i % b.size()]);
  }
  return diff == 0;
}

Result<std::vector<ApiKey>> parse_api_keys(const std::string& text, const std::string& path) {
  std::vector<ApiKey> keys;
  std::istringstream in(text);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    std::string_view rest = trim(line);
    if (rest.empty() || rest.front() == '#') continue;
    const auto where = [&] { return "line " + std::to_string(n) + " of '" + path + "'"; };
    const size_t space = rest.find_first_of(" \t");
    ApiKey key;
    key.secret = std::string(rest.substr(0, space));
    if (key.secret.size() < ApiKeys::kMinKeyLength) {
      return invalid_argument("--api-key-file: the key on " + where() + " has " + std::to_string(key.secret.size()) +
                              " characters; use at least " + std::to_string(ApiKeys::kMinKeyLength) +
                              " (e.g. openssl rand -hex 32)");
    }
    std::string_view options = space == std::string_view::npos ? std::string_view() : trim(rest.substr(space));
    while (!options.empty()) {
      const size_t end = options.find_first_of(" \t");
      const std::string_view option = options.substr(0, end);
      options = end == std::string_view::npos ? std::string_view() : trim(options.substr(end));
      constexpr std::string_view kPriority = "max-priority=";
      int value = 0;
      if (option == "admin" && !key.admin) {
        key.admin = true;
      } else if (option.rfind(kPriority, 0) == 0 && !key.max_priority &&
                 parse_int(option.substr(kPriority.size()), &value)) {
        key.max_priority = value;
      } else {
        return invalid_argument("--api-key-file: " + where() + " has '" + std::string(option) +
                                "' after the key; the options are max-priority=N and admin, each at most once");
      }
    }
    key.tenant = tenant_of(key.secret);
    keys.push_back(std::move(key));
  }
  if (keys.empty()) return invalid_argument("--api-key-file: '" + path + "' holds no key (one key per line)");
  return keys;
}

Result<std::unique_ptr<ApiKeys>> ApiKeys::load(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return not_found("--api-key-file: cannot read '" + path + "'");
  std::ifstream in(path);
  if (!in) return not_found("--api-key-file: cannot read '" + path + "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  BATON_ASSIGN_OR_RETURN(auto keys, parse_api_keys(ss.str(), path));
  auto k = std::unique_ptr<ApiKeys>(new ApiKeys(path));
  k->keys_ = std::move(keys);
  k->mtime_ = st.st_mtim;
  k->size_ = st.st_size;
  k->checked_ = std::chrono::steady_clock::now();
  return k;
}

void ApiKeys::refresh() {
  const auto now = std::chrono::steady_clock::now();
  if (now - checked_ < std::chrono::seconds(1)) return;
  checked_ = now;
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0) {
    spdlog::warn("--api-key-file: cannot read '{}'; keeping the {} keys in use", path_, keys_.size());
    return;
  }
  if (same_time(st.st_mtim, mtime_) && st.st_size == size_) return;
  std::ifstream in(path_);
  std::ostringstream ss;
  ss << in.rdbuf();
  auto keys = parse_api_keys(ss.str(), path_);
  if (!keys.ok()) {
    spdlog::warn("{}; keeping the {} keys in use", keys.status().message(), keys_.size());
    return;
  }
  keys_ = std::move(*keys);
  mtime_ = st.st_mtim;
  size_ = st.st_size;
  spdlog::info("--api-key-file: read {} keys from '{}'", keys_.size(), path_);
}

Status ApiKeys::check_authorization(std::string_view authorization, std::optional<int32_t>* max_priority,
                                    bool* admin, std::string* tenant) {
  constexpr std::string_view kHow =
      "send 'authorization: Bearer <key>' (gRPC metadata or an HTTP header) with a key from the frontend's --api-key-file";
  if (authorization.empty()) return unauthenticated("no API key: " + std::string(kHow));
  constexpr std::string_view kScheme = "bearer ";
  bool scheme = authorization.size() > kScheme.size();
  for (size_t i = 0; scheme && i < kScheme.size(); ++i) {
    scheme = (authorization[i] | 0x20) == kScheme[i];
  }
  if (!scheme) return unauthenticated("the authorization is not 'Bearer <key>': " + std::string(kHow));
  const std::string_view token = trim(authorization.substr(kScheme.size()));
  std::lock_guard<std::mutex> lock(mu_);
  refresh();
  // Every key is compared (no early exit); the match is picked without a branch on the bytes.
  const ApiKey* match = nullptr;
  for (const ApiKey& key : keys_) {
    const bool eq = constant_time_equal(token, key.secret);
    match = eq ? &key : match;
  }
  if (match == nullptr) return unauthenticated("the API key is not valid: " + std::string(kHow));
  if (max_priority != nullptr) *max_priority = match->max_priority;
  if (admin != nullptr) *admin = match->admin;
  if (tenant != nullptr) *tenant = match->tenant;
  return {};
}

Status ApiKeys::check(const grpc::ServerContextBase& context, std::optional<int32_t>* max_priority, bool* admin,
                      std::string* tenant) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return check_authorization("", max_priority, admin, tenant);
  return check_authorization(std::string_view(it->second.data(), it->second.size()), max_priority, admin, tenant);
}

}  // namespace baton
