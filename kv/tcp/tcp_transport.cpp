#include "kv/tcp/tcp_transport.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>
#include <spdlog/spdlog.h>

#include <utility>

#include "baton/v1/worker.grpc.pb.h"
#include "common/grpc_status.h"

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
  p->set_first_token(h.first_token);
  p->mutable_token_ids()->Assign(h.token_ids.begin(), h.token_ids.end());
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
  h.first_token = p.first_token();
  h.token_ids.assign(p.token_ids().begin(), p.token_ids().end());
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

TcpKvTransport::TcpKvTransport(std::chrono::milliseconds deadline) : deadline_(deadline) {}

std::shared_ptr<grpc::Channel> TcpKvTransport::channel(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = channels_.find(address);
  if (it != channels_.end()) return it->second;
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(-1);
  // A decode worker that restarts is reachable again within a couple of seconds (gRPC's default
  // reconnect backoff grows to two minutes, during which fail-fast calls are refused at once).
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  channels_.emplace(address, channel);
  return channel;
}

Status TcpKvTransport::send(const std::string& address, const KvTransferHeader& header,
                            const std::function<bool(KvChunk*)>& next, int64_t* bytes_sent) {
  if (bytes_sent) *bytes_sent = 0;
  auto stub = baton::v1::DecodeWorker::NewStub(channel(address));
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
  while (ok) {
    KvChunk chunk;
    if (!next(&chunk)) break;
    bytes += static_cast<int64_t>(chunk.k.size() + chunk.v.size());
    message.Clear();
    kv_chunk_to_proto(std::move(chunk), message.mutable_chunk());
    ok = writer->Write(message);
  }
  if (ok) writer->WritesDone();
  const grpc::Status status = writer->Finish();
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

int64_t dtype_bytes(const std::string& dtype) {
  if (dtype == "f32") return 4;
  if (dtype == "bf16" || dtype == "f16") return 2;
  return 0;
}

Status check_header(const KvTransferHeader& h) {
  if (h.request_id.empty()) return invalid_argument("the KV header has no request_id");
  if (dtype_bytes(h.dtype) == 0)
    return invalid_argument("the KV header's dtype '" + h.dtype + "' is not f32, bf16 or f16");
  if (h.n_layers <= 0 || h.n_kv_heads <= 0 || h.head_dim <= 0 || h.n_tokens <= 0) {
    return invalid_argument("the KV header's shape is not positive: n_layers " + std::to_string(h.n_layers) +
                            ", n_kv_heads " + std::to_string(h.n_kv_heads) + ", head_dim " +
                            std::to_string(h.head_dim) + ", n_tokens " + std::to_string(h.n_tokens));
  }
  if (kv_chunk_bytes(h, 1) > kMaxKvChunkBytes) {
    return invalid_argument("one token's K of the KV header's shape exceeds the chunk limit of " +
                            std::to_string(kMaxKvChunkBytes) + " bytes");
  }
  if (static_cast<int64_t>(h.token_ids.size()) != h.n_tokens) {
    return invalid_argument("the KV header lists " + std::to_string(h.token_ids.size()) + " token ids for n_tokens " +
                            std::to_string(h.n_tokens));
  }
  return {};
}

// One TransferKv call. Reads are strictly sequential (the next StartRead follows the previous
// OnReadDone), and every receiver call is made from OnReadDone, so the receiver sees one call at
// a time without a lock. A cancelled call completes its pending read with ok = false.
class KvReceiveReactor final : public grpc::ServerReadReactor<baton::v1::KvMessage> {
 public:
  KvReceiveReactor(grpc::CallbackServerContext* context, baton::v1::KvAck* response, KvReceiver& receiver)
      : context_(context), response_(response), receiver_(receiver) {
    StartRead(&message_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      end_of_stream();
      return;
    }
    Status s;
    if (message_.has_header()) {
      s = on_header();
    } else if (message_.has_chunk()) {
      s = on_chunk();
    } else {
      s = invalid_argument("a KvMessage carries neither a header nor a chunk");
    }
    if (!s.ok()) {
      refuse(s);
      return;
    }
    StartRead(&message_);
  }

  void OnDone() override {
    // Every path that finishes the call settles the receiver first; this covers anything else.
    if (begun_ && !settled_) receiver_.kv_abort(header_.request_id);
    delete this;
  }

 private:
  Status on_header() {
    if (begun_) return invalid_argument("a second KV header in one transfer");
    header_ = kv_header_from_proto(message_.header());
    BATON_RETURN_IF_ERROR(check_header(header_));
    BATON_RETURN_IF_ERROR(receiver_.kv_begin(header_));
    begun_ = true;
    next_token_.assign(header_.n_layers, 0);
    return {};
  }

  Status on_chunk() {
    if (!begun_) return invalid_argument("the first KV message must be the header");
    const baton::v1::KvLayerChunk& c = message_.chunk();
    const std::string where = "KV chunk (layer " + std::to_string(c.layer()) + ", tokens " +
                              std::to_string(c.token_start()) + "+" + std::to_string(c.token_count()) + ")";
    if (c.layer() < 0 || c.layer() >= header_.n_layers) {
      return invalid_argument(where + ": layer outside [0, " + std::to_string(header_.n_layers) + ")");
    }
    if (c.token_count() <= 0 || c.token_start() != next_token_[c.layer()] ||
        static_cast<int64_t>(c.token_start()) + c.token_count() > header_.n_tokens) {
      return invalid_argument(where + ": expected tokens from " + std::to_string(next_token_[c.layer()]) +
                              " of this layer, within n_tokens " + std::to_string(header_.n_tokens));
    }
    const int64_t want = kv_chunk_bytes(header_, c.token_count());
    if (static_cast<int64_t>(c.k().size()) > kMaxKvChunkBytes ||
        static_cast<int64_t>(c.v().size()) > kMaxKvChunkBytes) {
      return invalid_argument(where + ": K or V larger than the limit of " + std::to_string(kMaxKvChunkBytes) +
                              " bytes");
    }
    if (static_cast<int64_t>(c.k().size()) != want || static_cast<int64_t>(c.v().size()) != want) {
      return invalid_argument(where + ": K has " + std::to_string(c.k().size()) + " bytes and V " +
                              std::to_string(c.v().size()) + ", the header's shape needs " + std::to_string(want) +
                              " each");
    }
    if (kv_checksum(c.k(), c.v()) != c.checksum()) return data_loss(where + ": checksum mismatch");
    KvChunk chunk = kv_chunk_from_proto(std::move(*message_.mutable_chunk()));
    BATON_RETURN_IF_ERROR(receiver_.kv_chunk(header_.request_id, chunk));
    next_token_[chunk.layer] += chunk.token_count;
    bytes_ += 2 * want;
    return {};
  }

  // A failed read is the sender's WritesDone, a cancelled call, or a broken one; gRPC does not
  // always flag the last (a message over the server's size limit fails the read without
  // IsCancelled), so only a stream whose every layer is covered reaches kv_end.
  void end_of_stream() {
    if (context_->IsCancelled()) {
      refuse(cancelled("the KV transfer was cancelled or its stream broke"));
      return;
    }
    if (!begun_) {
      refuse(invalid_argument("the KV stream ended before its header"));
      return;
    }
    for (int32_t layer = 0; layer < header_.n_layers; ++layer) {
      if (next_token_[layer] != header_.n_tokens) {
        refuse(invalid_argument("the KV stream ended with layer " + std::to_string(layer) + " covering " +
                                std::to_string(next_token_[layer]) + " of " + std::to_string(header_.n_tokens) +
                                " tokens"));
        return;
      }
    }
    const Status s = receiver_.kv_end(header_.request_id);
    if (!s.ok()) {
      refuse(s);
      return;
    }
    settled_ = true;
    response_->set_bytes(bytes_);
    Finish(grpc::Status::OK);
  }

  void refuse(const Status& s) {
    spdlog::warn("req={} KV transfer refused: {}", header_.request_id.empty() ? "?" : header_.request_id,
                 s.to_string());
    if (begun_ && !settled_) receiver_.kv_abort(header_.request_id);
    settled_ = true;
    Finish(to_grpc(s));
  }

  grpc::CallbackServerContext* context_;
  baton::v1::KvAck* response_;
  KvReceiver& receiver_;
  baton::v1::KvMessage message_;  // the read in flight
  KvTransferHeader header_;
  bool begun_ = false;               // kv_begin accepted the header
  bool settled_ = false;             // kv_end or kv_abort called (the receiver is done with this transfer)
  std::vector<int32_t> next_token_;  // per layer: the next token its chunks must start at
  int64_t bytes_ = 0;                // K and V bytes handed to the receiver
};

}  // namespace

grpc::ServerReadReactor<baton::v1::KvMessage>* make_kv_receive_reactor(grpc::CallbackServerContext* context,
                                                                       baton::v1::KvAck* response,
                                                                       KvReceiver& receiver) {
  return new KvReceiveReactor(context, response, receiver);
}

}  // namespace baton
