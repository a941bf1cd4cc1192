#include "server/http_api.h"

#include <httplib.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <csignal>
#include <cstdlib>
#include <ctime>

#include "server/frontend.h"
#include "server/http_call.h"
#include "server/http_front.h"
#include "server/http_tls.h"
#include "server/openai_json.h"

namespace baton {
namespace {

// A chunked request body past the limit is read on (and dropped) up to this many times the
// limit, so the client can read the 413; beyond that the connection is closed.
constexpr size_t kDiscardFactor = 16;

// The socket of the connection `req` came on, -1 when it cannot be told: the front serving this
// thread's connection knows it (cpp-httplib 0.11's Request does not say; later versions have
// Request::is_connection_closed).
int connection_socket(const httplib::Request& req) {
  if (req.ssl != nullptr) return SSL_get_fd(req.ssl);
  return http_front_socket();
}

// Polled by the call while the serving thread holds the connection (so `fd` is still it): true
// once the client hung up or reset.
std::function<bool()> client_gone(const httplib::Request& req) {
  const int fd = connection_socket(req);
  if (fd < 0) return {};  // failed writes still tell
  return [fd] {
    pollfd p{fd, POLLRDHUP, 0};
    return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
  };
}

Status body_too_large(size_t limit) {
  return resource_exhausted("the request body is larger than " + std::to_string(limit) +
                            " bytes (the frontend's --max-message-bytes)");
}

// The request body, at most `limit` bytes. `*http_status` says how a failure is answered (413:
// too large). A Content-Length past the limit is refused by cpp-httplib, which drains the body;
// a chunked body is counted here.
Result<std::string> read_body(const httplib::ContentReader& reader, httplib::Response& res, size_t limit,
                              int* http_status) {
  std::string body;
  size_t n_read = 0;
  const bool ok = reader([&](const char* data, size_t n) {
    n_read += n;
    if (n_read <= limit) body.append(data, n);
    return n_read <= limit * kDiscardFactor;
  });
  if (res.status == 413 || n_read > limit) {
    if (n_read > limit * kDiscardFactor) res.set_header("Connection", "close");  // the rest is still unread
    *http_status = 413;
    return body_too_large(limit);
  }
  if (!ok) {
    *http_status = 400;
    return invalid_argument("the request body could not be read (a broken transfer encoding, or the client stopped "
                            "sending)");
  }
  return body;
}

// Errors cpp-httplib decides itself (no route, a malformed request line, ...), as OpenAI's.
Status routing_error(const httplib::Request& req, int http_status) {
  switch (http_status) {
    case 404:
      return not_found("no route " + quote_input(req.method + " " + req.path) +
                       ": this server has POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET "
                       "/health");
    case 413: return resource_exhausted("the request is too large");
    case 414: return invalid_argument("the request URI is too long");
    default: return invalid_argument("malformed HTTP request (status " + std::to_string(http_status) + ")");
  }
}

Status check_key(FrontendContext& fc, const httplib::Request& req) {
  return fc.api_keys == nullptr ? Status{} : fc.api_keys->check_authorization(req.get_header_value("Authorization"));
}

}  // namespace

Result<std::unique_ptr<HttpApi>> HttpApi::start(const HttpApiConfig& config, Frontend& frontend) {
  BATON_ASSIGN_OR_RETURN(const auto where, split_listen_address(config.listen, "--http-listen"));
  auto api = std::unique_ptr<HttpApi>(new HttpApi());
  if (!config.tls.cert.empty()) {
    BATON_ASSIGN_OR_RETURN(api->tls_, TlsIdentity::load(config.tls, config.tls_refresh));
    api->tls_ctx_.reset(SSL_CTX_new(TLS_server_method()));
    if (!api->tls_ctx_ || !api->tls_->configure(*api->tls_ctx_)) {
      return invalid_argument("--tls-cert / --tls-key / --tls-client-ca: the HTTP API cannot use them");
    }
  }
  // Writes to a connection the client closed must fail (EPIPE), not end the process (cpp-httplib's
  // own writes send without MSG_NOSIGNAL).
  std::signal(SIGPIPE, SIG_IGN);

  // cpp-httplib routes and answers each request; server/http_front.h reads the heads and runs
  // the requests on its threads.
  api->server_ = std::make_unique<httplib::Server>();
  httplib::Server& s = *api->server_;
  s.set_payload_max_length(config.max_body_bytes);

  FrontendContext& fc = frontend.context();
  const int64_t created = std::time(nullptr);
  HttpApi* self = api.get();
  const size_t limit = config.max_body_bytes;
  auto completion = [self, &fc, limit](OpenAiEndpoint endpoint) {
    return httplib::Server::HandlerWithContentReader(
        [self, &fc, limit, endpoint](const httplib::Request& req, httplib::Response& res,
                                     const httplib::ContentReader& reader) {
          // The key before the body: a caller without one gets its 401 after the headers, and
          // not a byte of its body is read or held (the connection closes on the rest).
          if (Status st = check_key(fc, req); !st.ok()) {
            if (fc.metrics) fc.metrics->requests_total.Add({{"code", status_code_name(st.code())}}).Increment();
            set_error_response(res, st);
            res.set_header("Connection", "close");
            return;
          }
          int http_status = 0;
          auto body = read_body(reader, res, limit, &http_status);
          if (!body.ok()) {
            set_error_response(res, body.status(), http_status);
            return;
          }
          HttpCallEnv env;
          env.client_gone = client_gone(req);
          env.stopping = &self->stopping_;
          env.live = &self->live_;
          serve_completion(fc, endpoint, req, *body, res, std::move(env));
        });
  };
  s.Post("/v1/completions", completion(OpenAiEndpoint::kCompletions));
  s.Post("/v1/chat/completions", completion(OpenAiEndpoint::kChat));
  s.Get("/v1/models", [&fc, created](const httplib::Request& req, httplib::Response& res) {
    if (Status st = check_key(fc, req); !st.ok()) return set_error_response(res, st);
    res.set_content(models_body(*fc.model, created), "application/json");
  });
  s.Get(R"(/v1/models/(.+))", [&fc, created](const httplib::Request& req, httplib::Response& res) {
    if (Status st = check_key(fc, req); !st.ok()) return set_error_response(res, st);
    const std::string id = req.matches[1];
    if (id != fc.model->name) {
      return set_error_response(res, not_found("model " + quote_input(id) + " does not exist: this server serves '" +
                                               fc.model->name + "'"));
    }
    res.set_content(model_body(*fc.model, created), "application/json");
  });
  // No key: probes have none (the same as grpc.health.v1).
  s.Get("/health", [&frontend](const httplib::Request&, httplib::Response& res) {
    if (Status st = frontend.health(); !st.ok()) return set_error_response(res, st);
    res.set_content(R"({"status":"ok"})", "application/json");
  });
  // cpp-httplib 0.11 reads no body for GET, HEAD or OPTIONS: one sent anyway would be read as the
  // connection's next request (behind a proxy, another client's). Refused, and the client told to
  // close the connection.
  s.set_pre_routing_handler([](const httplib::Request& req, httplib::Response& res) {
    const bool reads_body = req.method != "GET" && req.method != "HEAD" && req.method != "OPTIONS";
    const bool has_body = req.has_header("Transfer-Encoding") ||
                          (req.has_header("Content-Length") && req.get_header_value("Content-Length") != "0");
    if (reads_body || !has_body) return httplib::Server::HandlerResponse::Unhandled;
    set_error_response(res, invalid_argument("a " + req.method + " request carries no body; send fields with POST"));
    res.set_header("Connection", "close");
    return httplib::Server::HandlerResponse::Handled;
  });
  s.set_error_handler(httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;  // the handlers' own errors
    set_error_response(res, routing_error(req, res.status), res.status);
    return httplib::Server::HandlerResponse::Handled;
  }));
  s.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    spdlog::error("HTTP handler failed: {}", what);
    set_error_response(res, internal_error("the request failed inside the frontend"));
  });

  const auto& [host, port] = where;
  HttpFrontConfig fc_config;
  fc_config.host = host;
  fc_config.port = port;
  fc_config.tls = api->tls_ctx_.get();
  fc_config.n_threads = config.n_threads;
  fc_config.head_timeout = kHeadTimeout;
  fc_config.idle_timeout = kIdleTimeout;
  fc_config.io_timeout = kIoTimeout;
  auto front = HttpFront::start(fc_config, s);
  if (!front.ok()) {
    return unavailable("--http-listen: cannot listen on '" + config.listen + "' (in use, or a bad address)");
  }
  api->front_ = std::move(*front);
  api->port_ = api->front_->port();
  return api;
}

HttpApi::~HttpApi() { stop(); }

void HttpApi::stop() {
  if (!front_ || stopping_.exchange(true)) return;
  // Requests in flight see `stopping_` within a poll interval and end UNAVAILABLE (a stream with
  // its error event); then the accept loop ends and the pool's threads are joined.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (live_.load() > 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  front_->stop();
}

}  // namespace baton
