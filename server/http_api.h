// The frontend's OpenAI-compatible HTTP API (--http-listen), served by cpp-httplib:
//
//   POST /v1/completions, POST /v1/chat/completions   server/http_call.h (streaming with SSE)
//   GET  /v1/models, GET /v1/models/{id}              the served model
//   GET  /health                                      200 while the frontend can serve, else 503
//
// A thin adapter: requests go through the same admission, validation, pipeline, metrics and API
// keys as gRPC Generate (server/public_call.h). Errors are OpenAI's JSON error objects with the
// HTTP status of their cause (server/openai_json.h), unknown routes and malformed HTTP included.
//
// Threads: server/http_front.h accepts connections and reads request heads on one event thread;
// a request whose head is complete runs on a thread of a fixed pool (--http-threads: requests
// served at once, a streamed response holding its thread for its life), cpp-httplib routing it.
// Idle or slow connections hold no thread: a first head must arrive within kHeadTimeout, the next
// on a kept connection within kIdleTimeout, and a read or write that makes no progress fails after
// kIoTimeout. The API key is checked before a body is read; bodies are bounded (max_body_bytes,
// 413 above) before they are parsed.
#pragma once

#include <openssl/ssl.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "common/status.h"
#include "common/tls.h"

namespace httplib {
class Server;
}

namespace baton {

class Frontend;
class HttpFront;
class TlsIdentity;

inline constexpr std::chrono::seconds kHeadTimeout{10};
inline constexpr std::chrono::seconds kIdleTimeout{5};
inline constexpr std::chrono::seconds kIoTimeout{30};

struct HttpApiConfig {
  std::string listen;           // host:port (port 0: any free port)
  int n_threads = 512;          // requests served at once (a stream holds one for its life)
  size_t max_body_bytes = 4 << 20;  // larger request bodies get 413
  TlsFiles tls;                 // cert + key: HTTPS; ca too: clients must present a certificate it signed
  std::chrono::seconds tls_refresh{60};  // how often the certificate files are looked at again
};

class HttpApi {
 public:
  // Listens and serves `frontend` (which must outlive the HttpApi) on a thread of its own.
  // UNAVAILABLE when the address cannot be bound, INVALID_ARGUMENT for a bad one or bad TLS files.
  static Result<std::unique_ptr<HttpApi>> start(const HttpApiConfig& config, Frontend& frontend);
  ~HttpApi();
  HttpApi(const HttpApi&) = delete;
  HttpApi& operator=(const HttpApi&) = delete;

  int port() const { return port_; }
  // Ends the requests in flight (UNAVAILABLE: the drain timeout passed), stops listening and joins
  // the threads. Idempotent.
  void stop();

 private:
  HttpApi() = default;

  struct SslCtxFree {
    void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
  };
  std::shared_ptr<TlsIdentity> tls_;  // HTTPS: outlives tls_ctx_, whose handshakes use it
  std::unique_ptr<SSL_CTX, SslCtxFree> tls_ctx_;
  std::unique_ptr<httplib::Server> server_;  // routes (outlives front_)
  std::unique_ptr<HttpFront> front_;         // connections and threads
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> live_{0};  // completion requests alive
};

}  // namespace baton
