#include "kv/kv_channel_cache.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

namespace baton {

std::shared_ptr<grpc::Channel> KvChannelCache::get(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = channels_.find(address);
  if (it != channels_.end()) return it->second;
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  // A decode worker that restarts is reachable again within a couple of seconds (gRPC's default
  // reconnect backoff grows to two minutes, during which fail-fast calls are refused at once).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  auto channel = grpc::CreateCustomChannel(address, credentials_, args);
  channels_.emplace(address, channel);
  return channel;
}

void KvChannelCache::forget(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  channels_.erase(address);
}

}  // namespace baton
