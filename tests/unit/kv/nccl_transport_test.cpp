// The nccl KV transport's control plane, without a GPU: the reservation that comes before any
// ncclGetUniqueId, the sender's memory of lasting refusals, its dropping of decode workers, and
// the receiver's reservations. What moves bytes runs on GPUs (tests/gpu/kv_transport_test.cpp).
#include "kv/nccl/nccl_transport.h"
#include "tests/common/test_skip.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <thread>

#include "baton/v1/worker.grpc.pb.h"
#include "common/grpc_status.h"
#include "kv/nccl/nccl_api.h"
#include "tests/unit/grpc_loopback.h"
#include "tests/unit/kv/kv_transport_conformance.h"

using namespace baton;
using SysClock = std::chrono::system_clock;

namespace {

// A decode worker whose BootstrapNccl answers `answer` to every call, counting them.
class RefusingKvDevice final : public v1::DecodeKvDevice::Service {
 public:
  explicit RefusingKvDevice(grpc::Status answer) : answer_(std::move(answer)) {}
  grpc::Status BootstrapNccl(grpc::ServerContext*, const v1::NcclBootstrapRequest* request,
                             v1::NcclBootstrapResponse*) override {
    ++n_calls;
    if (!request->unique_id().empty()) ++n_with_id;
    return answer_;
  }

  std::atomic<int> n_calls{0};
  std::atomic<int> n_with_id{0};  // bootstraps proper: the sender made an ncclUniqueId first

 private:
  const grpc::Status answer_;
};

struct RefusingServer {
  explicit RefusingServer(grpc::Status answer) : service(std::move(answer)), grpc(service), address(grpc.address) {}

  RefusingKvDevice service;
  testing::GrpcLoopback grpc;
  const std::string address;
};

// NCCL is loaded at run time; without it both ends refuse before anything tested here, so the
// test is skipped (and reported so, by name: tests/common/test_skip.h). Empty when loadable.
std::string nccl_missing() {
  std::string error;
  return nccl_load(&error) != nullptr ? std::string() : "libnccl cannot be loaded: " + error;
}

Status send_one(NcclKvTransport& transport, const std::string& address) {
  std::mt19937_64 rng(std::random_device{}());
  const testing::KvPayload p = testing::make_kv_payload(rng, "nccl-" + std::to_string(rng()));
  int64_t bytes = -1;
  const Status s = transport.send(address, p.header, *testing::chunk_source(p), &bytes);
  CHECK(bytes == 0);
  CHECK(s.message().find(p.header.request_id) != std::string::npos);
  CHECK(s.message().find(address) != std::string::npos);
  return s;
}

}  // namespace

TEST_CASE("nccl sender does not ask a decode worker without CUDA, a GPU or NCCL again for refusal_ttl", "[kv][nccl]") {
  if (const std::string why = nccl_missing(); !why.empty()) BATON_SKIP(why);
  const grpc::StatusCode code = GENERATE(grpc::StatusCode::UNIMPLEMENTED, grpc::StatusCode::FAILED_PRECONDITION);
  const StatusCode expected = from_grpc(grpc::Status(code, "x")).code();
  RefusingServer server(grpc::Status(code, "this decode worker cannot take part"));
  NcclKvConfig config;
  config.refusal_ttl = std::chrono::milliseconds(400);
  NcclKvTransport transport(config);

  CHECK(send_one(transport, server.address).code() == expected);
  CHECK(server.service.n_calls == 1);
  CHECK(server.service.n_with_id == 0);  // refused at the reservation: no ncclGetUniqueId was made

  const auto t0 = std::chrono::steady_clock::now();
  const Status again = send_one(transport, server.address);
  CHECK(again.code() == expected);
  CHECK(again.message().find("cannot take part") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(200));
  CHECK(server.service.n_calls == 1);

  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  CHECK(send_one(transport, server.address).code() == expected);
  CHECK(server.service.n_calls == 2);
  CHECK(server.service.n_with_id == 0);
}

TEST_CASE("nccl sender asks again after a refusal that may pass", "[kv][nccl]") {
  if (const std::string why = nccl_missing(); !why.empty()) BATON_SKIP(why);
  RefusingServer server(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "every session busy"));
  NcclKvTransport transport(NcclKvConfig{});
  CHECK(send_one(transport, server.address).code() == StatusCode::kResourceExhausted);
  CHECK(send_one(transport, server.address).code() == StatusCode::kResourceExhausted);
  CHECK(server.service.n_calls == 2);
  CHECK(server.service.n_with_id == 0);
}

TEST_CASE("nccl sender drops decode workers that are unavailable, idle or beyond max_peers", "[kv][nccl]") {
  if (const std::string why = nccl_missing(); !why.empty()) BATON_SKIP(why);
  const grpc::Status busy(grpc::StatusCode::RESOURCE_EXHAUSTED, "every session busy");
  RefusingServer a(busy), b(busy), c(busy);

  SECTION("unavailable") {
    NcclKvTransport transport(NcclKvConfig{});
    CHECK(send_one(transport, testing::unused_loopback_address()).code() == StatusCode::kUnavailable);
    CHECK(transport.n_peers() == 0);
    CHECK(send_one(transport, a.address).code() == StatusCode::kResourceExhausted);
    CHECK(transport.n_peers() == 1);  // a refusal that may pass keeps the peer
  }
  SECTION("beyond max_peers, the least recently used") {
    NcclKvConfig config;
    config.max_peers = 2;
    NcclKvTransport transport(config);
    (void)send_one(transport, a.address);
    (void)send_one(transport, b.address);
    CHECK(transport.n_peers() == 2);
    (void)send_one(transport, c.address);
    CHECK(transport.n_peers() == 2);
  }
  SECTION("idle past the TTL") {
    NcclKvConfig config;
    config.peer_idle_ttl = std::chrono::milliseconds(0);
    NcclKvTransport transport(config);
    (void)send_one(transport, a.address);
    (void)send_one(transport, b.address);
    CHECK(transport.n_peers() == 1);  // a went when b's send began; b stays until the next send
  }
}

TEST_CASE("nccl receiver reserves a session before the sender makes an id, and lets it expire", "[kv][nccl]") {
  if (const std::string why = nccl_missing(); !why.empty()) BATON_SKIP(why);
  NcclReceiverConfig config;
  config.max_sessions = 2;
  config.init_timeout = std::chrono::milliseconds(300);  // also the longest a reservation lives
  NcclReceiver receiver(config);
  const auto later = SysClock::now() + std::chrono::seconds(30);
  const v1::NcclBootstrapRequest reserve;
  const Result<std::string> a = receiver.bootstrap(reserve, later);
  const Result<std::string> b = receiver.bootstrap(reserve, later);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(*a != *b);
  // Every slot reserved: the next sender is refused before it makes an id.
  CHECK(receiver.bootstrap(reserve, later).status().code() == StatusCode::kResourceExhausted);

  v1::NcclBootstrapRequest named;
  named.set_session("mine");
  CHECK(receiver.bootstrap(named, later).status().code() == StatusCode::kInvalidArgument);
  v1::NcclBootstrapRequest unreserved;
  unreserved.set_unique_id(std::string(sizeof(ncclUniqueId), '\0'));
  unreserved.set_session("never-reserved");
  CHECK(receiver.bootstrap(unreserved, later).status().code() == StatusCode::kNotFound);
  v1::KvDeviceOpen open;
  open.set_transport("nccl");
  open.set_nccl_session(*a);
  CHECK(receiver.open(open, later, nullptr).status().code() == StatusCode::kNotFound);  // reserved, not bootstrapped

  // The bootstrap proper, once; its init fails here (no GPU, or an id no rank 0 stands behind),
  // which the open reports, tearing the session down.
  v1::NcclBootstrapRequest boot = unreserved;
  boot.set_session(*a);
  const Result<std::string> booted = receiver.bootstrap(boot, later);
  REQUIRE(booted.ok());
  CHECK(*booted == *a);
  CHECK(receiver.bootstrap(boot, later).status().code() == StatusCode::kInvalidArgument);
  CHECK(receiver.open(open, SysClock::now() + std::chrono::seconds(10), nullptr).status().code() ==
        StatusCode::kUnavailable);

  // b's reservation expires unused: its slot and a's are free again, and b cannot be bootstrapped.
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  boot.set_session(*b);
  CHECK(receiver.bootstrap(boot, later).status().code() == StatusCode::kNotFound);
  CHECK(receiver.bootstrap(reserve, later).ok());
  CHECK(receiver.bootstrap(reserve, later).ok());
}
