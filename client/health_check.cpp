#include "client/health_check.h"

#include <grpcpp/generic/generic_stub.h>

#include <cstdint>
#include <future>
#include <vector>

namespace baton::ctl {

std::string health_request_bytes(const std::string& service) {
  if (service.empty()) return {};                       // proto3 leaves a default field out
  std::string out(1, static_cast<char>((1 << 3) | 2));  // field 1, length-delimited
  for (uint64_t n = service.size();; n >>= 7) {
    if (n < 0x80) {
      out.push_back(static_cast<char>(n));
      break;
    }
    out.push_back(static_cast<char>((n & 0x7f) | 0x80));
  }
  return out + service;
}

std::string health_status_name(const std::string& bytes) {
  // Fields as varints: status is field 1, wire type 0; absent means UNKNOWN (0).
  int64_t status = 0;
  size_t i = 0;
  auto varint = [&](int64_t* v) {
    *v = 0;
    for (int shift = 0; i < bytes.size() && shift < 64; shift += 7) {
      const auto b = static_cast<unsigned char>(bytes[i++]);
      *v |= static_cast<int64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  };
  while (i < bytes.size()) {
    int64_t key = 0, value = 0;
    if (!varint(&key) || (key & 7) != 0 || !varint(&value)) return "UNKNOWN";
    if (key >> 3 == 1) status = value;
  }
  switch (status) {
    case 1: return "SERVING";
    case 2: return "NOT_SERVING";
    case 3: return "SERVICE_UNKNOWN";
    default: return "UNKNOWN";
  }
}

grpc::Status health_check(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext& context,
                          const std::string& service, std::string* status) {
  grpc::GenericStub stub(channel);
  grpc::Slice payload(health_request_bytes(service));
  grpc::ByteBuffer request(&payload, 1);
  grpc::ByteBuffer response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  grpc::Status s = done.get_future().get();
  if (!s.ok()) return s;
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return grpc::Status(grpc::StatusCode::INTERNAL, "unreadable health response");
  std::string bytes;
  for (const grpc::Slice& slice : slices) bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  *status = health_status_name(bytes);
  return s;
}

}  // namespace baton::ctl
