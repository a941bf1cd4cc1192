// The KvTransport conformance suite (DESIGN.md: one suite runs against every transport the
// machine can run). A transport's test sets up its transport, a RecordingReceiver reachable at an
// address through that transport's receiving side, and an address nothing listens on, then calls
// run_kv_transport_conformance (every case, one SECTION each) and run_kv_transport_deadline with a
// transport made with a short deadline. Inputs are random, fresh each run. Runs against: tcp
// (tests/unit/kv/tcp_transport_test.cpp), cuda_ipc and nccl (tests/gpu/kv_transport_test.cpp).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kv/kv_transfer.h"

namespace baton::testing {

// Records what arrives, per request id; optionally refuses at one stage. Thread-safe.
class RecordingReceiver final : public KvReceiver {
 public:
  struct Transfer {
    KvTransferHeader header;
    std::vector<KvChunk> chunks;
    bool ended = false;
    bool aborted = false;
    int32_t first_token = -1;  // what kv_end carried
  };

  // Each hook, when set, may refuse the call by returning a non-ok Status.
  std::function<Status(const KvTransferHeader&)> on_begin;
  std::function<Status(const KvChunk&)> on_chunk;

  Status kv_begin(const KvTransferHeader& header) override {
    if (on_begin) BATON_RETURN_IF_ERROR(on_begin(header));
    std::lock_guard<std::mutex> lock(mu_);
    transfers_[header.request_id] = Transfer{header, {}, false, false, -1};
    return {};
  }
  Status kv_chunk(const std::string& request_id, const KvChunk& chunk) override {
    if (on_chunk) BATON_RETURN_IF_ERROR(on_chunk(chunk));
    std::lock_guard<std::mutex> lock(mu_);
    transfers_.at(request_id).chunks.push_back(chunk);
    return {};
  }
  Status kv_end(const std::string& request_id, int32_t first_token) override {
    std::lock_guard<std::mutex> lock(mu_);
    transfers_.at(request_id).ended = true;
    transfers_.at(request_id).first_token = first_token;
    return {};
  }
  void kv_abort(const std::string& request_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    transfers_.at(request_id).aborted = true;
  }

  bool has(const std::string& id) const {
    std::lock_guard<std::mutex> lock(mu_);
    return transfers_.count(id) > 0;
  }
  Transfer get(const std::string& id) const {
    std::lock_guard<std::mutex> lock(mu_);
    return transfers_.at(id);
  }
  // Waits (a receiver may learn of a broken stream after the sender's call returned).
  bool wait_aborted(const std::string& id, std::chrono::milliseconds timeout = std::chrono::seconds(5)) const {
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < until) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = transfers_.find(id);
        if (it != transfers_.end() && it->second.aborted) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, Transfer> transfers_;
};

// A random transfer: header and, per layer, K and V bytes for every token, cut into chunks of
// random token ranges (layers in random order, ranges of a layer in order).
struct KvPayload {
  KvTransferHeader header;
  std::vector<std::string> k, v;  // per layer: n_tokens × n_kv_heads × head_dim elements
  std::vector<KvChunk> chunks;    // in send order
  int64_t bytes = 0;              // K + V bytes of all chunks
  int32_t first_token = 0;        // the end's
};

inline KvPayload make_kv_payload(std::mt19937_64& rng, const std::string& request_id) {
  KvPayload p;
  KvTransferHeader& h = p.header;
  h.request_id = request_id;
  h.model_fingerprint = "fp-" + std::to_string(rng());
  h.dtype = rng() % 2 ? "f32" : "bf16";
  h.n_layers = 1 + static_cast<int32_t>(rng() % 4);
  h.n_kv_heads = 1 + static_cast<int32_t>(rng() % 3);
  h.head_dim = 4 * (1 + static_cast<int32_t>(rng() % 8));
  h.n_tokens = 1 + static_cast<int32_t>(rng() % 200);
  p.first_token = static_cast<int32_t>(rng() % 1000);
  for (int32_t i = 0; i < h.n_tokens; ++i) h.token_ids.push_back(static_cast<int32_t>(rng() % 1000));
  const int64_t layer_bytes = kv_chunk_bytes(h, h.n_tokens);
  auto random_bytes = [&](int64_t n) {
    std::string s(static_cast<size_t>(n), '\0');
    for (char& c : s) c = static_cast<char>(rng());
    return s;
  };
  std::vector<int32_t> layers(h.n_layers);
  for (int32_t l = 0; l < h.n_layers; ++l) {
    p.k.push_back(random_bytes(layer_bytes));
    p.v.push_back(random_bytes(layer_bytes));
    layers[l] = l;
  }
  std::shuffle(layers.begin(), layers.end(), rng);
  const int64_t row = kv_chunk_bytes(h, 1);
  for (int32_t l : layers) {
    for (int32_t start = 0; start < h.n_tokens;) {
      const int32_t n = std::min<int32_t>(h.n_tokens - start, 1 + static_cast<int32_t>(rng() % 64));
      KvChunk c;
      c.layer = l;
      c.token_start = start;
      c.token_count = n;
      c.k = p.k[l].substr(start * row, n * row);
      c.v = p.v[l].substr(start * row, n * row);
      c.checksum = kv_checksum(c.k, c.v);
      p.bytes += static_cast<int64_t>(c.k.size() + c.v.size());
      p.chunks.push_back(std::move(c));
      start += n;
    }
  }
  return p;
}

// A source over copies of `chunks` (so a payload can be sent twice) ending with `first_token`
// (nullopt: the sender abandons the transfer after the chunks). `*chunk_source(...)` is a source
// for the rest of the full expression.
inline std::unique_ptr<KvSource> chunk_source(const std::vector<KvChunk>& chunks,
                                              std::optional<int32_t> first_token) {
  return std::make_unique<KvVectorSource>(chunks, first_token);
}
inline std::unique_ptr<KvSource> chunk_source(const KvPayload& p) { return chunk_source(p.chunks, p.first_token); }

// K and V per layer reassembled from what the receiver recorded.
inline void check_arrived_intact(const RecordingReceiver::Transfer& t, const KvPayload& p) {
  const KvTransferHeader& a = t.header;
  const KvTransferHeader& b = p.header;
  CHECK(a.request_id == b.request_id);
  CHECK(a.model_fingerprint == b.model_fingerprint);
  CHECK(a.dtype == b.dtype);
  CHECK(a.n_layers == b.n_layers);
  CHECK(a.n_kv_heads == b.n_kv_heads);
  CHECK(a.head_dim == b.head_dim);
  CHECK(a.n_tokens == b.n_tokens);
  CHECK(t.first_token == p.first_token);
  CHECK(a.token_ids == b.token_ids);
  CHECK(t.ended);
  CHECK_FALSE(t.aborted);
  const int64_t row = kv_chunk_bytes(b, 1);
  std::vector<std::string> k(b.n_layers, std::string(p.k[0].size(), '\0')), v = k;
  for (const KvChunk& c : t.chunks) {
    REQUIRE(c.layer >= 0);
    REQUIRE(c.layer < b.n_layers);
    REQUIRE(c.k.size() == static_cast<size_t>(c.token_count * row));
    k[c.layer].replace(c.token_start * row, c.k.size(), c.k);
    v[c.layer].replace(c.token_start * row, c.v.size(), c.v);
    CHECK(c.checksum == kv_checksum(c.k, c.v));
  }
  for (int32_t l = 0; l < b.n_layers; ++l) {
    INFO("layer " << l);
    CHECK(k[l] == p.k[l]);
    CHECK(v[l] == p.v[l]);
  }
}

// A loopback address nobody listens on (a port bound, then released).
inline std::string unused_loopback_address() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  socklen_t len = sizeof(addr);
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  close(fd);
  return "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
}

// ---- the cases ---------------------------------------------------------------------------------

// Random KV arrives byte-identical with its header; several transfers at once don't mix.
inline void run_kv_transport_roundtrip(KvTransport& transport, const std::string& address,
                                       RecordingReceiver& receiver) {
  std::mt19937_64 rng(std::random_device{}());
  const KvPayload one = make_kv_payload(rng, "rt-one-" + std::to_string(rng()));
  int64_t bytes = -1;
  const Status s = transport.send(address, one.header, *chunk_source(one), &bytes);
  INFO(s.to_string());
  REQUIRE(s.ok());
  CHECK(bytes == one.bytes);
  check_arrived_intact(receiver.get(one.header.request_id), one);

  std::vector<KvPayload> many;
  for (int i = 0; i < 4; ++i)
    many.push_back(make_kv_payload(rng, "rt-many-" + std::to_string(i) + "-" + std::to_string(rng())));
  std::vector<Status> statuses(many.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < many.size(); ++i) {
    threads.emplace_back([&, i] {
      int64_t b = 0;
      statuses[i] = transport.send(address, many[i].header, *chunk_source(many[i]), &b);
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < many.size(); ++i) {
    INFO("concurrent transfer " << i << ": " << statuses[i].to_string());
    REQUIRE(statuses[i].ok());
    check_arrived_intact(receiver.get(many[i].header.request_id), many[i]);
  }
}

// The receiver's refusal comes back with its code; a refusal after begin aborts the transfer.
inline void run_kv_transport_refusals(KvTransport& transport, const std::string& address, RecordingReceiver& receiver) {
  std::mt19937_64 rng(std::random_device{}());
  const KvPayload p = make_kv_payload(rng, "refuse-begin-" + std::to_string(rng()));
  receiver.on_begin = [&](const KvTransferHeader& h) -> Status {
    if (h.request_id == p.header.request_id)
      return failed_precondition("model fingerprint " + h.model_fingerprint + " differs");
    return {};
  };
  int64_t bytes = 0;
  Status s = transport.send(address, p.header, *chunk_source(p), &bytes);
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK(s.message().find("fingerprint") != std::string::npos);
  CHECK_FALSE(receiver.has(p.header.request_id));
  receiver.on_begin = nullptr;

  const KvPayload q = make_kv_payload(rng, "refuse-chunk-" + std::to_string(rng()));
  receiver.on_chunk = [](const KvChunk&) -> Status { return resource_exhausted("more KV than the reservation"); };
  s = transport.send(address, q.header, *chunk_source(q), &bytes);
  CHECK(s.code() == StatusCode::kResourceExhausted);
  CHECK(receiver.wait_aborted(q.header.request_id));
  CHECK_FALSE(receiver.get(q.header.request_id).ended);
  receiver.on_chunk = nullptr;
}

// A chunk whose bytes do not match its checksum → DATA_LOSS, and the receiver aborts.
inline void run_kv_transport_corruption(KvTransport& transport, const std::string& address,
                                        RecordingReceiver& receiver) {
  std::mt19937_64 rng(std::random_device{}());
  KvPayload p = make_kv_payload(rng, "corrupt-" + std::to_string(rng()));
  KvChunk& victim = p.chunks[rng() % p.chunks.size()];
  std::string& bytes_of = rng() % 2 ? victim.k : victim.v;
  bytes_of[rng() % bytes_of.size()] ^= static_cast<char>(1 + rng() % 255);
  int64_t bytes = 0;
  const Status s = transport.send(address, p.header, *chunk_source(p), &bytes);
  INFO(s.to_string());
  CHECK(s.code() == StatusCode::kDataLoss);
  CHECK(receiver.wait_aborted(p.header.request_id));
  CHECK_FALSE(receiver.get(p.header.request_id).ended);
}

// A sender that stops before every layer is covered is refused; the receiver aborts.
inline void run_kv_transport_incomplete(KvTransport& transport, const std::string& address,
                                        RecordingReceiver& receiver) {
  std::mt19937_64 rng(std::random_device{}());
  KvPayload p = make_kv_payload(rng, "incomplete-" + std::to_string(rng()));
  p.chunks.pop_back();
  int64_t bytes = 0;
  const Status s = transport.send(address, p.header, *chunk_source(p), &bytes);
  INFO(s.to_string());
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(receiver.wait_aborted(p.header.request_id));
  CHECK_FALSE(receiver.get(p.header.request_id).ended);
}

// A sender that abandons the transfer after its chunks (the request was cancelled mid-prefill):
// CANCELLED, and the receiver aborts instead of ending it.
inline void run_kv_transport_abandoned(KvTransport& transport, const std::string& address,
                                       RecordingReceiver& receiver) {
  std::mt19937_64 rng(std::random_device{}());
  KvPayload p = make_kv_payload(rng, "abandoned-" + std::to_string(rng()));
  p.chunks.resize(rng() % (p.chunks.size() + 1));  // anything up to every chunk
  int64_t bytes = 0;
  const Status s = transport.send(address, p.header, *chunk_source(p.chunks, std::nullopt), &bytes);
  INFO(s.to_string());
  CHECK(s.code() == StatusCode::kCancelled);
  // The cancellation may reach the receiver before the header does: then it never began.
  const std::string& id = p.header.request_id;
  receiver.wait_aborted(id, std::chrono::seconds(2));
  if (receiver.has(id)) {
    CHECK(receiver.get(id).aborted);
    CHECK_FALSE(receiver.get(id).ended);
  }
}

// Nobody listening → UNAVAILABLE, quickly.
inline void run_kv_transport_unreachable(KvTransport& transport, const std::string& unreachable_address) {
  std::mt19937_64 rng(std::random_device{}());
  const KvPayload p = make_kv_payload(rng, "unreachable-" + std::to_string(rng()));
  int64_t bytes = -1;
  const auto t0 = std::chrono::steady_clock::now();
  const Status s = transport.send(unreachable_address, p.header, *chunk_source(p), &bytes);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(s.to_string());
  CHECK(s.code() == StatusCode::kUnavailable);
  CHECK(seconds < 5.0);
  CHECK(bytes == 0);
}

// A refusal and an unreachable worker both name the decode worker and the request.
inline void run_kv_transport_errors_name_worker(KvTransport& transport, const std::string& address,
                                                RecordingReceiver& receiver, const std::string& unreachable_address) {
  std::mt19937_64 rng(std::random_device{}());
  const KvPayload p = make_kv_payload(rng, "named-" + std::to_string(rng()));
  receiver.on_begin = [](const KvTransferHeader&) -> Status { return failed_precondition("not admitted"); };
  int64_t bytes = 0;
  Status s = transport.send(address, p.header, *chunk_source(p), &bytes);
  receiver.on_begin = nullptr;
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK(s.message().find(address) != std::string::npos);
  CHECK(s.message().find(p.header.request_id) != std::string::npos);

  s = transport.send(unreachable_address, p.header, *chunk_source(p), &bytes);
  CHECK(s.code() == StatusCode::kUnavailable);
  CHECK(s.message().find(unreachable_address) != std::string::npos);
}

// A receiver stalled far past the transport's deadline (`transport` was made with `deadline`):
// DEADLINE_EXCEEDED about then, and the receiver aborts the transfer once it notices.
inline void run_kv_transport_deadline(KvTransport& transport, std::chrono::milliseconds deadline,
                                      const std::string& address, RecordingReceiver& receiver) {
  std::mt19937_64 rng(std::random_device{}());
  const KvPayload p = make_kv_payload(rng, "slow-" + std::to_string(rng()));
  // A reaction should never block; this one does, to stand for a stalled peer.
  receiver.on_begin = [deadline](const KvTransferHeader&) -> Status {
    std::this_thread::sleep_for(4 * deadline);
    return {};
  };
  int64_t bytes = 0;
  const auto t0 = std::chrono::steady_clock::now();
  const Status s = transport.send(address, p.header, *chunk_source(p), &bytes);
  const auto elapsed = std::chrono::steady_clock::now() - t0;
  INFO(s.to_string());
  CHECK(s.code() == StatusCode::kDeadlineExceeded);
  CHECK(elapsed < 3.5 * deadline);
  CHECK(receiver.wait_aborted(p.header.request_id, std::chrono::seconds(5) + 4 * deadline));
  receiver.on_begin = nullptr;
}

inline void run_kv_transport_conformance(KvTransport& transport, const std::string& address,
                                         RecordingReceiver& receiver, const std::string& unreachable_address) {
  SECTION("round trip") {
    run_kv_transport_roundtrip(transport, address, receiver);
  }
  SECTION("refusals") {
    run_kv_transport_refusals(transport, address, receiver);
  }
  SECTION("corruption") {
    run_kv_transport_corruption(transport, address, receiver);
  }
  SECTION("incomplete") {
    run_kv_transport_incomplete(transport, address, receiver);
  }
  SECTION("abandoned by the sender") {
    run_kv_transport_abandoned(transport, address, receiver);
  }
  SECTION("unreachable") {
    run_kv_transport_unreachable(transport, unreachable_address);
  }
  SECTION("errors name the decode worker") {
    run_kv_transport_errors_name_worker(transport, address, receiver, unreachable_address);
  }
}

}  // namespace baton::testing
