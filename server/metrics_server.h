// Serves a Prometheus registry on GET /metrics (text format 0.0.4), behind server/http_front.h:
// idle or slow scrapers hold no thread, so a few hundred of them cannot blind monitoring (its
// civetweb predecessor held a thread per connection).
#pragma once

#include <memory>
#include <string>

#include "common/status.h"

namespace httplib {
class Server;
}
namespace prometheus {
class Registry;
}

namespace baton {

class HttpFront;

class MetricsServer {
 public:
  // INVALID_ARGUMENT for an address that is not host:port, UNAVAILABLE when it cannot be bound.
  static Result<std::unique_ptr<MetricsServer>> start(const std::string& listen,
                                                      std::shared_ptr<prometheus::Registry> registry);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  int port() const;  // the bound port (useful with port 0)

 private:
  MetricsServer() = default;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<httplib::Server> routes_;  // outlives front_
  std::unique_ptr<HttpFront> front_;
};

}  // namespace baton
