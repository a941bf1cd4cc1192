// KvOutbox against an engine played by a thread (steps of random sizes, layers written one by
// one), and KvSender's pool against a recording transport: every (layer, token) leaves exactly
// once, never before the forward wrote it, the cached part first, and the end carries the first
// token; an abandoned outbox ends its transfer.
#include "kv/kv_sender.h"

#include <catch2/catch.hpp>

#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

namespace baton {
namespace {

KvTransferHeader header(int32_t n_layers, int32_t n_tokens) {
  KvTransferHeader h;
  h.request_id = "req";
  h.dtype = "f32";
  h.n_layers = n_layers;
  h.n_kv_heads = 1;
  h.head_dim = 2;
  h.n_tokens = n_tokens;
  h.token_ids.assign(static_cast<size_t>(n_tokens), 1);
  return h;
}

// What the engine has written: layers [0, layers) of every token below each mark.
struct Cache {
  std::mutex mu;
  std::vector<int32_t> written;  // per token: how many layers are in
  int violations = 0;            // a position exported before it was written
  explicit Cache(int32_t n_tokens) : written(static_cast<size_t>(n_tokens), 0) {}
  KvOutbox::Export exporter() {
    return [this](int32_t layer, int32_t start, int32_t n, char* k, char* v) {
      std::lock_guard<std::mutex> lock(mu);
      for (int32_t t = start; t < start + n; ++t) {
        if (written[static_cast<size_t>(t)] <= layer) ++violations;
        // Each token's row of K and V says which (layer, token) it is.
        const float row[2] = {static_cast<float>(layer), static_cast<float>(t)};
        std::memcpy(k + (t - start) * sizeof row, row, sizeof row);
        std::memcpy(v + (t - start) * sizeof row, row, sizeof row);
      }
    };
  }
  void write(int32_t from, int32_t to, int32_t n_layers) {
    std::lock_guard<std::mutex> lock(mu);
    for (int32_t t = from; t < to; ++t) written[static_cast<size_t>(t)] = n_layers;
  }
};

// Drains `box` as a transport would; (layer, token) → how many times it came.
std::map<std::pair<int32_t, int32_t>, int> drain(KvOutbox& box, std::vector<int32_t>* first_layers_order = nullptr) {
  std::map<std::pair<int32_t, int32_t>, int> seen;
  KvChunk c;
  while (box.next(&c)) {
    REQUIRE(c.checksum == kv_checksum(c.k, c.v));
    for (int32_t i = 0; i < c.token_count; ++i) {
      float row[2];
      std::memcpy(row, c.k.data() + i * sizeof row, sizeof row);
      CHECK(row[0] == static_cast<float>(c.layer));
      CHECK(row[1] == static_cast<float>(c.token_start + i));
      ++seen[{c.layer, c.token_start + i}];
    }
    if (first_layers_order) first_layers_order->push_back(c.token_start);
  }
  return seen;
}

TEST_CASE("kv outbox: the cached part leaves first, then each step layer by layer, then the end",
          "[kv][kv_sender]") {
  std::mt19937 rng(std::random_device{}());
  for (int round = 0; round < 50; ++round) {
    const int32_t n_layers = 1 + static_cast<int32_t>(rng() % 4);
    const int32_t n_tokens = 1 + static_cast<int32_t>(rng() % 60);
    const int32_t n_cached = static_cast<int32_t>(rng() % n_tokens);  // the last token is always computed
    const int64_t chunk_bytes = 8 * (1 + static_cast<int64_t>(rng() % 6));  // 1..6 tokens of K+V (8 bytes each)
    Cache cache(n_tokens);
    cache.write(0, n_cached, n_layers);
    KvOutbox box(header(n_layers, n_tokens), n_cached, chunk_bytes, cache.exporter());
    const int32_t first_token = static_cast<int32_t>(rng() % 100);
    const unsigned engine_seed = static_cast<unsigned>(rng());
    std::thread engine([&, engine_seed] {
      std::mt19937 r(engine_seed);
      int32_t done = n_cached;
      while (done < n_tokens) {
        const int32_t end = std::min(n_tokens, done + 1 + static_cast<int32_t>(r() % 9));
        box.step_begins(end);
        for (int32_t layer = 0; layer < n_layers; ++layer) {
          cache.write(done, end, layer + 1);
          if (r() % 2) box.layer_written(layer + 1);  // streaming reports some layers early
          if (r() % 4 == 0) std::this_thread::yield();
        }
        box.step_done();
        done = end;
      }
      box.prefilled(first_token, KvOutbox::Clock::now());
    });
    std::vector<int32_t> starts;
    const auto seen = drain(box, &starts);
    engine.join();
    INFO("layers " << n_layers << ", tokens " << n_tokens << ", cached " << n_cached);
    CHECK(cache.violations == 0);
    CHECK(seen.size() == static_cast<size_t>(n_layers) * n_tokens);
    for (const auto& [where, times] : seen) CHECK(times == 1);
    if (n_cached > 0) CHECK(starts.front() == 0);
    REQUIRE(box.first_token() == first_token);
  }
}

TEST_CASE("kv outbox: abandoned, its transfer ends without a first token", "[kv][kv_sender]") {
  Cache cache(8);
  KvOutbox box(header(2, 8), 0, 1 << 20, cache.exporter());
  box.step_begins(4);
  cache.write(0, 4, 2);
  box.step_done();
  KvChunk c;
  REQUIRE(box.next(&c));  // layer 0 of [0, 4)
  REQUIRE(box.next(&c));  // layer 1
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    box.abandon();  // the reader waits for the next step: it must wake
  });
  CHECK_FALSE(box.next(&c));
  t.join();
  CHECK(box.abandoned());
  CHECK_FALSE(box.first_token().has_value());
  box.prefilled(7, KvOutbox::Clock::now());
  CHECK_FALSE(box.first_token().has_value());  // abandoned stays abandoned
}

// A transport that drains the source in the sender's thread, as tcp does.
class RecordingTransport final : public KvTransport {
 public:
  std::string name() const override { return "recording"; }
  Status send(const std::string& address, const KvTransferHeader& h, KvSource& source, int64_t* bytes) override {
    KvChunk c;
    int64_t n = 0;
    while (source.next(&c)) n += static_cast<int64_t>(c.k.size() + c.v.size());
    *bytes = n;
    const std::optional<int32_t> first = source.first_token();
    std::lock_guard<std::mutex> lock(mu);
    addresses.insert(address);
    if (!first) return cancelled("abandoned");
    first_tokens[h.request_id] = *first;
    return {};
  }
  std::mutex mu;
  std::set<std::string> addresses;
  std::map<std::string, int32_t> first_tokens;
};

TEST_CASE("kv sender: every queued transfer runs once and reports, and stop runs what is queued", "[kv][kv_sender]") {
  RecordingTransport transport;
  std::mutex mu;
  std::map<std::string, Status> done;
  int twice = 0;  // a transfer reported more than once (counted here: Catch2 is not thread-safe)
  {
    KvSender sender(transport, KvSenderConfig{3, "p"});
    for (int i = 0; i < 40; ++i) {
      KvTransferHeader h = header(2, 5);
      h.request_id = "r" + std::to_string(i);
      auto cache = std::make_shared<Cache>(5);
      cache->write(0, 5, 2);
      auto box = std::make_shared<KvOutbox>(h, 5, 1 << 20, [cache](int32_t l, int32_t s, int32_t n, char* k, char* v) {
        cache->exporter()(l, s, n, k, v);
      });
      if (i % 5 == 4) {
        box->abandon();
      } else {
        box->prefilled(i, KvOutbox::Clock::now());
      }
      sender.send(box, "d" + std::to_string(i % 2),
                  [&mu, &done, &twice, id = h.request_id](const Status& s, double, int64_t) {
                    std::lock_guard<std::mutex> lock(mu);
                    twice += static_cast<int>(done.count(id));
                    done[id] = s;
                  });
    }
    sender.stop();  // runs the queue out, then joins
  }
  CHECK(twice == 0);
  REQUIRE(done.size() == 40);
  for (int i = 0; i < 40; ++i) {
    const Status& s = done["r" + std::to_string(i)];
    if (i % 5 == 4) {
      CHECK(s.code() == StatusCode::kCancelled);
    } else {
      CHECK(s.ok());
      CHECK(transport.first_tokens["r" + std::to_string(i)] == i);
    }
  }
}

}  // namespace
}  // namespace baton
