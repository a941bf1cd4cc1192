// The decode worker's gRPC service on loopback: Admit, Stream, TransferKv (through the tcp KV
// transport), Release and GetLoad, with a synchronous client. The stream must carry the same
// tokens as single-process generation; cancelling the call or letting its deadline pass ends the
// request on the worker and frees its blocks.
#include "decode_worker/decode_service.h"

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>

#include "common/grpc_status.h"
#include "kv/tcp/tcp_transport.h"
#include "tests/unit/decode_worker/decode_test_util.h"

using namespace baton;
using namespace baton::decode_test;
using namespace std::chrono_literals;

namespace {

struct Server {
  explicit Server(Fixture& fx) : service(*fx.engine, *fx.dec.model) {
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&service);
    server = b.BuildAndStart();
    REQUIRE(server);
    REQUIRE(port > 0);
    address = "127.0.0.1:" + std::to_string(port);
    stub = v1::DecodeWorker::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  }
  ~Server() { server->Shutdown(std::chrono::system_clock::now() + 1s); }

  grpc::Status admit(const std::string& id, int n_prompt, int max_tokens, const SamplingParams& sp,
                     const std::string& fingerprint, v1::AdmitResponse* resp = nullptr, bool ignore_eos = false) {
    v1::AdmitRequest req;
    req.set_request_id(id);
    req.set_n_prompt_tokens(n_prompt);
    req.set_max_tokens(max_tokens);
    req.mutable_sampling()->set_temperature(sp.temperature);
    req.mutable_sampling()->set_top_k(sp.top_k);
    req.mutable_sampling()->set_top_p(sp.top_p);
    req.mutable_sampling()->set_seed(sp.seed);
    req.set_model_fingerprint(fingerprint);
    req.set_ignore_eos(ignore_eos);
    v1::AdmitResponse local;
    grpc::ClientContext ctx;
    return stub->Admit(&ctx, req, resp ? resp : &local);
  }

  Status transfer(const Transfer& t) {
    int64_t bytes = 0;
    KvVectorSource source(t.chunks, t.first_token);
    return kv.send(address, t.header, source, &bytes);
  }

  DecodeService service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
  std::unique_ptr<v1::DecodeWorker::Stub> stub;
  TcpKvTransport kv;
};

// Everything one Stream call returned.
struct StreamResult {
  std::vector<int32_t> tokens;
  std::vector<v1::DecodeEvent> events;
  grpc::Status status;
};

StreamResult read_all(grpc::ClientReader<v1::DecodeEvent>& reader) {
  StreamResult r;
  v1::DecodeEvent e;
  while (reader.Read(&e)) {
    r.tokens.insert(r.tokens.end(), e.token_ids().begin(), e.token_ids().end());
    r.events.push_back(e);
  }
  r.status = reader.Finish();
  return r;
}

}  // namespace

TEST_CASE("Admit, TransferKv and Stream over gRPC give single-process tokens", "[decode][grpc]") {
  Fixture fx;
  Server srv(fx);

  v1::LoadReport load;
  {
    grpc::ClientContext ctx;
    REQUIRE(srv.stub->GetLoad(&ctx, v1::LoadRequest{}, &load).ok());
  }
  CHECK(load.model_fingerprint() == fx.fingerprint());
  CHECK(load.model().fingerprint() == fx.fingerprint());
  CHECK(load.model().architecture() == "llama");
  CHECK(load.model().vocab_size() == fx.vocab());
  CHECK(load.model().context_length() == fx.ref.model->config().n_ctx);
  CHECK(load.total_blocks() == 256);
  CHECK(load.free_blocks() == 256);
  CHECK(load.block_size() == 8);
  CHECK_FALSE(load.draining());

  for (const bool greedy : {true, false}) {
    const SamplingParams sp = greedy ? SamplingParams{} : seeded();
    const auto prompt = random_prompt(1 + static_cast<int>(rnd() % 40), fx.vocab());
    const int max_tokens = 2 + static_cast<int>(rnd() % 30);
    const std::string id = greedy ? "g" : "s";
    INFO(id << " seed " << sp.seed);
    const GenerateResult want = reference(fx, prompt, max_tokens, sp);
    const Transfer t = prefill(*fx.ref.model, id, prompt, sp, 5);

    v1::AdmitResponse ar;
    REQUIRE(srv.admit(id, static_cast<int>(prompt.size()), max_tokens, sp, fx.fingerprint(), &ar).ok());
    CHECK(ar.reserved_blocks() == (static_cast<int64_t>(prompt.size()) + max_tokens + 7) / 8);

    grpc::ClientContext ctx;
    v1::StreamRequest sr;
    sr.set_request_id(id);
    auto reader = srv.stub->Stream(&ctx, sr);
    REQUIRE(srv.transfer(t).ok());
    const StreamResult r = read_all(*reader);
    REQUIRE(r.status.ok());
    REQUIRE(!r.events.empty());
    CHECK(r.tokens == std::vector<int32_t>(want.tokens.begin() + 1, want.tokens.end()));
    CHECK(r.events.back().done());
    CHECK(r.events.back().finish_reason() ==
          (want.finish_reason == "stop" ? v1::FINISH_REASON_STOP : v1::FINISH_REASON_LENGTH));
    for (size_t i = 0; i + 1 < r.events.size(); ++i) CHECK_FALSE(r.events[i].done());
    CHECK(r.events.front().kv_transfer_seconds() > 0);
  }
  check_all_free(*fx.engine);
}

TEST_CASE("gRPC refusals keep their codes", "[decode][grpc]") {
  Fixture fx;
  Server srv(fx);
  CHECK(srv.admit("x", 10, 5, {}, "other-model").error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(srv.admit("x", 10, 100000, {}, fx.fingerprint()).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(srv.admit("x", 10, 1020, {}, fx.fingerprint()).error_code() ==
        grpc::StatusCode::INVALID_ARGUMENT);  // > context

  // Stream of an unknown request.
  grpc::ClientContext ctx;
  v1::StreamRequest sr;
  sr.set_request_id("nope");
  auto reader = srv.stub->Stream(&ctx, sr);
  CHECK(read_all(*reader).status.error_code() == grpc::StatusCode::NOT_FOUND);

  // KV for a request that was never admitted, and KV of another shape.
  const auto prompt = random_prompt(12, fx.vocab());
  Transfer t = prefill(*fx.ref.model, "y", prompt, {}, 4);
  CHECK(srv.transfer(t).code() == StatusCode::kFailedPrecondition);
  REQUIRE(srv.admit("y", 12, 5, {}, fx.fingerprint()).ok());
  t.header.n_tokens = 11;
  t.header.token_ids.pop_back();
  // Refused for that reason, not for any other (a closed port or a checksum would also be "not ok").
  const Status shape = srv.transfer(t);
  CHECK(shape.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(shape.message(), Catch::Contains("covers 11 tokens but 12 were admitted"));

  // Release frees the reservation.
  CHECK(fx.engine->load().free_blocks < fx.engine->load().total_blocks);
  grpc::ClientContext rctx;
  v1::ReleaseRequest rr;
  rr.set_request_id("y");
  v1::ReleaseResponse rresp;
  CHECK(srv.stub->Release(&rctx, rr, &rresp).ok());
  check_all_free(*fx.engine);
}

TEST_CASE("cancelling the Stream call or its deadline frees the request", "[decode][grpc]") {
  Fixture fx;
  Server srv(fx);
  const auto prompt = random_prompt(16, fx.vocab());

  SECTION("client cancels mid-stream") {
    const Transfer t = prefill(*fx.ref.model, "c", prompt, {}, 8);
    REQUIRE(srv.admit("c", 16, 1000, {}, fx.fingerprint(), nullptr, /*ignore_eos=*/true).ok());
    grpc::ClientContext ctx;
    v1::StreamRequest sr;
    sr.set_request_id("c");
    auto reader = srv.stub->Stream(&ctx, sr);
    REQUIRE(srv.transfer(t).ok());
    v1::DecodeEvent e;
    REQUIRE(reader->Read(&e));
    ctx.TryCancel();
    while (reader->Read(&e)) {
    }
    CHECK(reader->Finish().error_code() == grpc::StatusCode::CANCELLED);
    check_all_free(*fx.engine);
  }
  SECTION("the call's deadline passes while the KV never comes") {
    REQUIRE(srv.admit("d", 16, 50, {}, fx.fingerprint()).ok());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 100ms);
    v1::StreamRequest sr;
    sr.set_request_id("d");
    auto reader = srv.stub->Stream(&ctx, sr);
    CHECK(read_all(*reader).status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED);
    check_all_free(*fx.engine);
    // The reservation went with it: late KV is refused.
    CHECK(srv.transfer(prefill(*fx.ref.model, "d", prompt, {}, 8)).code() == StatusCode::kFailedPrecondition);
  }
}

TEST_CASE("a refused Stream call, cancelled or expired, leaves the request it named alone", "[decode][grpc]") {
  Fixture fx;
  Server srv(fx);
  const auto prompt = random_prompt(16, fx.vocab());
  const int max_tokens = 40;
  REQUIRE(srv.admit("v", 16, max_tokens, {}, fx.fingerprint(), nullptr, /*ignore_eos=*/true).ok());
  grpc::ClientContext owner_ctx;
  v1::StreamRequest sr;
  sr.set_request_id("v");
  auto owner = srv.stub->Stream(&owner_ctx, sr);  // attached, waiting for its KV
  std::this_thread::sleep_for(100ms);

  // More calls for the same request are refused (it has its stream). Each is then cancelled at
  // once, racing the refusal (the server sees many of those cancels), or left to its deadline.
  for (int i = 0; i < 100; ++i) {
    grpc::ClientContext ctx;
    const bool by_deadline = i % 10 == 9;
    if (by_deadline) ctx.set_deadline(std::chrono::system_clock::now() + 20ms);
    auto intruder = srv.stub->Stream(&ctx, sr);
    if (!by_deadline) ctx.TryCancel();
    const StreamResult r = read_all(*intruder);
    CHECK(r.tokens.empty());
    CHECK(r.status.error_code() != grpc::StatusCode::OK);
  }
  // The request is still the owner's: its KV is taken and every token after the first (which
  // the prefill worker sampled) comes.
  REQUIRE(srv.transfer(prefill(*fx.ref.model, "v", prompt, {}, max_tokens)).ok());
  const StreamResult r = read_all(*owner);
  CHECK(r.status.ok());
  CHECK(r.tokens.size() == static_cast<size_t>(max_tokens - 1));
  check_all_free(*fx.engine);
}
