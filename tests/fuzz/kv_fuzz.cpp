// libFuzzer target: a KV stream as a hostile or broken prefill worker could send it, through
// KvIncoming (kv/kv_incoming.h) as every transport drives it. The input is a program of messages
// (headers with any shape, chunks with any placement and size, ends, aborts, in any order); the
// receiver behind KvIncoming checks the receiving contract itself (kv/kv_transfer.h: begin once,
// every chunk in place, of the header's size and intact, end only when every layer is complete,
// abort exactly once after a begin that succeeded) and aborts the process when it is broken, and
// refuses some calls as a real receiver would (a header that is not its model's, a chunk it
// cannot take). Nothing here may crash, and no allocation may follow a header's size unchecked
// (-rss_limit_mb in scripts/fuzz.sh).
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "kv/kv_incoming.h"
#include "kv/kv_transfer.h"

namespace baton {
namespace {

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "KvReceiver contract broken: %s\n", what);
  std::abort();
}

// The contract, checked from the receiver's side with its own bookkeeping.
class ContractReceiver final : public KvReceiver {
 public:
  explicit ContractReceiver(FuzzedDataProvider& in) : in_(in) {}

  Status kv_begin(const KvTransferHeader& h) override {
    if (begun_) broken("a second kv_begin");
    if (h.n_layers <= 0 || h.n_layers > kMaxKvLayers || h.n_kv_heads <= 0 || h.head_dim <= 0 || h.n_tokens <= 0) {
      broken("a header whose shape was not checked");
    }
    if (static_cast<int64_t>(h.token_ids.size()) != h.n_tokens) broken("token_ids not n_tokens long");
    if (kv_chunk_bytes(h, 1) > kMaxKvChunkBytes) broken("one token's K over the chunk limit");
    if (h.request_id.empty() || h.request_id.size() > kMaxPeerStringBytes) broken("an unchecked request_id");
    // A receiver refuses what is not its model's or does not fit: here, by the input's say.
    if (in_.ConsumeBool()) return failed_precondition("not this model's shape");
    begun_ = true;
    header_ = h;
    next_.assign(static_cast<size_t>(h.n_layers), 0);
    return {};
  }

  Status kv_chunk(const std::string& id, const KvChunk& c) override {
    if (!begun_ || ended_ || aborted_) broken("a chunk outside a transfer");
    if (id != header_.request_id) broken("a chunk for another request");
    if (c.layer < 0 || c.layer >= header_.n_layers) broken("a chunk's layer outside the header");
    if (c.token_count <= 0 || c.token_start != next_[static_cast<size_t>(c.layer)] ||
        int64_t{c.token_start} + c.token_count > header_.n_tokens) {
      broken("a chunk out of place");
    }
    const int64_t want = kv_chunk_bytes(header_, c.token_count);
    if (static_cast<int64_t>(c.k.size()) != want || static_cast<int64_t>(c.v.size()) != want) broken("a chunk's size");
    if (kv_checksum(c.k, c.v) != c.checksum) broken("a chunk that is not intact");
    if (in_.ConsumeIntegralInRange<int>(0, 15) == 0) return resource_exhausted("no room for it");
    next_[static_cast<size_t>(c.layer)] += c.token_count;
    return {};
  }

  Status kv_end(const std::string& id, int32_t) override {
    if (!begun_ || ended_ || aborted_) broken("an end outside a transfer");
    if (id != header_.request_id) broken("an end for another request");
    for (int32_t n : next_) {
      if (n != header_.n_tokens) broken("an end before every layer is complete");
    }
    if (in_.ConsumeIntegralInRange<int>(0, 7) == 0) return invalid_argument("a first token outside the vocabulary");
    ended_ = true;
    return {};
  }

  void kv_abort(const std::string& id) override {
    if (!begun_ || ended_ || aborted_) broken("an abort outside a transfer, or twice");
    if (id != header_.request_id) broken("an abort for another request");
    aborted_ = true;
  }

 private:
  FuzzedDataProvider& in_;
  bool begun_ = false, ended_ = false, aborted_ = false;
  KvTransferHeader header_;
  std::vector<int32_t> next_;
};

// An int32 that is often small and sometimes at an edge.
int32_t field(FuzzedDataProvider& in, int32_t small) {
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: return std::numeric_limits<int32_t>::max();
    case 1: return std::numeric_limits<int32_t>::min();
    case 2: return in.ConsumeIntegral<int32_t>();
    case 3: return 0;
    case 4: return kMaxKvLayers + in.ConsumeIntegralInRange<int32_t>(-1, 1);
    default: return in.ConsumeIntegralInRange<int32_t>(1, small);
  }
}

std::string text(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 9)) {
    case 0: return std::string(kMaxPeerStringBytes + 1, 'r');
    case 1: return "";
    default: return in.ConsumeRandomLengthString(24);
  }
}

KvTransferHeader header(FuzzedDataProvider& in) {
  KvTransferHeader h;
  h.request_id = in.ConsumeBool() ? "r" : text(in);
  h.model_fingerprint = text(in);
  static const char* const kDtypes[] = {"f32", "bf16", "f16", "f64", "", "F32"};
  h.dtype = kDtypes[in.ConsumeIntegralInRange<size_t>(0, 5)];
  h.n_layers = field(in, 4);
  h.n_kv_heads = field(in, 4);
  h.head_dim = field(in, 16);
  h.n_tokens = field(in, 24);
  // token_ids as many as n_tokens most of the time (bounded here: the size is what is checked).
  const int64_t n = in.ConsumeBool() && h.n_tokens > 0 && h.n_tokens <= 4096 ? h.n_tokens : in.ConsumeIntegralInRange<int>(0, 40);
  h.token_ids.assign(static_cast<size_t>(n), in.ConsumeIntegral<int32_t>());
  h.probe = in.ConsumeIntegralInRange<int>(0, 9) == 0;
  return h;
}

KvChunk chunk(FuzzedDataProvider& in, const KvIncoming& incoming, std::vector<int32_t>& placed) {
  KvChunk c;
  const KvTransferHeader& h = incoming.header();
  const bool fit = incoming.begun() && in.ConsumeBool();
  if (fit) {  // a chunk that can be right: the next tokens of a layer, of the header's size
    c.layer = in.ConsumeIntegralInRange<int32_t>(0, h.n_layers - 1);
    if (placed.size() < static_cast<size_t>(h.n_layers)) placed.resize(static_cast<size_t>(h.n_layers), 0);
    c.token_start = placed[static_cast<size_t>(c.layer)];
    c.token_count = in.ConsumeIntegralInRange<int32_t>(1, 8);
  } else {
    c.layer = field(in, 4);
    c.token_start = field(in, 24);
    c.token_count = field(in, 8);
  }
  int64_t bytes = incoming.begun() ? kv_chunk_bytes(h, std::max(c.token_count, 0)) : in.ConsumeIntegralInRange<int64_t>(0, 256);
  if (bytes < 0 || bytes > (int64_t{1} << 16)) bytes = in.ConsumeIntegralInRange<int64_t>(0, 256);  // never allocate much here
  bytes += in.ConsumeIntegralInRange<int>(0, 3) == 0 ? in.ConsumeIntegralInRange<int64_t>(-2, 2) : 0;
  if (bytes < 0) bytes = 0;
  c.k.assign(static_cast<size_t>(bytes), static_cast<char>(in.ConsumeIntegral<uint8_t>()));
  c.v.assign(static_cast<size_t>(bytes), static_cast<char>(in.ConsumeIntegral<uint8_t>()));
  c.checksum = kv_checksum(c.k, c.v) ^ (in.ConsumeIntegralInRange<int>(0, 9) == 0 ? 1 : 0);
  if (fit && c.layer >= 0 && c.layer < static_cast<int32_t>(placed.size())) placed[static_cast<size_t>(c.layer)] += c.token_count;
  return c;
}

}  // namespace
}  // namespace baton

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace baton;
  FuzzedDataProvider in(data, size);
  ContractReceiver engine(in), probe(in);
  {
    KvIncoming incoming(engine, in.ConsumeBool() ? &probe : nullptr);
    std::vector<int32_t> placed;
    for (int step = 0; step < 256 && in.remaining_bytes() > 0; ++step) {
      Status s;
      switch (in.ConsumeIntegralInRange<int>(0, 7)) {
        case 0: s = incoming.begin(header(in)); break;
        case 5: {
          KvChunkDesc d{field(in, 4), field(in, 24), field(in, 8), in.ConsumeIntegral<int64_t>(), in.ConsumeIntegral<int64_t>()};
          s = incoming.check_chunk(d);
          break;
        }
        case 6: s = incoming.end(in.ConsumeIntegral<int32_t>()); break;
        case 7:
          incoming.abort();
          break;
        default: s = incoming.chunk(chunk(in, incoming, placed)); break;
      }
      // A refusal quotes the stream's fields: it must stay small enough to travel as a status.
      if (s.message().size() > 4096) {
        std::fprintf(stderr, "a %zu-byte refusal\n", s.message().size());
        std::abort();
      }
      // As a transport does: the first refusal ends the transfer.
      if (!s.ok() && in.ConsumeBool()) {
        incoming.abort();
        break;
      }
    }
  }  // the destructor aborts what is not settled
  return 0;
}
