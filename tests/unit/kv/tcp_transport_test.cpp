// The tcp KV transport over real gRPC on loopback: the conformance suite, then what is specific
// to the TransferKv stream (malformed streams crafted with the stub, cancellation, deadline).
#include "kv/tcp/tcp_transport.h"

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>

#include "baton/v1/worker.grpc.pb.h"
#include "tests/unit/grpc_loopback.h"
#include "tests/unit/kv/kv_transport_conformance.h"

using namespace baton;
using baton::testing::RecordingReceiver;

namespace {

// A decode worker reduced to its KV receiving side.
class KvOnlyDecodeService final : public baton::v1::DecodeWorker::CallbackService {
 public:
  explicit KvOnlyDecodeService(KvReceiver& receiver) : receiver_(receiver) {}
  grpc::ServerReadReactor<baton::v1::KvMessage>* TransferKv(grpc::CallbackServerContext* context,
                                                            baton::v1::KvAck* response) override {
    return make_kv_receive_reactor(context, response, receiver_);
  }

 private:
  KvReceiver& receiver_;
};

struct LoopbackServer {
  LoopbackServer() : service(receiver), grpc(service), address(grpc.address) {}

  RecordingReceiver receiver;
  KvOnlyDecodeService service;
  baton::testing::GrpcLoopback grpc;
  const std::string address;
};

baton::v1::KvMessage header_message(const KvTransferHeader& h) {
  baton::v1::KvMessage m;
  kv_header_to_proto(h, m.mutable_header());
  return m;
}

baton::v1::KvMessage chunk_message(KvChunk c) {
  baton::v1::KvMessage m;
  kv_chunk_to_proto(std::move(c), m.mutable_chunk());
  return m;
}

// Sends `messages` raw over TransferKv and returns the call's status.
grpc::Status send_raw(const std::string& address, const std::vector<baton::v1::KvMessage>& messages) {
  auto stub = baton::v1::DecodeWorker::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  baton::v1::KvAck ack;
  auto writer = stub->TransferKv(&context, &ack);
  for (const auto& m : messages) {
    if (!writer->Write(m)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

}  // namespace

TEST_CASE("tcp transport passes the KvTransport conformance suite", "[kv][tcp]") {
  LoopbackServer server;
  TcpKvTransport transport;
  CHECK(transport.name() == "tcp");
  baton::testing::run_kv_transport_conformance(transport, server.address, server.receiver,
                                               baton::testing::unused_loopback_address());
}

TEST_CASE("tcp transport gives up at its deadline", "[kv][tcp]") {
  LoopbackServer server;
  const auto deadline = std::chrono::milliseconds(100);
  TcpKvTransport transport(nullptr, deadline);
  baton::testing::run_kv_transport_deadline(transport, deadline, server.address, server.receiver);
}

TEST_CASE("TransferKv refuses malformed streams", "[kv][tcp]") {
  LoopbackServer server;
  std::mt19937_64 rng(std::random_device{}());
  auto p = baton::testing::make_kv_payload(rng, "malformed-" + std::to_string(rng()));
  const std::string id = p.header.request_id;

  SECTION("a chunk before the header") {
    const grpc::Status s = send_raw(server.address, {chunk_message(p.chunks[0])});
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_FALSE(server.receiver.has(id));
  }
  SECTION("an empty stream") {
    CHECK(send_raw(server.address, {}).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  }
  SECTION("a header whose token ids disagree with n_tokens") {
    p.header.token_ids.push_back(1);
    CHECK(send_raw(server.address, {header_message(p.header)}).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_FALSE(server.receiver.has(id));
  }
  SECTION("an unknown dtype") {
    p.header.dtype = "q4_0";
    CHECK(send_raw(server.address, {header_message(p.header)}).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  }
  SECTION("a second header") {
    CHECK(send_raw(server.address, {header_message(p.header), header_message(p.header)}).error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(server.receiver.wait_aborted(id));
  }
  SECTION("a chunk of the wrong size (checksum recomputed, so only the size is wrong)") {
    KvChunk c = p.chunks[0];
    c.k.pop_back();
    c.checksum = kv_checksum(c.k, c.v);
    CHECK(send_raw(server.address, {header_message(p.header), chunk_message(c)}).error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(server.receiver.wait_aborted(id));
  }
  SECTION("a layer outside the header") {
    KvChunk c = p.chunks[0];
    c.layer = p.header.n_layers;
    CHECK(send_raw(server.address, {header_message(p.header), chunk_message(c)}).error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(server.receiver.wait_aborted(id));
  }
  SECTION("a chunk sent twice (overlapping token range)") {
    CHECK(send_raw(server.address, {header_message(p.header), chunk_message(p.chunks[0]), chunk_message(p.chunks[0])})
              .error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(server.receiver.wait_aborted(id));
  }
  SECTION("a bad checksum") {
    KvChunk c = p.chunks[0];
    c.checksum ^= 1;
    CHECK(send_raw(server.address, {header_message(p.header), chunk_message(c)}).error_code() ==
          grpc::StatusCode::DATA_LOSS);
    CHECK(server.receiver.wait_aborted(id));
  }
  std::vector<baton::v1::KvMessage> whole = {header_message(p.header)};
  for (const KvChunk& c : p.chunks) whole.push_back(chunk_message(c));
  baton::v1::KvMessage end;
  end.mutable_end()->set_first_token(p.first_token);
  SECTION("every chunk but no end") {
    CHECK(send_raw(server.address, whole).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(server.receiver.wait_aborted(id));
    CHECK_FALSE(server.receiver.get(id).ended);
  }
  SECTION("an end before the last chunk") {
    std::vector<baton::v1::KvMessage> early = whole;
    early.insert(early.end() - 1, end);
    CHECK(send_raw(server.address, early).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(server.receiver.wait_aborted(id));
  }
  SECTION("an end before the header") {
    CHECK(send_raw(server.address, {end}).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_FALSE(server.receiver.has(id));
  }
  SECTION("the whole stream, sent raw, is acknowledged with its byte count") {
    whole.push_back(end);
    CHECK(send_raw(server.address, whole).ok());
    baton::testing::check_arrived_intact(server.receiver.get(id), p);
  }
}

TEST_CASE("TransferKv aborts the receiver when the sender cancels mid-stream", "[kv][tcp]") {
  LoopbackServer server;
  std::mt19937_64 rng(std::random_device{}());
  auto p = baton::testing::make_kv_payload(rng, "cancelled-" + std::to_string(rng()));
  auto stub = baton::v1::DecodeWorker::NewStub(grpc::CreateChannel(server.address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  baton::v1::KvAck ack;
  auto writer = stub->TransferKv(&context, &ack);
  REQUIRE(writer->Write(header_message(p.header)));
  // The header reached the receiver before the cancel.
  for (int i = 0; i < 500 && !server.receiver.has(p.header.request_id); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  REQUIRE(server.receiver.has(p.header.request_id));
  context.TryCancel();
  CHECK(writer->Finish().error_code() == grpc::StatusCode::CANCELLED);
  CHECK(server.receiver.wait_aborted(p.header.request_id));
  CHECK_FALSE(server.receiver.get(p.header.request_id).ended);
}

TEST_CASE("tcp transport: chunk sizes against gRPC's default 4 MiB message limit", "[kv][tcp]") {
  LoopbackServer server;  // built with gRPC's defaults, like a decode worker that sets no limit
  TcpKvTransport transport;
  std::mt19937_64 rng(std::random_device{}());
  for (const int64_t kv_bytes : {int64_t{2} << 20, int64_t{5} << 20}) {
    KvTransferHeader h;
    h.request_id = "big-" + std::to_string(kv_bytes);
    h.model_fingerprint = "fp";
    h.dtype = "f32";
    h.n_layers = 1;
    h.n_kv_heads = 8;
    h.head_dim = 128;  // 4 KiB per token of K
    h.n_tokens = static_cast<int32_t>(kv_bytes / 2 / kv_chunk_bytes(h, 1));
    h.token_ids.assign(h.n_tokens, 7);
    KvChunk c;
    c.token_count = h.n_tokens;
    c.k.resize(static_cast<size_t>(kv_chunk_bytes(h, h.n_tokens)));
    c.v.resize(c.k.size());
    for (char& x : c.k) x = static_cast<char>(rng());
    c.checksum = kv_checksum(c.k, c.v);
    const std::vector<KvChunk> chunks = {c};
    int64_t bytes = 0;
    const Status s = transport.send(server.address, h, *baton::testing::chunk_source(chunks, 1), &bytes);
    INFO(kv_bytes << " bytes of K+V in one chunk: " << s.to_string());
    if (kv_bytes < (int64_t{4} << 20)) {
      CHECK(s.ok());
      CHECK(server.receiver.get(h.request_id).chunks.at(0).k == c.k);
    } else {
      // Over the receiving server's message limit: senders must keep chunks smaller (the prefill
      // worker's kv_chunk_bytes) or the decode worker's server must raise the limit.
      CHECK(s.code() == StatusCode::kResourceExhausted);
    }
  }
}
