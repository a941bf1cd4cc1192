// gRPC channels from a prefill worker to decode workers, one per address, shared by concurrent
// sends of every KV transport (tcp, and the device transports' control plane). Thread-safe.
#pragma once

#include <grpcpp/channel.h>
#include <grpcpp/security/credentials.h>

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

namespace baton {

class KvChannelCache {
 public:
  // `credentials`: the internal plane's (common/tls.h); null = plaintext.
  explicit KvChannelCache(std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr)
      : credentials_(credentials ? std::move(credentials) : grpc::InsecureChannelCredentials()) {}

  std::shared_ptr<grpc::Channel> get(const std::string& address);
  // Drops the channel to `address` (its decode worker left); sends still holding it keep it.
  void forget(const std::string& address);

 private:
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<grpc::Channel>> channels_;  // guarded by mu_
};

}  // namespace baton
