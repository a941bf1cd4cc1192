// An event-driven front for a cpp-httplib server: one thread accepts connections, does their TLS
// handshakes and reads their request heads without blocking; only a connection whose request head
// is complete gets a thread of the pool, which has cpp-httplib route and answer that one request
// (its body, its response, a stream included). A kept-alive connection then goes back to the
// event thread for its next head. So idle, slow-header or slow-handshake connections hold a few
// hundred bytes each, never a thread: thousands of them cannot starve real requests. (cpp-httplib
// alone serves a connection on one thread for its whole life: the pool's size was then the number
// of connections, idle ones included.)
//
// Deadlines: a connection's first head must be complete within head_timeout of its accept (the
// TLS handshake included), the next ones within idle_timeout of the previous response; a head over
// max_head_bytes is refused (431) and the connection closed. Once a thread serves it, a read or
// write that makes no progress for io_timeout fails (cpp-httplib's read and write timeouts).
#pragma once

#include <openssl/ssl.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/status.h"

namespace httplib {
class Server;
class ThreadPool;
}  // namespace httplib

namespace baton {

// The socket of the connection the calling thread serves for an HttpFront (for the whole of one
// request: its routing, body and response), -1 on any other thread.
int http_front_socket();

// "host:port", "[v6]:port" → (host, port); INVALID_ARGUMENT naming `flag` otherwise.
Result<std::pair<std::string, int>> split_listen_address(const std::string& address, const std::string& flag);

struct HttpFrontConfig {
  std::string host;  // to bind ("0.0.0.0", "::", "127.0.0.1", a name)
  int port = 0;      // 0: any free port
  SSL_CTX* tls = nullptr;  // set: HTTPS with this context (owned by the caller, outliving the front)
  int n_threads = 64;      // requests served at once
  std::chrono::milliseconds head_timeout{10000};
  std::chrono::milliseconds idle_timeout{5000};
  std::chrono::milliseconds io_timeout{30000};
  size_t max_head_bytes = 64 << 10;
  int listen_backlog = 1024;
};

class HttpFront {
 public:
  // Binds and starts serving `server`'s routes (its own listen functions are never called; it
  // must outlive the front). UNAVAILABLE when the address cannot be bound.
  static Result<std::unique_ptr<HttpFront>> start(const HttpFrontConfig& config, httplib::Server& server);
  ~HttpFront();  // stop()s
  HttpFront(const HttpFront&) = delete;
  HttpFront& operator=(const HttpFront&) = delete;

  int port() const { return port_; }
  // Connections open now (waiting for a head, or being served).
  int n_connections() const { return n_connections_.load(); }
  // Stops accepting, closes the connections waiting for a head, and waits for the requests being
  // served (their handlers must end: the caller makes them, e.g. by failing its streams). Idempotent.
  void stop();

  struct Conn;  // (http_front.cpp)

 private:
  HttpFront(const HttpFrontConfig& config, httplib::Server& server);
  void loop();
  void serve(Conn* c);      // on a pool thread
  void give_back(Conn* c);  // from a pool thread: the connection waits for its next head
  void close(Conn* c);

  const HttpFrontConfig config_;
  httplib::Server& server_;
  int listen_fd_ = -1, epoll_fd_ = -1, wake_fd_ = -1;
  int port_ = 0;
  std::unique_ptr<httplib::ThreadPool> pool_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<int> n_connections_{0};
  std::mutex mu_;
  std::vector<Conn*> returned_;  // guarded by mu_: connections back from the pool
};

}  // namespace baton
