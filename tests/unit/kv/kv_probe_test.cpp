// KV probes (kv/kv_probe.h): the synthetic transfer's shape and chunks (random model shapes, fresh
// each run, checked by the receivers' own KvIncoming), the decode side's sink (the engine's
// refusals, the bounds), and probes over the tcp transport on loopback: they reach the sink and
// never the engine's receiver, which still gets real KV.
#include "kv/kv_probe.h"

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <random>

#include "baton/v1/worker.grpc.pb.h"
#include "kv/kv_incoming.h"
#include "kv/tcp/tcp_transport.h"
#include "tests/unit/grpc_loopback.h"
#include "tests/unit/kv/kv_transport_conformance.h"

using namespace baton;
using baton::testing::RecordingReceiver;

namespace {

KvProbeShape random_shape(std::mt19937_64& rng) {
  const char* dtypes[] = {"f32", "bf16", "f16"};
  return KvProbeShape{"fp-" + std::to_string(rng()), dtypes[rng() % 3], 1 + static_cast<int32_t>(rng() % 32),
                      1 + static_cast<int32_t>(rng() % 8), 8 * (1 + static_cast<int32_t>(rng() % 16))};
}

// Drains a source through KvIncoming, as a transport does; returns the K+V bytes.
int64_t drain_checked(const KvTransferHeader& h, KvSource& source, int64_t chunk_bytes) {
  RecordingReceiver receiver;
  KvIncoming incoming(receiver, &receiver);
  REQUIRE(incoming.begin(h).ok());
  KvChunk c;
  while (source.next(&c)) {
    CHECK(static_cast<int64_t>(c.k.size() + c.v.size()) <= std::max(chunk_bytes, 2 * kv_chunk_bytes(h, 1)));
    const Status s = incoming.chunk(c);
    REQUIRE(s.ok());
  }
  CHECK(incoming.end(0).ok());
  return incoming.bytes();
}

// A decode worker reduced to its KV receiving side, with or without a probe sink.
class KvOnlyDecodeService final : public baton::v1::DecodeWorker::CallbackService {
 public:
  KvOnlyDecodeService(KvReceiver& engine, KvReceiver* probe) : engine_(engine), probe_(probe) {}
  grpc::ServerReadReactor<baton::v1::KvMessage>* TransferKv(grpc::CallbackServerContext* context,
                                                            baton::v1::KvAck* response) override {
    return make_kv_receive_reactor(context, response, engine_, probe_);
  }

 private:
  KvReceiver& engine_;
  KvReceiver* probe_;
};

}  // namespace

TEST_CASE("a probe header holds the most whole tokens within the bytes asked for", "[kv][probe]") {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 200; ++trial) {
    const KvProbeShape shape = random_shape(rng);
    const int64_t bytes = 1 + static_cast<int64_t>(rng() % kMaxKvProbeBytes);
    const KvTransferHeader h = kv_probe_header(shape, bytes);
    CAPTURE(shape.dtype, shape.n_layers, shape.n_kv_heads, shape.head_dim, bytes);
    CHECK(h.probe);
    CHECK(h.request_id.rfind("probe-", 0) == 0);
    CHECK(h.model_fingerprint == shape.model_fingerprint);
    CHECK(static_cast<int64_t>(h.token_ids.size()) == h.n_tokens);
    const int64_t per_token = 2 * int64_t{shape.n_layers} * kv_chunk_bytes(h, 1);
    CHECK(kv_transfer_bytes(h) == per_token * h.n_tokens);
    if (bytes >= per_token) {
      CHECK(kv_transfer_bytes(h) <= bytes);
      CHECK(kv_transfer_bytes(h) + per_token > bytes);
    } else {
      CHECK(h.n_tokens == 1);
    }
  }
  CHECK(kv_probe_header(KvProbeShape{"fp", "f32", 2, 2, 16}, 1).request_id !=
        kv_probe_header(KvProbeShape{"fp", "f32", 2, 2, 16}, 1).request_id);
}

TEST_CASE("a probe's chunks pass the receivers' checks and respect the chunk size", "[kv][probe]") {
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 20; ++trial) {
    const KvProbeShape shape = random_shape(rng);
    const KvTransferHeader h = kv_probe_header(shape, 1 + static_cast<int64_t>(rng() % (8 << 20)));
    const int64_t chunk_bytes = 1024 + static_cast<int64_t>(rng() % (4 << 20));
    const int64_t row = kv_chunk_bytes(h, 1);
    const int64_t tokens = std::clamp<int64_t>(chunk_bytes / (2 * row), 1, h.n_tokens);
    std::string pattern(static_cast<size_t>(2 * tokens * row), '\0');
    for (char& c : pattern) c = static_cast<char>(rng());
    std::atomic<bool> cancel{false};
    KvProbeSource source(h, chunk_bytes, pattern, cancel);
    CHECK(drain_checked(h, source, chunk_bytes) == kv_transfer_bytes(h));
    CHECK(source.first_token() == 0);
  }
  SECTION("cancelled: no more chunks, and the transfer is abandoned") {
    const KvTransferHeader h = kv_probe_header(KvProbeShape{"fp", "f32", 4, 2, 16}, 1 << 20);
    std::string pattern(1 << 16, 'x');
    std::atomic<bool> cancel{false};
    KvProbeSource source(h, 1 << 15, pattern, cancel);
    KvChunk c;
    REQUIRE(source.next(&c));
    cancel = true;
    CHECK_FALSE(source.next(&c));
    CHECK_FALSE(source.first_token().has_value());
  }
}

TEST_CASE("probe limits are checked before anything is sent", "[kv][probe]") {
  CHECK(validate_kv_probe("127.0.0.1:1", 1, 1).ok());
  CHECK(validate_kv_probe("127.0.0.1:1", kMaxKvProbeBytes, kMaxKvProbeRounds).ok());
  for (auto [address, bytes, rounds] : {std::tuple<const char*, int64_t, int32_t>{"", 1, 1},
                                        {"a:1", 0, 1},
                                        {"a:1", kMaxKvProbeBytes + 1, 1},
                                        {"a:1", 1, 0},
                                        {"a:1", 1, kMaxKvProbeRounds + 1}}) {
    CAPTURE(address, bytes, rounds);
    CHECK(validate_kv_probe(address, bytes, rounds).code() == StatusCode::kInvalidArgument);
  }
}

TEST_CASE("the probe sink refuses what the engine would, and bounds probes", "[kv][probe]") {
  const KvProbeShape shape{"fp-decode", "bf16", 3, 2, 16};
  KvProbeSink sink(shape, "decode-0", nullptr);
  const KvTransferHeader good = kv_probe_header(shape, 4096);
  auto with = [&](auto change) {
    KvTransferHeader h = good;
    change(h);
    return sink.kv_begin(h);
  };
  Status s = with([](KvTransferHeader& h) { h.model_fingerprint = "fp-other"; });
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(s.message(), Catch::Contains("fp-other") && Catch::Contains("same model file"));
  s = with([](KvTransferHeader& h) { h.dtype = "f32"; });
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(s.message(), Catch::Contains("--kv-dtype"));
  CHECK(with([](KvTransferHeader& h) { h.n_kv_heads = 4; }).code() == StatusCode::kFailedPrecondition);
  CHECK(with([](KvTransferHeader& h) { h.probe = false; }).code() == StatusCode::kInvalidArgument);
  const int64_t per_token = kv_transfer_bytes(kv_probe_header(shape, 1));
  CHECK(with([&](KvTransferHeader& h) {
          h.n_tokens = static_cast<int32_t>(kMaxKvProbeBytes / per_token + 1);
        }).code() == StatusCode::kInvalidArgument);
  CHECK(with([&](KvTransferHeader& h) {
          h.n_tokens = static_cast<int32_t>(kMaxKvProbeBytes / per_token);
        }).ok());
  sink.kv_abort(good.request_id);
  CHECK(sink.n_in_flight() == 0);

  // At most kMaxKvProbesInFlight at once; an end or an abort frees a place.
  for (int i = 0; i < kMaxKvProbesInFlight; ++i) REQUIRE(sink.kv_begin(good).ok());
  CHECK(sink.kv_begin(good).code() == StatusCode::kResourceExhausted);
  CHECK(sink.kv_end(good.request_id, 0).ok());
  REQUIRE(sink.kv_begin(good).ok());
  sink.kv_abort(good.request_id);
  CHECK(sink.n_in_flight() == kMaxKvProbesInFlight - 1);
  CHECK(sink.n_received() == 1);
}

TEST_CASE("probes over tcp reach the sink, never the engine, real KV still reaches the engine", "[kv][probe]") {
  std::mt19937_64 rng(std::random_device{}());
  const KvProbeShape shape = random_shape(rng);
  RecordingReceiver engine;
  KvProbeSink sink(shape, "decode-0", nullptr);
  KvOnlyDecodeService service(engine, &sink);
  baton::testing::GrpcLoopback grpc(service);
  TcpKvTransport transport;
  const int32_t rounds = 1 + static_cast<int32_t>(rng() % 4);
  const int64_t bytes = 1 + static_cast<int64_t>(rng() % (3 << 20));
  std::atomic<bool> cancel{false};
  auto r = run_kv_probe(transport, grpc.address, shape, bytes, rounds, 1 << 20, cancel);
  REQUIRE(r.ok());
  CHECK(r->transport == "tcp");
  CHECK(r->seconds.size() == static_cast<size_t>(rounds));
  CHECK(r->latency_seconds.size() == static_cast<size_t>(rounds));
  CHECK(r->bytes == kv_transfer_bytes(kv_probe_header(shape, bytes)));
  CHECK(r->latency_bytes == kv_transfer_bytes(kv_probe_header(shape, 1)));
  for (double s : r->seconds) CHECK(s > 0);
  CHECK(sink.n_received() == 2 * rounds);
  CHECK(sink.n_in_flight() == 0);

  // The engine's receiver saw no probe; a real transfer still goes to it, not to the sink.
  auto payload = baton::testing::make_kv_payload(rng, "req-real");
  CHECK_FALSE(engine.has(payload.header.request_id));
  KvVectorSource source(payload.chunks, payload.first_token);
  int64_t sent = 0;
  REQUIRE(transport.send(grpc.address, payload.header, source, &sent).ok());
  CHECK(engine.get("req-real").ended);
  CHECK(sink.n_received() == 2 * rounds);

  SECTION("a probe another model's worker refuses fails with its refusal") {
    KvProbeShape other = shape;
    other.model_fingerprint = "fp-other";
    auto refused = run_kv_probe(transport, grpc.address, other, bytes, 1, 1 << 20, cancel);
    CHECK(refused.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(refused.status().message(), Catch::Contains("fp-other"));
  }
  SECTION("cancelled before it starts") {
    cancel = true;
    CHECK(run_kv_probe(transport, grpc.address, shape, bytes, 1, 1 << 20, cancel).status().code() ==
          StatusCode::kCancelled);
  }
}

TEST_CASE("a decode worker without a probe sink refuses probes", "[kv][probe]") {
  RecordingReceiver engine;
  KvOnlyDecodeService service(engine, nullptr);
  baton::testing::GrpcLoopback grpc(service);
  TcpKvTransport transport;
  std::atomic<bool> cancel{false};
  auto r = run_kv_probe(transport, grpc.address, KvProbeShape{"fp", "f32", 2, 2, 16}, 4096, 1, 1 << 20, cancel);
  CHECK(r.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(r.status().message(), Catch::Contains("takes no KV probes"));
}
