// The device KV transports on real GPUs: the KvTransport conformance suite (the cases tcp passes,
// tests/unit/kv/kv_transport_conformance.h) against cuda_ipc and nccl, then what is specific to
// them (multi-MiB chunks through the staging buffers, communicator rebuilds, refusals before any
// payload moves).
//
// cuda_ipc runs across two processes on one GPU (a CUDA IPC handle cannot be opened in the
// process that made it): this process is the decode side (DecodeKvDevice on loopback into a
// RecordingReceiver), a child (baton_kv_ipc_sender) owns the CudaIpcKvTransport and sends what
// the cases ask. nccl runs in this process with the sender on device 0 and the receiver on
// device 1 (NCCL refuses two ranks on one device), and is skipped (BATON_SKIP, reported by name)
// below two GPUs.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <condition_variable>
#include <cstring>
#include <map>

#include "baton/v1/worker.grpc.pb.h"
#include "kv/cuda_ipc/cuda_ipc_transport.h"
#include "kv/kv_device_service.h"
#include "kv/nccl/nccl_api.h"
#include "kv/nccl/nccl_transport.h"
#include "tests/common/test_skip.h"
#include "kv/tcp/tcp_transport.h"
#include "tests/unit/grpc_loopback.h"
#include "tests/unit/kv/kv_transport_conformance.h"

extern char** environ;

using namespace baton;
using baton::testing::KvPayload;
using baton::testing::RecordingReceiver;

namespace {

// A decode worker reduced to its device-KV receiving side, on `device`. `port` 0 picks one.
struct DeviceLoopbackServer {
  explicit DeviceLoopbackServer(int device, int port = 0)
      : service(make_service(receiver, device)), grpc(*service, port), port(grpc.port), address(grpc.address) {}

  static std::unique_ptr<KvDeviceService> make_service(RecordingReceiver& receiver, int device) {
    // The CUDA context now, so no transfer's deadline is spent creating it.
    REQUIRE(cudaSetDevice(device) == cudaSuccess);
    REQUIRE(cudaFree(nullptr) == cudaSuccess);
    KvDeviceServiceConfig config;
    config.device = device;
    return std::make_unique<KvDeviceService>(receiver, config);
  }

  RecordingReceiver receiver;
  std::unique_ptr<KvDeviceService> service;
  baton::testing::GrpcLoopback grpc;  // shut down before the service goes (members in reverse)
  const int port;
  const std::string address;
};

// baton_kv_ipc_sender next to this executable (a bundle copied to another machine keeps its
// binaries in one folder), else where the build put it.
std::string sender_path() {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    std::string dir(self, static_cast<size_t>(n));
    dir.resize(dir.rfind('/') + 1);
    const std::string beside = dir + "baton_kv_ipc_sender";
    if (access(beside.c_str(), X_OK) == 0) return beside;
  }
  return BATON_KV_IPC_SENDER;
}

// CudaIpcKvTransport in a child process (tests/gpu/kv_ipc_sender_main.cpp has the protocol).
// send() ships the header and chunks there and returns the child's status; concurrent sends
// are concurrent in the child.
class ChildIpcSender final : public KvTransport {
 public:
  ChildIpcSender(int device, std::chrono::milliseconds deadline) {
    signal(SIGPIPE, SIG_IGN);  // a dead child shows as a failed write, not a dead test
    int to_child[2], from_child[2];
    REQUIRE(pipe2(to_child, O_CLOEXEC) == 0);
    REQUIRE(pipe2(from_child, O_CLOEXEC) == 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_child[0], STDIN_FILENO);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], STDOUT_FILENO);
    std::string path = sender_path(), dev = std::to_string(device), ms = std::to_string(deadline.count());
    char* argv[] = {path.data(), dev.data(), ms.data(), nullptr};
    const int err = posix_spawn(&pid_, path.c_str(), &actions, nullptr, argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    close(to_child[0]);
    close(from_child[1]);
    REQUIRE(err == 0);
    to_child_ = to_child[1];
    from_child_ = from_child[0];
    reader_ = std::thread([this] { read_replies(); });
  }

  ~ChildIpcSender() override {
    close(to_child_);  // end of its stdin: the child answers what is pending and exits
    reader_.join();
    close(from_child_);
    int status = 0;
    waitpid(pid_, &status, 0);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }

  std::string name() const override { return "cuda_ipc"; }

  Status send(const std::string& address, const KvTransferHeader& header, KvSource& source,
              int64_t* bytes_sent) override {
    std::vector<std::string> messages;
    v1::KvMessage m;
    kv_header_to_proto(header, m.mutable_header());
    messages.push_back(m.SerializeAsString());
    KvChunk c;
    while (source.next(&c)) {
      m.Clear();
      kv_chunk_to_proto(std::move(c), m.mutable_chunk());
      messages.push_back(m.SerializeAsString());
      c = KvChunk{};
    }
    // The end, when the source gives one (without it the child abandons the transfer).
    if (const std::optional<int32_t> first = source.first_token()) {
      m.Clear();
      m.mutable_end()->set_first_token(*first);
      messages.push_back(m.SerializeAsString());
    }
    const uint64_t tag = next_tag_++;
    {
      std::lock_guard<std::mutex> lock(write_mu_);
      bool ok = write_all(&tag, sizeof(tag)) && write_string(address);
      const uint32_t n = static_cast<uint32_t>(messages.size());
      ok = ok && write_all(&n, sizeof(n));
      for (const std::string& s : messages) ok = ok && write_string(s);
      if (!ok) return unavailable("the cuda_ipc sender process is gone");
    }
    std::unique_lock<std::mutex> lock(mu_);
    const bool answered = cv_.wait_for(lock, std::chrono::minutes(5), [&] { return replies_.count(tag) || dead_; });
    if (!answered || !replies_.count(tag)) return unavailable("the cuda_ipc sender process did not answer");
    const Reply r = replies_[tag];
    replies_.erase(tag);
    if (bytes_sent) *bytes_sent = r.bytes;
    return r.code == StatusCode::kOk ? Status() : Status(r.code, r.message);
  }

 private:
  struct Reply {
    StatusCode code = StatusCode::kOk;
    int64_t bytes = 0;
    std::string message;
  };

  bool write_all(const void* src, size_t n) {
    const char* p = static_cast<const char*>(src);
    while (n > 0) {
      const ssize_t w = write(to_child_, p, n);
      if (w <= 0) return false;
      p += w;
      n -= static_cast<size_t>(w);
    }
    return true;
  }
  bool write_string(const std::string& s) {
    const uint32_t n = static_cast<uint32_t>(s.size());
    return write_all(&n, sizeof(n)) && write_all(s.data(), s.size());
  }
  bool read_all(void* dst, size_t n) {
    char* p = static_cast<char*>(dst);
    while (n > 0) {
      const ssize_t r = read(from_child_, p, n);
      if (r <= 0) return false;
      p += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  }
  void read_replies() {
    for (;;) {
      uint64_t tag = 0;
      int32_t code = 0;
      Reply r;
      uint32_t n = 0;
      if (!read_all(&tag, sizeof(tag)) || !read_all(&code, sizeof(code)) || !read_all(&r.bytes, sizeof(r.bytes)) ||
          !read_all(&n, sizeof(n))) {
        break;
      }
      r.message.resize(n);
      if (n > 0 && !read_all(r.message.data(), n)) break;
      r.code = static_cast<StatusCode>(code);
      std::lock_guard<std::mutex> lock(mu_);
      replies_[tag] = std::move(r);
      cv_.notify_all();
    }
    std::lock_guard<std::mutex> lock(mu_);
    dead_ = true;
    cv_.notify_all();
  }

  pid_t pid_ = 0;
  int to_child_ = -1;
  int from_child_ = -1;
  std::atomic<uint64_t> next_tag_{1};
  std::mutex write_mu_;  // one request written at a time
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Reply> replies_;  // guarded by mu_
  bool dead_ = false;                  // the child closed its stdout (guarded by mu_)
  std::thread reader_;
};

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

// A transfer with multi-MiB chunks of uneven sizes (f32, 8 heads × 128: 4 KiB of K per token):
// staging slots are allocated, outgrown and reused within one transfer.
KvPayload make_large_payload(std::mt19937_64& rng, const std::string& id) {
  KvPayload p;
  KvTransferHeader& h = p.header;
  h.request_id = id;
  h.model_fingerprint = "fp-large";
  h.dtype = "f32";
  h.n_layers = 2;
  h.n_kv_heads = 8;
  h.head_dim = 128;
  const std::vector<int32_t> cuts = {512, 4096, 256, 6144};  // tokens per chunk: 4, 32, 2, 48 MiB of K+V
  for (int32_t n : cuts) h.n_tokens += n;
  h.token_ids.assign(static_cast<size_t>(h.n_tokens), 11);
  const int64_t row = kv_chunk_bytes(h, 1);
  auto random_bytes = [&](int64_t n) {
    std::string s(static_cast<size_t>(n), '\0');
    for (int64_t i = 0; i + 8 <= n; i += 8) {
      const uint64_t w = rng();
      std::memcpy(s.data() + i, &w, 8);
    }
    return s;
  };
  for (int32_t l = 0; l < h.n_layers; ++l) {
    p.k.push_back(random_bytes(row * h.n_tokens));
    p.v.push_back(random_bytes(row * h.n_tokens));
    int32_t start = 0;
    for (int32_t n : cuts) {
      KvChunk c;
      c.layer = l;
      c.token_start = start;
      c.token_count = n;
      c.k = p.k[l].substr(static_cast<size_t>(start * row), static_cast<size_t>(n * row));
      c.v = p.v[l].substr(static_cast<size_t>(start * row), static_cast<size_t>(n * row));
      c.checksum = kv_checksum(c.k, c.v);
      p.bytes += static_cast<int64_t>(c.k.size() + c.v.size());
      p.chunks.push_back(std::move(c));
      start += n;
    }
  }
  return p;
}

void run_large_chunks(KvTransport& transport, const std::string& address, RecordingReceiver& receiver) {
  std::mt19937_64 rng(std::random_device{}());
  for (int i = 0; i < 2; ++i) {
    const KvPayload p = make_large_payload(rng, "large-" + std::to_string(i) + "-" + std::to_string(rng()));
    int64_t bytes = 0;
    const Status s = transport.send(address, p.header, *baton::testing::chunk_source(p), &bytes);
    INFO(s.to_string());
    REQUIRE(s.ok());
    CHECK(bytes == p.bytes);
    baton::testing::check_arrived_intact(receiver.get(p.header.request_id), p);
  }
}

// One successful transfer: the CUDA contexts (and for nccl the communicator) exist afterwards.
void warm_up(KvTransport& transport, const std::string& address) {
  std::mt19937_64 rng(std::random_device{}());
  const KvPayload p = baton::testing::make_kv_payload(rng, "warm-up-" + std::to_string(rng()));
  int64_t bytes = 0;
  const Status s = transport.send(address, p.header, *baton::testing::chunk_source(p), &bytes);
  INFO(s.to_string());
  REQUIRE(s.ok());
}

// Sends `messages` raw over TransferKvDevice and returns the call's status.
grpc::Status send_raw(const std::string& address, const std::vector<v1::KvDeviceMessage>& messages) {
  auto stub = v1::DecodeKvDevice::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto stream = stub->TransferKvDevice(&context);
  for (const auto& m : messages) {
    if (!stream->Write(m)) break;
  }
  stream->WritesDone();
  v1::KvDeviceAck ack;
  while (stream->Read(&ack)) {
  }
  return stream->Finish();
}

v1::KvDeviceMessage open_message(const KvTransferHeader& h, const std::string& transport) {
  v1::KvDeviceMessage m;
  kv_header_to_proto(h, m.mutable_open()->mutable_header());
  m.mutable_open()->set_transport(transport);
  return m;
}

}  // namespace

// ---- cuda_ipc ----------------------------------------------------------------------------------

TEST_CASE("cuda_ipc transport passes the KvTransport conformance suite", "[gpu][kv][cuda_ipc]") {
  DeviceLoopbackServer server(0);
  ChildIpcSender transport(0, std::chrono::seconds(60));
  baton::testing::run_kv_transport_conformance(transport, server.address, server.receiver,
                                               baton::testing::unused_loopback_address());
}

TEST_CASE("cuda_ipc transport gives up at its deadline", "[gpu][kv][cuda_ipc]") {
  DeviceLoopbackServer server(0);
  const auto deadline = std::chrono::milliseconds(500);
  ChildIpcSender transport(0, deadline);
  warm_up(transport, server.address);
  baton::testing::run_kv_transport_deadline(transport, deadline, server.address, server.receiver);
}

TEST_CASE("cuda_ipc transport moves multi-MiB chunks through its staging pool", "[gpu][kv][cuda_ipc]") {
  DeviceLoopbackServer server(0);
  ChildIpcSender transport(0, std::chrono::seconds(60));
  run_large_chunks(transport, server.address, server.receiver);
}

TEST_CASE("DecodeKvDevice refuses before any payload moves", "[gpu][kv][cuda_ipc][nccl]") {
  DeviceLoopbackServer server(0);
  std::mt19937_64 rng(std::random_device{}());
  const KvPayload p = baton::testing::make_kv_payload(rng, "raw-" + std::to_string(rng()));
  const std::string id = p.header.request_id;

  SECTION("a cuda_ipc sender on another node") {
    v1::KvDeviceMessage open = open_message(p.header, "cuda_ipc");
    open.mutable_open()->set_node_id("another-node");
    const grpc::Status s = send_raw(server.address, {open});
    CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(s.error_message().find("same node") != std::string::npos);
    CHECK_FALSE(server.receiver.has(id));
  }
  SECTION("an unknown transport") {
    CHECK(send_raw(server.address, {open_message(p.header, "carrier-pigeon")}).error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_FALSE(server.receiver.has(id));
  }
  SECTION("an nccl session the receiver does not hold") {
    v1::KvDeviceMessage open = open_message(p.header, "nccl");
    open.mutable_open()->set_nccl_session("no-such-session");
    CHECK(send_raw(server.address, {open}).error_code() == grpc::StatusCode::NOT_FOUND);
    CHECK_FALSE(server.receiver.has(id));
  }
  SECTION("a descriptor of the wrong size is refused before its handle is opened") {
    v1::KvDeviceMessage open = open_message(p.header, "cuda_ipc");
    open.mutable_open()->set_node_id(kv_node_id());
    const KvChunk& c = p.chunks[0];
    v1::KvDeviceMessage chunk;
    v1::KvDeviceChunk* d = chunk.mutable_chunk();
    d->set_layer(c.layer);
    d->set_token_start(c.token_start);
    d->set_token_count(c.token_count);
    d->set_k_bytes(static_cast<int64_t>(c.k.size()) + 1);
    d->set_v_bytes(static_cast<int64_t>(c.v.size()));
    d->set_checksum(c.checksum);
    d->set_ipc_handle(std::string(sizeof(cudaIpcMemHandle_t), '\x5a'));  // opening this would fail otherwise
    d->set_buffer_bytes(int64_t{1} << 20);
    // INVALID_ARGUMENT from the size check, not FAILED_PRECONDITION from cudaIpcOpenMemHandle.
    CHECK(send_raw(server.address, {open, chunk}).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(server.receiver.wait_aborted(id));
  }
  SECTION("a malformed NCCL bootstrap") {
    auto stub = v1::DecodeKvDevice::NewStub(grpc::CreateChannel(server.address, grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    v1::NcclBootstrapRequest request;
    request.set_unique_id("too short");
    request.set_session("s");
    v1::NcclBootstrapResponse response;
    CHECK(stub->BootstrapNccl(&context, request, &response).error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  }
  SECTION("an NCCL bootstrap without a reservation, and a reservation") {
    std::string error;
    const bool have_nccl = nccl_load(&error) != nullptr;
    auto stub = v1::DecodeKvDevice::NewStub(grpc::CreateChannel(server.address, grpc::InsecureChannelCredentials()));
    {
      grpc::ClientContext context;
      v1::NcclBootstrapRequest request;
      request.set_unique_id(std::string(sizeof(ncclUniqueId), '\0'));
      request.set_session("never-reserved");
      v1::NcclBootstrapResponse response;
      CHECK(stub->BootstrapNccl(&context, request, &response).error_code() ==
            (have_nccl ? grpc::StatusCode::NOT_FOUND : grpc::StatusCode::FAILED_PRECONDITION));
    }
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::NcclBootstrapResponse response;
    const grpc::Status s = stub->BootstrapNccl(&context, v1::NcclBootstrapRequest(), &response);
    INFO(s.error_message());
    CHECK(s.error_code() == (have_nccl ? grpc::StatusCode::OK : grpc::StatusCode::FAILED_PRECONDITION));
    if (have_nccl) CHECK_FALSE(response.session().empty());
  }
}

// ---- nccl --------------------------------------------------------------------------------------

namespace {

// Below two GPUs, or without libnccl, the nccl cases are skipped, by name and with the reason
// (tests/common/test_skip.h); tests/gpu/run.sh leaves them out below two GPUs and lists them as
// not applicable. Empty when they can run.
std::string nccl_unrunnable() {
  const int n = device_count();
  if (n < 2) {
    return "NCCL needs two GPUs for its two ranks (it refuses two ranks on one device); this machine has " +
           std::to_string(n);
  }
  std::string error;
  if (nccl_load(&error) == nullptr) return "libnccl cannot be loaded: " + error;
  return {};
}

NcclKvConfig nccl_sender(std::chrono::milliseconds deadline = std::chrono::seconds(60)) {
  NcclKvConfig c;
  c.device = 0;
  c.deadline = deadline;
  return c;
}

}  // namespace

TEST_CASE("nccl transport passes the KvTransport conformance suite", "[gpu][kv][nccl]") {
  if (const std::string why = nccl_unrunnable(); !why.empty()) BATON_SKIP(why);
  DeviceLoopbackServer server(1);
  NcclKvTransport transport(nccl_sender());
  CHECK(transport.name() == "nccl");
  baton::testing::run_kv_transport_conformance(transport, server.address, server.receiver,
                                               baton::testing::unused_loopback_address());
}

TEST_CASE("nccl transport gives up at its deadline", "[gpu][kv][nccl]") {
  if (const std::string why = nccl_unrunnable(); !why.empty()) BATON_SKIP(why);
  DeviceLoopbackServer server(1);
  {
    // NCCL's one-time set-up in this process (topology, NVML) with a patient transport first,
    // so the short deadline below only has to cover one more communicator's bootstrap.
    NcclKvTransport patient(nccl_sender());
    warm_up(patient, server.address);
  }
  const auto deadline = std::chrono::seconds(3);
  NcclKvTransport transport(nccl_sender(deadline));
  warm_up(transport, server.address);
  baton::testing::run_kv_transport_deadline(transport, deadline, server.address, server.receiver);
}

TEST_CASE("nccl transport moves multi-MiB chunks", "[gpu][kv][nccl]") {
  if (const std::string why = nccl_unrunnable(); !why.empty()) BATON_SKIP(why);
  DeviceLoopbackServer server(1);
  NcclKvTransport transport(nccl_sender());
  run_large_chunks(transport, server.address, server.receiver);
}

TEST_CASE("nccl transport rebuilds its communicator after a failure and a decode worker restart", "[gpu][kv][nccl]") {
  if (const std::string why = nccl_unrunnable(); !why.empty()) BATON_SKIP(why);
  NcclKvTransport transport(nccl_sender());
  auto server = std::make_unique<DeviceLoopbackServer>(1);
  const int port = server->port;
  warm_up(transport, server->address);

  // A refusal mid-transfer tears the communicator down on both sides ...
  std::mt19937_64 rng(std::random_device{}());
  const KvPayload p = baton::testing::make_kv_payload(rng, "refused-" + std::to_string(rng()));
  server->receiver.on_chunk = [](const KvChunk&) -> Status { return resource_exhausted("no room"); };
  int64_t bytes = 0;
  CHECK(transport.send(server->address, p.header, *baton::testing::chunk_source(p), &bytes).code() ==
        StatusCode::kResourceExhausted);
  CHECK(server->receiver.wait_aborted(p.header.request_id));
  server->receiver.on_chunk = nullptr;
  // ... and the next send bootstraps a new one.
  warm_up(transport, server->address);

  // A restarted decode worker no longer holds the session: the sender bootstraps again and the
  // transfer still succeeds.
  server.reset();
  server = std::make_unique<DeviceLoopbackServer>(1, port);
  warm_up(transport, server->address);
}
