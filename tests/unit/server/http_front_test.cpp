// server/http_front.h over real sockets on loopback: requests on one kept-alive connection,
// pipelined requests read in one go, more idle connections than threads, the head deadline and
// size bound, and stop() with connections open.
#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "server/http_front.h"

using namespace baton;

namespace {

int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

void send_all(int fd, const std::string& s) { REQUIRE(::send(fd, s.data(), s.size(), MSG_NOSIGNAL) == ssize_t(s.size())); }

// Reads until `n` responses' bodies ("<path>;") have arrived, or the peer closes, or 5 s pass.
std::string read_bodies(int fd, int n) {
  std::string got;
  char buf[4096];
  while (std::count(got.begin(), got.end(), ';') < n) {
    const ssize_t r = ::recv(fd, buf, sizeof buf, 0);
    if (r <= 0) break;
    got.append(buf, static_cast<size_t>(r));
  }
  return got;
}

std::string get(const std::string& path) { return "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n"; }

struct Fixture {
  httplib::Server routes;
  std::unique_ptr<HttpFront> front;
  explicit Fixture(HttpFrontConfig config = {}) {
    routes.Get(R"(/echo/(\w+))", [](const httplib::Request& req, httplib::Response& res) {
      res.set_content(req.matches[1].str() + ";", "text/plain");
    });
    config.host = "127.0.0.1";
    auto f = HttpFront::start(config, routes);
    REQUIRE(f.ok());
    front = std::move(*f);
  }
};

}  // namespace

TEST_CASE("http front: a kept-alive connection serves request after request, pipelined ones too", "[http]") {
  Fixture fx;
  const int fd = connect_to(fx.front->port());
  send_all(fd, get("/echo/one"));
  CHECK(read_bodies(fd, 1).find("one;") != std::string::npos);
  send_all(fd, get("/echo/two"));  // the same connection, back from the pool
  CHECK(read_bodies(fd, 1).find("two;") != std::string::npos);
  send_all(fd, get("/echo/a") + get("/echo/b") + get("/echo/c"));  // one write, three requests
  const std::string three = read_bodies(fd, 3);
  CHECK(three.find("a;") < three.find("b;"));
  CHECK(three.find("b;") < three.find("c;"));
  CHECK(three.find("c;") != std::string::npos);
  ::close(fd);
}

TEST_CASE("http front: idle and slow-header connections beyond the threads hold none", "[http]") {
  HttpFrontConfig config;
  config.n_threads = 2;
  Fixture fx(config);
  std::vector<int> idle;
  for (int i = 0; i < 200; ++i) {
    idle.push_back(connect_to(fx.front->port()));
    if (i % 2) send_all(idle.back(), "GET /echo/sl");  // half a request line, then nothing
  }
  const int fd = connect_to(fx.front->port());
  send_all(fd, get("/echo/through"));
  CHECK(read_bodies(fd, 1).find("through;") != std::string::npos);
  ::close(fd);
  for (int s : idle) ::close(s);
}

TEST_CASE("http front: a head must arrive within its deadline and fit its bound", "[http]") {
  HttpFrontConfig config;
  config.head_timeout = std::chrono::milliseconds(300);
  config.max_head_bytes = 1024;
  Fixture fx(config);
  const int slow = connect_to(fx.front->port());
  send_all(slow, "GET /echo/late HTTP/1.1\r\n");
  const auto t0 = std::chrono::steady_clock::now();
  char c;
  CHECK(::recv(slow, &c, 1, 0) == 0);  // closed, unanswered
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3));
  ::close(slow);
  const int big = connect_to(fx.front->port());
  send_all(big, "GET /echo/big HTTP/1.1\r\nX-Big: " + std::string(2000, 'z') + "\r\n\r\n");
  CHECK(read_bodies(big, 1).rfind("HTTP/1.1 431", 0) == 0);
  ::close(big);
}

TEST_CASE("http front: stop closes waiting connections and returns", "[http]") {
  Fixture fx;
  std::vector<int> open;
  for (int i = 0; i < 10; ++i) open.push_back(connect_to(fx.front->port()));
  REQUIRE(fx.front->n_connections() <= 10);
  fx.front->stop();
  for (int s : open) {
    char c;
    CHECK(::recv(s, &c, 1, 0) <= 0);
    ::close(s);
  }
  CHECK(fx.front->n_connections() == 0);
}
