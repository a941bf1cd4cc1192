#include "server/metrics_server.h"

#include <httplib.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "server/http_front.h"

namespace baton {

Result<std::unique_ptr<MetricsServer>> MetricsServer::start(const std::string& listen,
                                                            std::shared_ptr<prometheus::Registry> registry) {
  BATON_ASSIGN_OR_RETURN(const auto where, split_listen_address(listen, "--metrics-listen"));
  auto m = std::unique_ptr<MetricsServer>(new MetricsServer());
  m->registry_ = std::move(registry);
  m->routes_ = std::make_unique<httplib::Server>();
  m->routes_->Get("/metrics", [reg = m->registry_.get()](const httplib::Request&, httplib::Response& res) {
    res.set_content(prometheus::TextSerializer().Serialize(reg->Collect()), "text/plain; version=0.0.4");
  });
  HttpFrontConfig config;
  config.host = where.first;
  config.port = where.second;
  config.n_threads = 4;  // a scrape takes milliseconds; waiting ones queue for a thread
  config.head_timeout = std::chrono::seconds(5);
  config.idle_timeout = std::chrono::seconds(5);
  config.io_timeout = std::chrono::seconds(10);
  auto front = HttpFront::start(config, *m->routes_);
  if (!front.ok()) return unavailable("cannot serve metrics on '" + listen + "': " + front.status().message());
  m->front_ = std::move(*front);
  return m;
}

MetricsServer::~MetricsServer() {
  if (front_) front_->stop();
}

int MetricsServer::port() const { return front_->port(); }

}  // namespace baton
