#include "kv/kv_device_call.h"

#include "common/grpc_status.h"

namespace baton {

int64_t kv_staging_bytes(int64_t bytes, int64_t min_bytes) {
  int64_t size = min_bytes;
  while (size < bytes) size *= 2;
  return size;
}

KvChunkDesc kv_chunk_desc(const baton::v1::KvDeviceChunk& c) {
  return {c.layer(), c.token_start(), c.token_count(), c.k_bytes(), c.v_bytes()};
}

// ---- KvDeviceCall ------------------------------------------------------------------------------

KvDeviceCall::KvDeviceCall(const std::shared_ptr<grpc::Channel>& channel,
                           std::chrono::system_clock::time_point deadline)
    : stub_(baton::v1::DecodeKvDevice::NewStub(channel)) {
  context_.set_deadline(deadline);
  stream_ = stub_->TransferKvDevice(&context_);
}

bool KvDeviceCall::open(const baton::v1::KvDeviceOpen& open) {
  baton::v1::KvDeviceMessage m;
  *m.mutable_open() = open;
  live_ = live_ && stream_->Write(m);
  return live_;
}

bool KvDeviceCall::read_ack() {
  baton::v1::KvDeviceAck ack;
  if (!stream_->Read(&ack)) {
    live_ = false;
    return false;
  }
  if (ack.chunk() == -1 && !opened_) {
    opened_ = true;
  } else if (opened_ && ack.chunk() == n_acked_ && n_acked_ < n_written_) {
    ++n_acked_;
  } else {
    // Acks arrive once each, in order; anything else is a receiver this sender cannot trust.
    if (broken_.empty()) {
      broken_ = "the receiver acknowledged chunk " + std::to_string(ack.chunk()) + " out of order (" +
                std::to_string(n_acked_) + " of " + std::to_string(n_written_) + " acknowledged)";
    }
    context_.TryCancel();
    live_ = false;
  }
  return true;
}

bool KvDeviceCall::wait_opened() {
  while (live_ && !opened_) read_ack();
  return live_;
}

bool KvDeviceCall::wait_window(int max_unacked) {
  while (live_ && n_written_ - n_acked_ > max_unacked) read_ack();
  return live_;
}

bool KvDeviceCall::write_chunk(const baton::v1::KvDeviceChunk& chunk) {
  if (!live_) return false;
  baton::v1::KvDeviceMessage m;
  *m.mutable_chunk() = chunk;
  live_ = stream_->Write(m);
  if (live_) ++n_written_;
  return live_;
}

bool KvDeviceCall::write_end(int32_t first_token) {
  if (!live_) return false;
  baton::v1::KvDeviceMessage m;
  m.mutable_end()->set_first_token(first_token);
  live_ = stream_->Write(m);
  return live_;
}

Status KvDeviceCall::finish(const std::string& request_id, const std::string& address) {
  const bool wrote_all = live_;
  if (live_) stream_->WritesDone();
  // Read to the end whatever happened before: the receiver's acks, then its status.
  while (read_ack()) {
  }
  const grpc::Status status = stream_->Finish();
  const std::string what = "KV transfer of request " + request_id + " to decode worker " + address + ": ";
  if (!broken_.empty()) return internal_error(what + broken_);
  if (!status.ok()) {
    const Status s = from_grpc(status);
    if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
      return {s.code(), what + "it does not serve device KV transfers (built without CUDA); " + s.message()};
    }
    return {s.code(), what + s.message()};
  }
  if (!wrote_all || !opened_ || n_acked_ != n_written_) {
    return internal_error(what + "the receiver ended the call with OK after acknowledging " + std::to_string(n_acked_) +
                          " of " + std::to_string(n_written_) + " chunks");
  }
  return {};
}

Status KvDeviceCall::fail(const Status& why, const std::string& request_id, const std::string& address) {
  context_.TryCancel();
  live_ = false;
  baton::v1::KvDeviceAck ack;
  while (stream_->Read(&ack)) {
  }
  (void)stream_->Finish();
  return {why.code(), "KV transfer of request " + request_id + " to decode worker " + address + ": " + why.message()};
}

}  // namespace baton
