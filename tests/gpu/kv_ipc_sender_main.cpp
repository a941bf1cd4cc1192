// The sending process of the cuda_ipc GPU tests (a CUDA IPC handle cannot be opened in the
// process that made it, so sender and receiver must be two processes). It owns one
// CudaIpcKvTransport and sends what the test process asks, each request on a thread of its own so
// concurrent requests are concurrent sends:
//
//   baton_kv_ipc_sender DEVICE DEADLINE_MS
//
// stdin, per request:  u64 tag, u32 n, n bytes of address, u32 m, then m × (u32 n, n bytes of a
//                      serialized KvMessage): the header first, then the chunks in send order.
// stdout, per request: u64 tag, i32 status code, i64 bytes sent, u32 n, n bytes of message.
// Integers are host-endian (both ends run on one machine). Exits 0 at end of stdin, after every
// request was answered.
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "baton/v1/worker.pb.h"
#include "kv/cuda_ipc/cuda_ipc_transport.h"
#include "kv/tcp/tcp_transport.h"

namespace {

bool read_exact(void* dst, size_t n) {
  char* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t r = read(STDIN_FILENO, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool read_string(std::string* s) {
  uint32_t n = 0;
  if (!read_exact(&n, sizeof(n))) return false;
  s->resize(n);
  return n == 0 || read_exact(s->data(), n);
}

void write_exact(const void* src, size_t n) {
  const char* p = static_cast<const char*>(src);
  while (n > 0) {
    const ssize_t w = write(STDOUT_FILENO, p, n);
    if (w <= 0) std::_Exit(3);  // the test process is gone
    p += w;
    n -= static_cast<size_t>(w);
  }
}

struct Request {
  uint64_t tag = 0;
  std::string address;
  baton::KvTransferHeader header;
  std::vector<baton::KvChunk> chunks;
  std::optional<int32_t> first_token;  // none: abandon the transfer after the chunks
};

bool read_request(Request* r) {
  if (!read_exact(&r->tag, sizeof(r->tag))) return false;
  if (!read_string(&r->address)) return false;
  uint32_t m = 0;
  if (!read_exact(&m, sizeof(m))) return false;
  for (uint32_t i = 0; i < m; ++i) {
    std::string bytes;
    if (!read_string(&bytes)) return false;
    baton::v1::KvMessage message;
    if (!message.ParseFromString(bytes)) return false;
    if (message.has_header()) {
      r->header = baton::kv_header_from_proto(message.header());
    } else if (message.has_end()) {
      r->first_token = message.end().first_token();
    } else {
      r->chunks.push_back(baton::kv_chunk_from_proto(std::move(*message.mutable_chunk())));
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s DEVICE DEADLINE_MS\n", argv[0]);
    return 2;
  }
  baton::CudaIpcKvConfig config;
  config.device = std::atoi(argv[1]);
  config.deadline = std::chrono::milliseconds(std::atoll(argv[2]));
  // The CUDA context up front, so the first transfer's deadline is not spent creating it.
  if (cudaSetDevice(config.device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) {
    std::fprintf(stderr, "baton_kv_ipc_sender: CUDA device %d unusable\n", config.device);
    return 1;
  }
  baton::CudaIpcKvTransport transport(config);
  std::mutex out_mu;
  std::vector<std::thread> threads;
  for (;;) {
    auto request = std::make_shared<Request>();
    if (!read_request(request.get())) break;
    threads.emplace_back([&transport, &out_mu, request] {
      int64_t bytes = 0;
      baton::KvVectorSource source(request->chunks, request->first_token);
      const baton::Status s = transport.send(request->address, request->header, source, &bytes);
      const int32_t code = static_cast<int32_t>(s.code());
      const uint32_t n = static_cast<uint32_t>(s.message().size());
      std::lock_guard<std::mutex> lock(out_mu);
      write_exact(&request->tag, sizeof(request->tag));
      write_exact(&code, sizeof(code));
      write_exact(&bytes, sizeof(bytes));
      write_exact(&n, sizeof(n));
      write_exact(s.message().data(), n);
    });
  }
  for (auto& t : threads) t.join();
  return 0;
}
