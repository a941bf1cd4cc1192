// The PrefillWorker gRPC service over real loopback gRPC, on the random test model with an
// in-process recording transport: the event stream, validation naming fields, cancellation,
// transport failures and GetLoad; then the engine over the real tcp transport.
#include "prefill_worker/prefill_service.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <random>
#include <set>
#include <thread>

#include "kv/prefix_hash.h"
#include "kv/tcp/tcp_transport.h"
#include "model/generator.h"
#include "model/test_model.h"
#include "tests/unit/kv/kv_transport_conformance.h"
#include "tests/unit/prefill_worker/recording_transport.h"
#include "tests/unit/test_model_fixture.h"

using namespace baton;
using baton::testing::RecordingTransport;

namespace {

struct ServiceFixture : testing::LoadedTestModel {
  explicit ServiceFixture(bool start_engine = true) : LoadedTestModel(TestModelSpec{}) {
    PrefillConfig config;
    config.token_budget = 32;
    engine = std::make_unique<PrefillEngine>(*model, transport, config);
    if (start_engine) engine->start();
    service = std::make_unique<PrefillService>(*engine, *model);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service.get());
    server = builder.BuildAndStart();
    REQUIRE(server);
    stub = baton::v1::PrefillWorker::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  }
  ~ServiceFixture() {
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    engine->stop();
  }

  RecordingTransport transport;
  std::unique_ptr<PrefillEngine> engine;
  std::unique_ptr<PrefillService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<baton::v1::PrefillWorker::Stub> stub;
};

struct CallResult {
  std::vector<baton::v1::PrefillEvent> events;  // but Progress
  int n_progress = 0;
  grpc::Status status;
};

CallResult prefill(baton::v1::PrefillWorker::Stub& stub, const baton::v1::PrefillRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto reader = stub.Prefill(&context, request);
  CallResult r;
  baton::v1::PrefillEvent event;
  // Progress events (one per chunk of a prompt longer than a step takes) come first, counting
  // up and short of the prompt; the rest is what a test compares.
  int32_t done = 0;
  while (reader->Read(&event)) {
    if (event.has_progress()) {
      CHECK(r.events.empty());
      CHECK(event.progress().tokens_done() >= done);  // 0 while queued
      CHECK(event.progress().tokens_done() < request.prompt_token_ids_size());
      done = event.progress().tokens_done();
      ++r.n_progress;
      continue;
    }
    r.events.push_back(event);
  }
  r.status = reader->Finish();
  return r;
}

baton::v1::PrefillRequest make_request(std::mt19937& rng, const std::string& id, int n, int vocab) {
  baton::v1::PrefillRequest r;
  r.set_request_id(id);
  for (int i = 0; i < n; ++i) r.add_prompt_token_ids(static_cast<int32_t>(rng() % vocab));
  r.mutable_sampling()->set_temperature(0.8f);
  r.mutable_sampling()->set_seed(rng());
  r.set_decode_address("decode-0:7000");
  return r;
}

}  // namespace

TEST_CASE("prefill service streams the first token, then KvSent", "[prefill][service]") {
  ServiceFixture fx;
  std::mt19937 rng(std::random_device{}());
  const auto request = make_request(rng, "s1", 10 + static_cast<int>(rng() % 60), fx.model->config().n_vocab);
  const CallResult r = prefill(*fx.stub, request);
  INFO(r.status.error_message());
  REQUIRE(r.status.ok());
  REQUIRE(r.events.size() == 2);
  REQUIRE(r.events[0].has_first_token());
  REQUIRE(r.events[1].has_kv_sent());
  CHECK(r.events[0].first_token().prefill_seconds() > 0);
  CHECK(r.events[1].kv_sent().bytes() > 0);

  fx.engine->stop();  // the reference runs the same model: no engine step may run alongside it
  GenerateOptions opt;
  opt.max_tokens = 1;
  opt.sampling.temperature = request.sampling().temperature();
  opt.sampling.seed = request.sampling().seed();
  Generator gen(*fx.model);
  const auto g = gen.generate({request.prompt_token_ids().begin(), request.prompt_token_ids().end()}, opt);
  REQUIRE(g.ok());
  CHECK(r.events[0].first_token().token_id() == g->tokens[0]);
  const auto sent = fx.transport.get("s1");
  CHECK(sent.address == "decode-0:7000");
  CHECK(sent.first_token == g->tokens[0]);
  CHECK(sent.header.model_fingerprint == fx.model->fingerprint());
}

TEST_CASE("prefill service: a prompt longer than a step reports each chunk before its first token, GetLoad its speed",
          "[prefill][service][progress]") {
  ServiceFixture fx;  // 32 tokens a step
  std::mt19937 rng(std::random_device{}());
  const int n = 32 * 3 + 1 + static_cast<int>(rng() % 31);  // 4 steps, the last one partial
  const CallResult r = prefill(*fx.stub, make_request(rng, "long", n, fx.model->config().n_vocab));
  REQUIRE(r.status.ok());
  REQUIRE(r.events.size() == 2);
  CHECK(r.events[0].has_first_token());
  // Three chunks finish short of the prompt (queued replacements may merge two of them).
  CHECK(r.n_progress >= 1);
  grpc::ClientContext ctx;
  baton::v1::LoadReport load;
  REQUIRE(fx.stub->GetLoad(&ctx, baton::v1::LoadRequest(), &load).ok());
  CHECK(load.step_seconds() > 0);
  CHECK(load.prefill_tokens_per_second() > 0);
  // Its step schedule: the budget, a fitted step time, and no step running once idle.
  CHECK(load.step_token_budget() == 32);
  CHECK(load.step_seconds_per_token() > 0);
  CHECK(load.step_fixed_seconds() >= 0);
  CHECK(load.step_tokens_in_progress() == 0);
  CHECK(load.step_elapsed_seconds() == 0);
}

TEST_CASE("prefill service: a repeated prompt's first token counts its cached tokens, GetLoad names the blocks",
          "[prefill][service][prefix]") {
  ServiceFixture fx;
  std::mt19937 rng(std::random_device{}());
  const int bs = fx.engine->config().block_size;
  const int n = bs * (1 + static_cast<int>(rng() % 4)) + 1 + static_cast<int>(rng() % bs);
  auto request = make_request(rng, "r1", n, fx.model->config().n_vocab);
  const CallResult first = prefill(*fx.stub, request);
  REQUIRE(first.status.ok());
  REQUIRE(first.events.at(0).has_first_token());
  CHECK(first.events[0].first_token().cached_tokens() == 0);
  request.set_request_id("r2");
  const CallResult again = prefill(*fx.stub, request);
  REQUIRE(again.status.ok());
  REQUIRE(again.events.at(0).has_first_token());
  CHECK(again.events[0].first_token().cached_tokens() == (n - 1) / bs * bs);
  CHECK(again.events[0].first_token().token_id() == first.events[0].first_token().token_id());  // same seed

  baton::v1::LoadReport load;
  grpc::ClientContext ctx;
  REQUIRE(fx.stub->GetLoad(&ctx, baton::v1::LoadRequest(), &load).ok());
  const std::vector<int32_t> ids(request.prompt_token_ids().begin(), request.prompt_token_ids().end());
  const uint64_t seed = prefix_hash_seed(fx.model->fingerprint(), "f32", bs);
  const auto hashes = prefix_block_hashes(seed, bs, ids);
  CHECK(load.prefix_hash_seed() == seed);
  CHECK(load.prefix_cache_blocks() == load.total_blocks());
  CHECK(load.cached_blocks() == static_cast<int32_t>(hashes.size()));
  CHECK(std::set<uint64_t>(load.cached_block_hashes().begin(), load.cached_block_hashes().end()) ==
        std::set<uint64_t>(hashes.begin(), hashes.end()));
  CHECK(load.free_blocks() == load.total_blocks());
}

TEST_CASE("prefill service refuses bad requests naming the field", "[prefill][service]") {
  ServiceFixture fx;
  std::mt19937 rng(std::random_device{}());
  const int vocab = fx.model->config().n_vocab;
  auto expect = [&](baton::v1::PrefillRequest req, const std::string& field) {
    const CallResult r = prefill(*fx.stub, req);
    INFO(field << ": " << r.status.error_message());
    CHECK(r.status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(r.status.error_message().find(field) != std::string::npos);
    CHECK(r.events.empty());
  };
  auto req = make_request(rng, "bad", 5, vocab);
  req.clear_prompt_token_ids();
  expect(req, "prompt_token_ids");
  req = make_request(rng, "bad", 5, vocab);
  req.set_prompt_token_ids(2, vocab);
  expect(req, "prompt_token_ids[2]");
  req = make_request(rng, "bad", 5, vocab);
  req.add_generated_token_ids(-3);
  expect(req, "generated_token_ids[0]");
  req = make_request(rng, "bad", fx.model->config().n_ctx, vocab);
  expect(req, "context");
  req = make_request(rng, "bad", 5, vocab);
  req.mutable_sampling()->set_top_p(1.5f);
  expect(req, "sampling.top_p");
  req = make_request(rng, "bad", 5, vocab);
  req.mutable_sampling()->set_temperature(-1);
  expect(req, "sampling.temperature");
  req = make_request(rng, "bad", 5, vocab);
  req.clear_decode_address();
  expect(req, "decode_address");
  req = make_request(rng, "", 5, vocab);
  expect(req, "request_id");
}

TEST_CASE("prefill service: a transport failure ends the call with its code after the first token",
          "[prefill][service]") {
  ServiceFixture fx;
  fx.transport.result = failed_precondition("model fingerprint differs");
  std::mt19937 rng(std::random_device{}());
  const CallResult r = prefill(*fx.stub, make_request(rng, "f1", 12, fx.model->config().n_vocab));
  CHECK(r.status.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  REQUIRE(r.events.size() == 1);
  CHECK(r.events[0].has_first_token());
}

TEST_CASE("prefill service: cancelling the call drops the queued job", "[prefill][service]") {
  ServiceFixture fx(/*start_engine=*/false);  // nothing runs: the job stays queued
  std::mt19937 rng(std::random_device{}());
  grpc::ClientContext context;
  auto reader = fx.stub->Prefill(&context, make_request(rng, "c1", 20, fx.model->config().n_vocab));
  for (int i = 0; i < 1000 && fx.engine->load().n_queued == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  REQUIRE(fx.engine->load().n_queued == 1);

  baton::v1::LoadReport load;
  {
    grpc::ClientContext ctx;
    REQUIRE(fx.stub->GetLoad(&ctx, baton::v1::LoadRequest(), &load).ok());
  }
  CHECK(load.queued_prompt_tokens() == 20);
  CHECK(load.model_fingerprint() == fx.model->fingerprint());
  CHECK(load.model().fingerprint() == fx.model->fingerprint());
  CHECK(load.model().architecture() == "llama");
  CHECK(load.model().vocab_size() == fx.model->config().n_vocab);
  CHECK(load.model().context_length() == fx.model->config().n_ctx);
  CHECK(load.total_blocks() > 0);
  CHECK_FALSE(load.draining());

  context.TryCancel();
  baton::v1::PrefillEvent event;
  CHECK_FALSE(reader->Read(&event));
  CHECK(reader->Finish().error_code() == grpc::StatusCode::CANCELLED);
  for (int i = 0; i < 1000 && fx.engine->load().n_queued != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  CHECK(fx.engine->load().n_queued == 0);
  CHECK(fx.engine->load().queued_prompt_tokens == 0);
}

TEST_CASE("prefill service: draining refuses new work", "[prefill][service]") {
  ServiceFixture fx;
  fx.service->set_draining(true);
  std::mt19937 rng(std::random_device{}());
  const CallResult r = prefill(*fx.stub, make_request(rng, "d1", 4, fx.model->config().n_vocab));
  CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  baton::v1::LoadReport load;
  grpc::ClientContext ctx;
  REQUIRE(fx.stub->GetLoad(&ctx, baton::v1::LoadRequest(), &load).ok());
  CHECK(load.draining());
}

TEST_CASE("prefill engine over the tcp transport delivers the KV intact to a decode receiver", "[prefill][tcp]") {
  // A decode worker reduced to its KV receiving side.
  class KvOnlyDecodeService final : public baton::v1::DecodeWorker::CallbackService {
   public:
    explicit KvOnlyDecodeService(KvReceiver& r) : receiver_(r) {}
    grpc::ServerReadReactor<baton::v1::KvMessage>* TransferKv(grpc::CallbackServerContext* c,
                                                              baton::v1::KvAck* ack) override {
      return make_kv_receive_reactor(c, ack, receiver_);
    }

   private:
    KvReceiver& receiver_;
  };
  baton::testing::RecordingReceiver receiver;
  KvOnlyDecodeService decode(receiver);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&decode);
  auto server = builder.BuildAndStart();
  REQUIRE(server);
  const std::string address = "127.0.0.1:" + std::to_string(port);

  std::string err;
  auto backend = make_backend({"cpu", DType::kF32, 0, {}}, &err);
  auto file = GgufFile::parse(make_test_model(TestModelSpec{}).to_bytes());
  REQUIRE(file.ok());
  auto model = Model::load(**file, *backend);
  REQUIRE(model.ok());
  std::mt19937 rng(std::random_device{}());
  std::vector<int32_t> prompt(50 + rng() % 200);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % (*model)->config().n_vocab);

  // The same prompt through the in-process recorder and through gRPC: the same bytes arrive.
  auto run = [&](KvTransport& transport, const std::string& decode_address) {
    PrefillConfig config;
    config.token_budget = 64;      // chunked prefill
    config.kv_chunk_bytes = 4096;  // several chunks per layer
    PrefillEngine engine(**model, transport, config);
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Status status;
    PrefillJob job;
    job.request_id = "tcp-e2e";
    job.tokens = prompt;
    job.decode_address = decode_address;
    job.model_fingerprint = (*model)->fingerprint();
    job.on_done = [&](const Status& s, double, int64_t) {
      std::lock_guard<std::mutex> lock(mu);
      status = s;
      done = true;
      cv.notify_all();
    };
    REQUIRE(engine.submit(std::move(job)).ok());
    while (engine.run_step_for_test()) {
    }
    std::unique_lock<std::mutex> lock(mu);
    REQUIRE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return done; }));
    return status;
  };
  RecordingTransport recorder;
  REQUIRE(run(recorder, "in-process").ok());
  TcpKvTransport tcp;
  const Status s = run(tcp, address);
  INFO(s.to_string());
  REQUIRE(s.ok());

  const auto want = recorder.get("tcp-e2e");
  const auto got = receiver.get("tcp-e2e");
  CHECK(got.ended);
  CHECK(got.header.token_ids == prompt);
  CHECK(got.first_token == want.first_token);
  CHECK(got.header.model_fingerprint == (*model)->fingerprint());
  CHECK(got.chunks.size() > static_cast<size_t>(got.header.n_layers));
  const int64_t row = kv_chunk_bytes(got.header, 1);
  for (const KvChunk& c : got.chunks) {
    CHECK(c.k == want.kv.k[c.layer].substr(c.token_start * row, c.k.size()));
    CHECK(c.v == want.kv.v[c.layer].substr(c.token_start * row, c.v.size()));
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

// The reactor's engine callbacks (on_first_token, on_done: an engine thread) race the gRPC
// threads' OnWriteDone and the OnDone that deletes the reactor. The state change that allows the
// Finish and the claim to perform it happen under one lock (PrefillReactor::claim_locked); were
// they apart, a gRPC thread could Finish in the gap and the engine thread lock a freed mutex.
// Many short calls at once, some cancelled by their client mid-stream, under ASan in CI
// (scripts/sanitize.sh): every call must end with its two events and OK, or CANCELLED. With the
// old unlock-then-pump() code, ASan reported the heap-use-after-free in 1 of 15 runs of 320 calls
// (0 of 30 with the fix); hence 800 calls.
TEST_CASE("prefill service: many concurrent calls, some cancelled, all end cleanly", "[prefill][service][stress]") {
  ServiceFixture fx;
  const int vocab = fx.model->config().n_vocab;
  const int n_threads = 8, n_calls = 100;
  std::atomic<int> n_ok{0}, n_cancelled{0}, n_bad{0};
  std::vector<std::thread> clients;
  const unsigned seed = std::random_device{}();
  INFO("seed " << seed);
  for (int t = 0; t < n_threads; ++t) {
    clients.emplace_back([&, t] {
      std::mt19937 rng(seed + t);
      for (int i = 0; i < n_calls; ++i) {
        const auto request = make_request(rng, "c" + std::to_string(t) + "-" + std::to_string(i),
                                          1 + static_cast<int>(rng() % 12), vocab);
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
        auto reader = fx.stub->Prefill(&context, request);
        const bool cancel = rng() % 4 == 0;
        baton::v1::PrefillEvent event;
        int n_events = 0;
        while (reader->Read(&event)) {
          n_events += !event.has_progress();
          if (cancel) context.TryCancel();
        }
        const grpc::Status s = reader->Finish();
        if (s.ok() && n_events == 2) {
          ++n_ok;
        } else if (cancel && s.error_code() == grpc::StatusCode::CANCELLED) {
          ++n_cancelled;
        } else {
          ++n_bad;
        }
      }
    });
  }
  for (auto& c : clients) c.join();
  INFO("ok " << n_ok << ", cancelled " << n_cancelled << ", bad " << n_bad);
  CHECK(n_bad == 0);
  CHECK(n_ok + n_cancelled == n_threads * n_calls);
  CHECK(n_ok > 0);
  // Every job is gone from the engine: nothing queued, every block back (a cancelled call ends
  // at the client before the engine has dropped its job: give it a moment).
  PrefillLoad load = fx.engine->load();
  for (int i = 0; i < 100 && (load.queued_prompt_tokens != 0 || load.free_blocks != load.total_blocks); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    load = fx.engine->load();
  }
  CHECK(load.queued_prompt_tokens == 0);
  CHECK(load.free_blocks == load.total_blocks);
}
