#include "server/http_front.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <httplib.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <unordered_set>

#include "common/thread_name.h"

namespace baton {

using Clock = std::chrono::steady_clock;

struct HttpFront::Conn {
  int fd = -1;
  SSL* ssl = nullptr;
  bool handshaken = false;
  std::string buf;  // read, not yet consumed: the head being read, or what follows a request
  Clock::time_point deadline;
  std::string remote_ip, local_ip;
  int remote_port = 0, local_port = 0;
};

namespace {

// cpp-httplib answers one request read from a Stream with process_request, which is protected:
// named through a class derived from Server, it may be called on any Server.
struct Routes : httplib::Server {
  static bool serve(httplib::Server& s, httplib::Stream& strm, bool close_connection, bool& connection_closed,
                    const std::function<void(httplib::Request&)>& setup) {
    return (s.*(&Routes::process_request))(strm, close_connection, connection_closed, setup);
  }
  // cpp-httplib streams a chunked response only while its listening socket is set (an unset one
  // means "shutting down"): the front's stands in for it, and is unset again at stop.
  static void set_listening(httplib::Server& s, int fd) { (s.*(&Routes::svr_sock_)) = fd; }
};

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL, 0) | O_NONBLOCK); }

void endpoint(const sockaddr_storage& a, socklen_t len, std::string* ip, int* port) {
  char host[NI_MAXHOST] = {};
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&a), len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) == 0) {
    *ip = host;
  }
  if (a.ss_family == AF_INET) *port = ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
  if (a.ss_family == AF_INET6) *port = ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
}

int ms_until(Clock::time_point t) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 60000));
}

// Waits until `fd` is ready for `events` or `deadline`: false on timeout or error.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, ms_until(deadline));
    if (n > 0) return true;
    if (n == 0 || errno != EINTR) return false;
  }
}

// One request's I/O on a thread of the pool: first what the event thread read past the head's
// start (the head itself, perhaps more), then the socket (non-blocking, waited for with poll up to
// io_timeout of no progress).
class FrontStream final : public httplib::Stream {
 public:
  FrontStream(HttpFront::Conn& c, std::chrono::milliseconds io_timeout) : c_(c), timeout_(io_timeout) {}

  bool is_readable() const override {
    if (!c_.buf.empty() || (c_.ssl != nullptr && SSL_pending(c_.ssl) > 0)) return true;
    return wait_for(c_.fd, POLLIN, Clock::now() + timeout_);
  }
  bool is_writable() const override { return wait_for(c_.fd, POLLOUT, Clock::now() + timeout_); }

  ssize_t read(char* ptr, size_t size) override {
    if (!c_.buf.empty()) {
      const size_t n = std::min(size, c_.buf.size());
      std::memcpy(ptr, c_.buf.data(), n);
      c_.buf.erase(0, n);
      return static_cast<ssize_t>(n);
    }
    for (;;) {
      const auto deadline = Clock::now() + timeout_;
      if (c_.ssl != nullptr) {
        ERR_clear_error();
        const int n = SSL_read(c_.ssl, ptr, static_cast<int>(std::min<size_t>(size, INT32_MAX)));
        if (n > 0) return n;
        const int e = SSL_get_error(c_.ssl, n);
        if (e == SSL_ERROR_WANT_READ && wait_for(c_.fd, POLLIN, deadline)) continue;
        if (e == SSL_ERROR_WANT_WRITE && wait_for(c_.fd, POLLOUT, deadline)) continue;
        return e == SSL_ERROR_ZERO_RETURN ? 0 : -1;
      }
      const ssize_t n = ::recv(c_.fd, ptr, size, 0);
      if (n >= 0) return n;
      if (errno == EINTR) continue;
      if ((errno == EAGAIN || errno == EWOULDBLOCK) && wait_for(c_.fd, POLLIN, deadline)) continue;
      return -1;
    }
  }

  ssize_t write(const char* ptr, size_t size) override {
    size_t done = 0;
    while (done < size) {
      const auto deadline = Clock::now() + timeout_;
      if (c_.ssl != nullptr) {
        ERR_clear_error();
        const int n = SSL_write(c_.ssl, ptr + done, static_cast<int>(std::min<size_t>(size - done, INT32_MAX)));
        if (n > 0) {
          done += static_cast<size_t>(n);
          continue;
        }
        const int e = SSL_get_error(c_.ssl, n);
        if (e == SSL_ERROR_WANT_WRITE && wait_for(c_.fd, POLLOUT, deadline)) continue;
        if (e == SSL_ERROR_WANT_READ && wait_for(c_.fd, POLLIN, deadline)) continue;
        return -1;
      }
      const ssize_t n = ::send(c_.fd, ptr + done, size - done, MSG_NOSIGNAL);
      if (n >= 0) {
        done += static_cast<size_t>(n);
        continue;
      }
      if (errno == EINTR) continue;
      if ((errno == EAGAIN || errno == EWOULDBLOCK) && wait_for(c_.fd, POLLOUT, deadline)) continue;
      return -1;
    }
    return static_cast<ssize_t>(size);
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = c_.remote_ip;
    port = c_.remote_port;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    ip = c_.local_ip;
    port = c_.local_port;
  }
  socket_t socket() const override { return c_.fd; }

 private:
  HttpFront::Conn& c_;
  const std::chrono::milliseconds timeout_;
};

}  // namespace

Result<std::pair<std::string, int>> split_listen_address(const std::string& address, const std::string& flag) {
  const auto bad = [&] { return invalid_argument(flag + " '" + address + "' is not host:port"); };
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size()) return bad();
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  char* end = nullptr;
  const long port = std::strtol(address.c_str() + colon + 1, &end, 10);
  if (*end != 0 || port < 0 || port > 65535 || host.empty()) return bad();
  return std::make_pair(host, static_cast<int>(port));
}

HttpFront::HttpFront(const HttpFrontConfig& config, httplib::Server& server) : config_(config), server_(server) {}

Result<std::unique_ptr<HttpFront>> HttpFront::start(const HttpFrontConfig& config, httplib::Server& server) {
  auto f = std::unique_ptr<HttpFront>(new HttpFront(config, server));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(config.port);
  if (getaddrinfo(config.host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) {
    return unavailable("cannot resolve '" + config.host + "'");
  }
  for (addrinfo* a = res; a != nullptr && f->listen_fd_ < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, config.listen_backlog) == 0) {
      f->listen_fd_ = fd;
    } else {
      ::close(fd);
    }
  }
  freeaddrinfo(res);
  if (f->listen_fd_ < 0) return unavailable("cannot listen on " + config.host + ":" + port + " (in use, or a bad address)");
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  getsockname(f->listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  std::string ip;
  endpoint(bound, len, &ip, &f->port_);
  set_nonblocking(f->listen_fd_);
  f->epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  f->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (f->epoll_fd_ < 0 || f->wake_fd_ < 0) return unavailable("epoll/eventfd: " + std::string(std::strerror(errno)));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;  // the listening socket
  epoll_ctl(f->epoll_fd_, EPOLL_CTL_ADD, f->listen_fd_, &ev);
  ev.data.ptr = &f->wake_fd_;
  epoll_ctl(f->epoll_fd_, EPOLL_CTL_ADD, f->wake_fd_, &ev);
  Routes::set_listening(server, f->listen_fd_);
  f->pool_ = std::make_unique<httplib::ThreadPool>(static_cast<size_t>(std::max(1, config.n_threads)));
  HttpFront* raw = f.get();
  f->thread_ = std::thread([raw] { raw->loop(); });
  return f;
}

HttpFront::~HttpFront() {
  stop();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void HttpFront::stop() {
  if (stopping_.exchange(true)) return;
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
  }
  if (thread_.joinable()) thread_.join();  // closes the connections waiting for a head
  Routes::set_listening(server_, INVALID_SOCKET);  // streams in progress end
  if (pool_) pool_->shutdown();             // waits for the requests being served
  std::lock_guard<std::mutex> lock(mu_);
  for (Conn* c : returned_) close(c);  // came back after the loop ended
  returned_.clear();
}

void HttpFront::close(Conn* c) {
  if (c->ssl != nullptr) {
    SSL_shutdown(c->ssl);  // best effort: a close_notify if the socket takes it
    SSL_free(c->ssl);
  }
  ::close(c->fd);
  delete c;
  n_connections_.fetch_sub(1);
}

void HttpFront::give_back(Conn* c) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    returned_.push_back(c);
  }
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof one);
}

namespace {
thread_local int serving_socket = -1;
}  // namespace

int http_front_socket() { return serving_socket; }

void HttpFront::serve(Conn* c) {
  FrontStream strm(*c, config_.io_timeout);
  bool closed = false;
  serving_socket = c->fd;
  const bool ok = Routes::serve(server_, strm, /*close_connection=*/stopping_.load(), closed,
                                [c](httplib::Request& req) { req.ssl = c->ssl; });
  serving_socket = -1;
  if (!ok || closed || stopping_.load()) {
    close(c);
    return;
  }
  give_back(c);
}

void HttpFront::loop() {
  set_thread_name("http-front");
  std::unordered_set<Conn*> waiting;  // registered with epoll, reading a head
  auto watch = [&](Conn* c, uint32_t events, bool add) {
    epoll_event ev{};
    ev.events = events;
    ev.data.ptr = c;
    epoll_ctl(epoll_fd_, add ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, c->fd, &ev);
  };
  auto drop = [&](Conn* c) {
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
    waiting.erase(c);
  };
  auto dispatch = [&](Conn* c) {
    drop(c);
    pool_->enqueue([this, c] { serve(c); });
  };
  auto refuse_head = [&](Conn* c) {  // too large: 431, then close
    static const char kReply[] =
        "HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\nContent-Length: 0\r\n\r\n";
    if (c->ssl != nullptr) {
      SSL_write(c->ssl, kReply, sizeof kReply - 1);
    } else {
      (void)!::send(c->fd, kReply, sizeof kReply - 1, MSG_NOSIGNAL);
    }
    drop(c);
    close(c);
  };
  // Reads what the connection has; handles a complete head, an end or an error. The handshake
  // first, for TLS.
  auto advance = [&](Conn* c) {
    if (c->ssl != nullptr && !c->handshaken) {
      ERR_clear_error();
      const int r = SSL_do_handshake(c->ssl);
      if (r != 1) {
        const int e = SSL_get_error(c->ssl, r);
        if (e == SSL_ERROR_WANT_READ) return watch(c, EPOLLIN, false);
        if (e == SSL_ERROR_WANT_WRITE) return watch(c, EPOLLOUT, false);
        drop(c);  // a failed handshake (no client certificate, a plaintext client, ...)
        return close(c);
      }
      c->handshaken = true;
    }
    char tmp[16384];
    for (;;) {
      const size_t end = c->buf.find("\r\n\r\n");
      if (end != std::string::npos) return end + 4 > config_.max_head_bytes ? refuse_head(c) : dispatch(c);
      if (c->buf.size() > config_.max_head_bytes) return refuse_head(c);
      ssize_t n;
      if (c->ssl != nullptr) {
        ERR_clear_error();
        n = SSL_read(c->ssl, tmp, sizeof tmp);
        if (n <= 0) {
          const int e = SSL_get_error(c->ssl, static_cast<int>(n));
          if (e == SSL_ERROR_WANT_READ) return watch(c, EPOLLIN, false);
          if (e == SSL_ERROR_WANT_WRITE) return watch(c, EPOLLOUT, false);
          drop(c);
          return close(c);
        }
      } else {
        n = ::recv(c->fd, tmp, sizeof tmp, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return watch(c, EPOLLIN, false);
        if (n <= 0) {
          drop(c);
          return close(c);
        }
      }
      c->buf.append(tmp, static_cast<size_t>(n));
    }
  };
  auto accept_all = [&] {
    for (;;) {
      sockaddr_storage peer{};
      socklen_t len = sizeof peer;
      const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR) continue;
        if (errno == EMFILE || errno == ENFILE) {
          spdlog::warn("HTTP: cannot accept a connection: {} (descriptors exhausted)", std::strerror(errno));
        }
        return;
      }
      int yes = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof yes);  // each SSE event leaves at once
      auto* c = new Conn();
      n_connections_.fetch_add(1);
      c->fd = fd;
      endpoint(peer, len, &c->remote_ip, &c->remote_port);
      sockaddr_storage local{};
      socklen_t local_len = sizeof local;
      getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len);
      endpoint(local, local_len, &c->local_ip, &c->local_port);
      c->deadline = Clock::now() + config_.head_timeout;
      if (config_.tls != nullptr) {
        c->ssl = SSL_new(config_.tls);
        SSL_set_fd(c->ssl, fd);
        SSL_set_accept_state(c->ssl);
      }
      waiting.insert(c);
      watch(c, EPOLLIN, true);
      advance(c);
    }
  };

  std::vector<epoll_event> events(256);
  auto next_sweep = Clock::now();
  while (!stopping_.load()) {
    const int n = epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), 100);
    for (int i = 0; i < n; ++i) {
      void* p = events[i].data.ptr;
      if (p == nullptr) {
        accept_all();
      } else if (p == &wake_fd_) {
        uint64_t v;
        (void)!::read(wake_fd_, &v, sizeof v);
      } else {
        Conn* c = static_cast<Conn*>(p);
        if (waiting.count(c) != 0) advance(c);
      }
    }
    // Connections back from the pool: the next request may already be read (pipelined).
    std::vector<Conn*> back;
    {
      std::lock_guard<std::mutex> lock(mu_);
      back.swap(returned_);
    }
    for (Conn* c : back) {
      c->deadline = Clock::now() + config_.idle_timeout;
      waiting.insert(c);
      watch(c, EPOLLIN, true);
      advance(c);
    }
    const auto now = Clock::now();
    if (now >= next_sweep) {  // heads that did not come in time
      next_sweep = now + std::chrono::milliseconds(100);
      std::vector<Conn*> late;
      for (Conn* c : waiting) {
        if (c->deadline <= now) late.push_back(c);
      }
      for (Conn* c : late) {
        drop(c);
        close(c);
      }
    }
  }
  for (Conn* c : waiting) {
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
    close(c);
  }
}

}  // namespace baton
