// A KvTransport for tests that records what it is sent, in process (tests/unit/prefill_worker/).
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kv/kv_transfer.h"

namespace baton::testing {

// K and V of one request, per layer, as host bytes [n_tokens, n_kv_heads, head_dim].
struct Kv {
  std::vector<std::string> k, v;
};

// Records every transfer; returns `result` (after checking the chunks cover every layer, as a
// receiver would). With `gate` closed, send() waits before taking any chunk.
class RecordingTransport final : public KvTransport {
 public:
  struct Sent {
    std::string address;
    KvTransferHeader header;
    Kv kv;
    int n_chunks = 0;
    std::optional<int32_t> first_token;  // the end's; nullopt: the sender abandoned the transfer
  };

  std::string name() const override { return "recording"; }
  Status send(const std::string& address, const KvTransferHeader& header, KvSource& source,
              int64_t* bytes_sent) override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      ++n_waiting_;
      cv_.notify_all();
      cv_.wait(lock, [this] { return gate_open_; });
      --n_waiting_;
    }
    Sent s{address, header, {}, 0, std::nullopt};
    const int64_t layer_bytes = kv_chunk_bytes(header, header.n_tokens);
    const int64_t row = kv_chunk_bytes(header, 1);
    s.kv.k.assign(header.n_layers, std::string(layer_bytes, '\0'));
    s.kv.v = s.kv.k;
    std::vector<int64_t> covered(header.n_layers, 0);
    int64_t bytes = 0;
    KvChunk c;
    // Runs on a sender thread: no Catch2 assertions here (not thread-safe); a bad chunk fails the send.
    while (source.next(&c)) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++taken_[header.request_id];
        taken_layers_[header.request_id].push_back({c.layer, c.token_start + c.token_count});
        if (fail_after_chunks >= 0 && taken_[header.request_id] > fail_after_chunks) {
          sent_[header.request_id] = s;
          cv_.notify_all();
          return result;  // the receiver refused mid-stream: nothing more is taken
        }
      }
      cv_.notify_all();
      if (c.checksum != kv_checksum(c.k, c.v)) return internal_error("checksum");
      if (c.layer < 0 || c.layer >= header.n_layers || c.token_start != covered[c.layer] ||
          static_cast<int64_t>(c.k.size()) != c.token_count * row || c.v.size() != c.k.size()) {
        return internal_error("chunk shape");
      }
      if (static_cast<int64_t>(c.k.size() + c.v.size()) > max_chunk_bytes) return internal_error("chunk too large");
      s.kv.k[c.layer].replace(c.token_start * row, c.k.size(), c.k);
      s.kv.v[c.layer].replace(c.token_start * row, c.v.size(), c.v);
      covered[c.layer] += c.token_count;
      bytes += static_cast<int64_t>(c.k.size() + c.v.size());
      ++s.n_chunks;
    }
    s.first_token = source.first_token();
    const bool complete = std::all_of(covered.begin(), covered.end(), [&](int64_t n) { return n == header.n_tokens; });
    std::lock_guard<std::mutex> lock(mu_);
    sent_[header.request_id] = s;
    if (!s.first_token) return cancelled("KV transfer of " + header.request_id + " abandoned by its sender");
    if (!complete) return invalid_argument("incomplete KV for " + header.request_id);
    if (!result.ok()) return result;
    *bytes_sent = bytes;
    return {};
  }

  void close_gate() {
    std::lock_guard<std::mutex> lock(mu_);
    gate_open_ = false;
  }
  void open_gate() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      gate_open_ = true;
    }
    cv_.notify_all();
  }
  // Waits until `n` sends are held at the closed gate.
  bool wait_held(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10), [&] { return n_waiting_ >= n; });
  }
  // Waits until `pred(chunks taken so far for id)` holds (the send is still running).
  bool wait_taken(const std::string& id, const std::function<bool(const std::vector<std::pair<int32_t, int32_t>>&)>& pred) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10), [&] { return pred(taken_layers_[id]); });
  }
  bool has(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    return sent_.count(id) > 0;
  }
  Sent get(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    return sent_.at(id);
  }
  // Every transfer recorded so far, by request id.
  std::map<std::string, Sent> all() {
    std::lock_guard<std::mutex> lock(mu_);
    return sent_;
  }

  Status result;  // what send() returns for a complete transfer (and for one cut short below)
  int fail_after_chunks = -1;  // >= 0: send() returns `result` when the receiver is offered one more chunk
  int64_t max_chunk_bytes = INT64_MAX;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool gate_open_ = true;
  int n_waiting_ = 0;
  std::map<std::string, Sent> sent_;
  std::map<std::string, int> taken_;  // chunks taken so far, per request
  // (layer, end token) of each chunk taken so far, per request, in order
  std::map<std::string, std::vector<std::pair<int32_t, int32_t>>> taken_layers_;
};

}  // namespace baton::testing
