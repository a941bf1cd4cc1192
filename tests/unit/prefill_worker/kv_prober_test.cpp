// The prefill worker's KV prober (prefill_worker/kv_prober.h) over a recording transport: probes
// run one at a time on its thread, send probe-flagged transfers of the model's shape in chunks no
// larger than real KV's, and answer exactly once (a result, or CANCELLED when their call is
// cancelled or the worker stops).
#include "prefill_worker/kv_prober.h"

#include <catch2/catch.hpp>
#include <future>
#include <random>
#include <thread>

#include "tests/unit/prefill_worker/recording_transport.h"

using namespace baton;
using baton::testing::RecordingTransport;

namespace {

// Collects one `done`.
struct Answer {
  std::promise<Result<KvProbeResult>> promise;
  std::future<Result<KvProbeResult>> future = promise.get_future();
  KvProber::Done done() {
    return [this](Result<KvProbeResult> r) { promise.set_value(std::move(r)); };
  }
  Result<KvProbeResult> get() {
    REQUIRE(future.wait_for(std::chrono::seconds(20)) == std::future_status::ready);
    return future.get();
  }
  bool ready() { return future.wait_for(std::chrono::milliseconds(0)) == std::future_status::ready; }
};

}  // namespace

TEST_CASE("a probe sends probe-flagged KV of the worker's shape, chunked like real KV", "[prefill][probe]") {
  std::mt19937_64 rng(std::random_device{}());
  const KvProbeShape shape{"fp-" + std::to_string(rng()), rng() % 2 ? "f32" : "bf16",
                           1 + static_cast<int32_t>(rng() % 8), 1 + static_cast<int32_t>(rng() % 4),
                           8 * (1 + static_cast<int32_t>(rng() % 8))};
  const int64_t chunk_bytes = 4096 + static_cast<int64_t>(rng() % 65536);
  RecordingTransport transport;
  transport.max_chunk_bytes = std::max(chunk_bytes, 2 * kv_chunk_bytes(kv_probe_header(shape, 1), 1));
  KvProber prober(transport, shape, chunk_bytes, "prefill-0");
  const int32_t rounds = 1 + static_cast<int32_t>(rng() % 5);
  const int64_t bytes = 1 + static_cast<int64_t>(rng() % (1 << 20));
  Answer answer;
  int caller = 0;
  REQUIRE(prober.start(&caller, "10.0.0.9:50051", bytes, rounds, answer.done()).ok());
  Result<KvProbeResult> r = answer.get();
  REQUIRE(r.ok());
  CHECK(r->transport == "recording");
  CHECK(r->seconds.size() == static_cast<size_t>(rounds));
  CHECK(r->latency_seconds.size() == static_cast<size_t>(rounds));
  CHECK(r->bytes == kv_transfer_bytes(kv_probe_header(shape, bytes)));
  // Every transfer went to the decode address, a probe of the worker's shape with an id of its own,
  // complete (the transport checked each chunk's checksum, place and size).
  const auto sent = transport.all();
  CHECK(sent.size() == static_cast<size_t>(2 * rounds));
  int n_large = 0;
  for (const auto& [id, s] : sent) {
    CHECK(s.address == "10.0.0.9:50051");
    CHECK(s.header.probe);
    CHECK(s.header.model_fingerprint == shape.model_fingerprint);
    CHECK(s.header.dtype == shape.dtype);
    CHECK(s.header.n_layers == shape.n_layers);
    CHECK(s.header.n_kv_heads == shape.n_kv_heads);
    CHECK(s.header.head_dim == shape.head_dim);
    CHECK(s.first_token == 0);
    n_large += kv_transfer_bytes(s.header) == r->bytes && s.header.n_tokens > 1;
  }
  if (r->bytes > r->latency_bytes) CHECK(n_large == rounds);
  SECTION("the next probe may start once the answer came") {
    Answer again;
    CHECK(prober.start(&caller, "10.0.0.9:50051", bytes, 1, again.done()).ok());
    CHECK(again.get().ok());
  }
}

TEST_CASE("one probe at a time, a cancelled or stopped probe answers CANCELLED once", "[prefill][probe]") {
  const KvProbeShape shape{"fp", "f32", 2, 2, 16};
  RecordingTransport transport;
  transport.close_gate();
  KvProber prober(transport, shape, 1 << 20, "prefill-0");
  Answer first;
  int a = 0, b = 0;
  REQUIRE(prober.start(&a, "10.0.0.9:1", 1 << 16, 3, first.done()).ok());
  REQUIRE(transport.wait_held(1));
  Answer second;
  const Status busy = prober.start(&b, "10.0.0.9:1", 1 << 16, 3, second.done());
  CHECK(busy.code() == StatusCode::kResourceExhausted);
  prober.cancel(&b);  // not b's probe: ignored
  CHECK_FALSE(first.ready());

  SECTION("cancelled by its caller") {
    prober.cancel(&a);
    transport.open_gate();
    CHECK(first.get().status().code() == StatusCode::kCancelled);
    Answer third;
    REQUIRE(prober.start(&b, "10.0.0.9:1", 1 << 16, 1, third.done()).ok());
    CHECK(third.get().ok());
  }
  SECTION("stopped") {
    std::thread opener([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      transport.open_gate();
    });
    prober.stop();
    opener.join();
    CHECK(first.get().status().code() == StatusCode::kCancelled);
    Answer late;
    CHECK(prober.start(&b, "10.0.0.9:1", 1 << 16, 1, late.done()).code() == StatusCode::kUnavailable);
  }
  CHECK_FALSE(second.ready());  // refused at start: never answered
}

TEST_CASE("a probe out of bounds is refused at start and never answered", "[prefill][probe]") {
  RecordingTransport transport;
  KvProber prober(transport, KvProbeShape{"fp", "f32", 2, 2, 16}, 1 << 20, "prefill-0");
  int caller = 0;
  for (auto [bytes, rounds] : {std::pair<int64_t, int32_t>{0, 1}, {kMaxKvProbeBytes + 1, 1}, {1, 0}, {1, 33}}) {
    Answer answer;
    CAPTURE(bytes, rounds);
    CHECK(prober.start(&caller, "10.0.0.9:1", bytes, rounds, answer.done()).code() == StatusCode::kInvalidArgument);
    CHECK_FALSE(answer.ready());
  }
}
