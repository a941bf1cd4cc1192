#include "kv/kv_incoming.h"

namespace baton {
namespace {

int64_t dtype_bytes(const std::string& dtype) {
  if (dtype == "f32") return 4;
  if (dtype == "bf16" || dtype == "f16") return 2;
  return 0;
}

}  // namespace

std::string kv_chunk_name(const KvChunkDesc& d) {
  return "KV chunk (layer " + std::to_string(d.layer) + ", tokens " + std::to_string(d.token_start) + "+" +
         std::to_string(d.token_count) + ")";
}

KvIncoming::KvIncoming(KvReceiver& engine, KvReceiver* probe) : engine_(engine), probe_(probe) {}

KvIncoming::~KvIncoming() { abort(); }

const std::string& KvIncoming::request_id() const {
  static const std::string unknown = "?";
  return begun_ ? header_.request_id : unknown;
}

Status KvIncoming::begin(const KvTransferHeader& h) {
  if (begun_) return invalid_argument("a second KV header in one transfer");
  if (h.request_id.empty()) return invalid_argument("the KV header has no request_id");
  BATON_RETURN_IF_ERROR(check_length(h.request_id, "the KV header's request_id"));
  BATON_RETURN_IF_ERROR(check_length(h.model_fingerprint, "the KV header's model_fingerprint"));
  if (dtype_bytes(h.dtype) == 0) {
    return invalid_argument("the KV header's dtype " + quote_input(h.dtype) + " is not f32, bf16 or f16");
  }
  if (h.n_layers <= 0 || h.n_kv_heads <= 0 || h.head_dim <= 0 || h.n_tokens <= 0) {
    return invalid_argument("the KV header's shape is not positive: n_layers " + std::to_string(h.n_layers) +
                            ", n_kv_heads " + std::to_string(h.n_kv_heads) + ", head_dim " +
                            std::to_string(h.head_dim) + ", n_tokens " + std::to_string(h.n_tokens));
  }
  if (h.n_layers > kMaxKvLayers) {
    return invalid_argument("the KV header's n_layers " + std::to_string(h.n_layers) + " is over the limit of " +
                            std::to_string(kMaxKvLayers));
  }
  if (kv_chunk_bytes(h, 1) > kMaxKvChunkBytes) {
    return invalid_argument("one token's K of the KV header's shape exceeds the chunk limit of " +
                            std::to_string(kMaxKvChunkBytes) + " bytes");
  }
  if (static_cast<int64_t>(h.token_ids.size()) != h.n_tokens) {
    return invalid_argument("the KV header lists " + std::to_string(h.token_ids.size()) + " token ids for n_tokens " +
                            std::to_string(h.n_tokens));
  }
  // The header decides, once, who takes this transfer: a probe never reaches the engine.
  if (h.probe && probe_ == nullptr) return failed_precondition("this decode worker takes no KV probes");
  header_ = h;
  KvReceiver& receiver = h.probe ? *probe_ : engine_;
  // The receiver checks the shape against its model first; only then is anything sized by it.
  BATON_RETURN_IF_ERROR(receiver.kv_begin(header_));
  receiver_ = &receiver;
  begun_ = true;
  next_token_.assign(static_cast<size_t>(h.n_layers), 0);
  return {};
}

Status KvIncoming::check_chunk(const KvChunkDesc& d) const {
  if (!begun_) return invalid_argument("the first KV message must be the header");
  const std::string where = kv_chunk_name(d);
  if (d.layer < 0 || d.layer >= header_.n_layers) {
    return invalid_argument(where + ": layer outside [0, " + std::to_string(header_.n_layers) + ")");
  }
  if (d.token_count <= 0 || d.token_start != next_token_[d.layer] ||
      static_cast<int64_t>(d.token_start) + d.token_count > header_.n_tokens) {
    return invalid_argument(where + ": expected tokens from " + std::to_string(next_token_[d.layer]) +
                            " of this layer, within n_tokens " + std::to_string(header_.n_tokens));
  }
  if (d.k_bytes > kMaxKvChunkBytes || d.v_bytes > kMaxKvChunkBytes) {
    return invalid_argument(where + ": K or V larger than the limit of " + std::to_string(kMaxKvChunkBytes) + " bytes");
  }
  const int64_t want = kv_chunk_bytes(header_, d.token_count);
  if (d.k_bytes != want || d.v_bytes != want) {
    return invalid_argument(where + ": K has " + std::to_string(d.k_bytes) + " bytes and V " +
                            std::to_string(d.v_bytes) + ", the header's shape needs " + std::to_string(want) + " each");
  }
  return {};
}

Status KvIncoming::chunk(const KvChunk& c) {
  const KvChunkDesc d{c.layer, c.token_start, c.token_count, static_cast<int64_t>(c.k.size()),
                      static_cast<int64_t>(c.v.size())};
  BATON_RETURN_IF_ERROR(check_chunk(d));
  if (receiver_ == nullptr || settled_) return failed_precondition("no KV transfer in progress");
  if (kv_checksum(c.k, c.v) != c.checksum) return data_loss(kv_chunk_name(d) + ": checksum mismatch");
  BATON_RETURN_IF_ERROR(receiver_->kv_chunk(header_.request_id, c));
  next_token_[c.layer] += c.token_count;
  bytes_ += static_cast<int64_t>(c.k.size() + c.v.size());
  return {};
}

void KvIncoming::abort() {
  if (receiver_ == nullptr || settled_) return;
  settled_ = true;
  receiver_->kv_abort(header_.request_id);
}

Status KvIncoming::end(int32_t first_token) {
  if (!begun_) return invalid_argument("the KV stream ended before its header");
  for (int32_t layer = 0; layer < header_.n_layers; ++layer) {
    if (next_token_[layer] != header_.n_tokens) {
      return invalid_argument("the KV stream ended with layer " + std::to_string(layer) + " covering " +
                              std::to_string(next_token_[layer]) + " of " + std::to_string(header_.n_tokens) +
                              " tokens");
    }
  }
  if (receiver_ == nullptr || settled_) return failed_precondition("no KV transfer in progress");
  BATON_RETURN_IF_ERROR(receiver_->kv_end(header_.request_id, first_token));
  settled_ = true;
  return {};
}

}  // namespace baton
