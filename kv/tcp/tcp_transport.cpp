#include "kv/tcp/tcp_transport.h"

#include <spdlog/spdlog.h>

#include <optional>
#include <utility>

#include "baton/v1/worker.grpc.pb.h"
#include "common/grpc_status.h"
#include "common/tls.h"
#include "kv/kv_incoming.h"

namespace baton {

// ---- conversions -------------------------------------------------------------------------------

void kv_header_to_proto(const KvTransferHeader& h, baton::v1::KvHeader* p) {
  p->set_request_id(h.request_id);
  p->set_model_fingerprint(h.model_fingerprint);
  p->set_dtype(h.dtype);
  p->set_n_layers(h.n_layers);
  p->set_n_kv_heads(h.n_kv_heads);
  p->set_head_dim(h.head_dim);
  p->set_n_tokens(h.n_tokens);
  p->mutable_token_ids()->Assign(h.token_ids.begin(), h.token_ids.end());
  p->set_probe(h.probe);
}

KvTransferHeader kv_header_from_proto(const baton::v1::KvHeader& p) {
  KvTransferHeader h;
  h.request_id = p.request_id();
  h.model_fingerprint = p.model_fingerprint();
  h.dtype = p.dtype();
  h.n_layers = p.n_layers();
  h.n_kv_heads = p.n_kv_heads();
  h.head_dim = p.head_dim();
  h.n_tokens = p.n_tokens();
  h.token_ids.assign(p.token_ids().begin(), p.token_ids().end());
  h.probe = p.probe();
  return h;
}

void kv_chunk_to_proto(KvChunk&& c, baton::v1::KvLayerChunk* p) {
  p->set_layer(c.layer);
  p->set_token_start(c.token_start);
  p->set_token_count(c.token_count);
  p->set_k(std::move(c.k));
  p->set_v(std::move(c.v));
  p->set_checksum(c.checksum);
}

KvChunk kv_chunk_from_proto(baton::v1::KvLayerChunk&& p) {
  KvChunk c;
  c.layer = p.layer();
  c.token_start = p.token_start();
  c.token_count = p.token_count();
  c.k = std::move(*p.mutable_k());
  c.v = std::move(*p.mutable_v());
  c.checksum = p.checksum();
  return c;
}

// ---- sender ------------------------------------------------------------------------------------

TcpKvTransport::TcpKvTransport(std::shared_ptr<grpc::ChannelCredentials> credentials,
                               std::chrono::milliseconds deadline)
    : deadline_(deadline), channels_(std::move(credentials)) {}

Status TcpKvTransport::send(const std::string& address, const KvTransferHeader& header, KvSource& source,
                            int64_t* bytes_sent) {
  if (bytes_sent) *bytes_sent = 0;
  auto stub = baton::v1::DecodeWorker::NewStub(channels_.get(address));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + deadline_);
  baton::v1::KvAck ack;
  std::unique_ptr<grpc::ClientWriter<baton::v1::KvMessage>> writer = stub->TransferKv(&context, &ack);

  baton::v1::KvMessage message;
  kv_header_to_proto(header, message.mutable_header());
  bool ok = writer->Write(message);
  int64_t bytes = 0;
  // A failed Write means the call is over (the receiver refused, the peer is gone, the deadline
  // passed): stop producing chunks; Finish() says why.
  bool drained = false;
  while (ok) {
    KvChunk chunk;
    if (!source.next(&chunk)) {
      drained = true;
      break;
    }
    bytes += static_cast<int64_t>(chunk.k.size() + chunk.v.size());
    message.Clear();
    kv_chunk_to_proto(std::move(chunk), message.mutable_chunk());
    ok = writer->Write(message);
  }
  bool abandoned = false;
  if (ok && drained) {
    if (const std::optional<int32_t> first = source.first_token()) {
      message.Clear();
      message.mutable_end()->set_first_token(*first);
      ok = writer->Write(message);
    } else {
      abandoned = true;
      context.TryCancel();  // the receiver aborts: no end, no KV
    }
  }
  if (ok && !abandoned) writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (abandoned) return cancelled("KV transfer of request " + header.request_id + " abandoned by its sender");
  if (!status.ok()) {
    const Status s = from_grpc(status);
    return {s.code(),
            "KV transfer of request " + header.request_id + " to decode worker " + address + ": " + s.message()};
  }
  if (bytes_sent) *bytes_sent = bytes;
  return {};
}

// ---- receiver ----------------------------------------------------------------------------------

namespace {

// One TransferKv call. Reads are strictly sequential (the next StartRead follows the previous
// OnReadDone), and every receiver call is made from OnReadDone, so the receiver sees one call at
// a time without a lock. A cancelled call completes its pending read with ok = false.
class KvReceiveReactor final : public grpc::ServerReadReactor<baton::v1::KvMessage> {
 public:
  KvReceiveReactor(grpc::CallbackServerContext* context, baton::v1::KvAck* response, KvReceiver& receiver,
                   KvReceiver* probe_receiver)
      : context_(context), response_(response), incoming_(receiver, probe_receiver) {
    StartRead(&message_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      end_of_stream();
      return;
    }
    Status s;
    if (first_token_) {
      s = invalid_argument("a KvMessage after the transfer's end");
    } else if (message_.has_header()) {
      KvTransferHeader header = kv_header_from_proto(message_.header());
      header.sender = peer_host(context_->peer());
      header.sender_certificate = peer_certificate(*context_);
      s = incoming_.begin(header);
    } else if (message_.has_chunk()) {
      s = incoming_.chunk(kv_chunk_from_proto(std::move(*message_.mutable_chunk())));
    } else if (message_.has_end()) {
      s = incoming_.begun() ? Status{} : invalid_argument("the first KV message must be the header");
      first_token_ = message_.end().first_token();
    } else {
      s = invalid_argument("a KvMessage carries neither a header, a chunk nor an end");
    }
    if (!s.ok()) {
      refuse(s);
      return;
    }
    StartRead(&message_);
  }

  // incoming_ aborts the transfer here unless it was settled.
  void OnDone() override { delete this; }

 private:
  // A failed read is the sender's WritesDone, a cancelled call, or a broken one; gRPC does not
  // always flag the last (a message over the server's size limit fails the read without
  // IsCancelled), so only a stream whose every layer is covered reaches kv_end.
  void end_of_stream() {
    if (context_->IsCancelled()) {
      refuse(cancelled("the KV transfer was cancelled or its stream broke"));
      return;
    }
    if (!first_token_) {
      refuse(invalid_argument("the KV stream ended without its end (the first token)"));
      return;
    }
    if (const Status s = incoming_.end(*first_token_); !s.ok()) {
      refuse(s);
      return;
    }
    response_->set_bytes(incoming_.bytes());
    Finish(grpc::Status::OK);
  }

  void refuse(const Status& s) {
    spdlog::warn("req={} KV transfer refused: {}", incoming_.request_id(), s.to_string());
    incoming_.abort();
    Finish(to_grpc(s));
  }

  grpc::CallbackServerContext* context_;
  baton::v1::KvAck* response_;
  baton::v1::KvMessage message_;  // the read in flight
  KvIncoming incoming_;           // the checks, and the receiver the header chose
  std::optional<int32_t> first_token_;  // the end arrived
};

}  // namespace

grpc::ServerReadReactor<baton::v1::KvMessage>* make_kv_receive_reactor(grpc::CallbackServerContext* context,
                                                                       baton::v1::KvAck* response,
                                                                       KvReceiver& receiver,
                                                                       KvReceiver* probe_receiver) {
  return new KvReceiveReactor(context, response, receiver, probe_receiver);
}

}  // namespace baton
