#include "kv/kv_probe.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "common/metrics.h"
#include "common/seconds.h"

namespace baton {
namespace {

std::string n_str(int64_t n) { return std::to_string(n); }

// 128 random bits in hex: a probe's request id ("probe-" + this), never an admitted request's.
std::string random_probe_id() {
  std::random_device rd;
  char buf[40];
  std::snprintf(buf, sizeof buf, "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return std::string("probe-") + buf;
}

std::string random_bytes(size_t n) {
  std::mt19937_64 rng(std::random_device{}());
  std::string s(n, '\0');
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t w = rng();
    for (size_t j = 0; j < 8 && i + j < n; ++j) s[i + j] = static_cast<char>(w >> (8 * j));
  }
  return s;
}

}  // namespace

int64_t kv_transfer_bytes(const KvTransferHeader& h) { return 2 * int64_t{h.n_layers} * kv_chunk_bytes(h, h.n_tokens); }

KvTransferHeader kv_probe_header(const KvProbeShape& shape, int64_t bytes) {
  KvTransferHeader h;
  h.request_id = random_probe_id();
  h.model_fingerprint = shape.model_fingerprint;
  h.dtype = shape.dtype;
  h.n_layers = shape.n_layers;
  h.n_kv_heads = shape.n_kv_heads;
  h.head_dim = shape.head_dim;
  h.n_tokens = 1;
  const int64_t per_token = kv_transfer_bytes(h);  // one token of every layer, K and V
  h.n_tokens = static_cast<int32_t>(std::clamp<int64_t>(per_token > 0 ? bytes / per_token : 1, 1, INT32_MAX));
  h.token_ids.assign(static_cast<size_t>(h.n_tokens), 0);
  h.probe = true;
  return h;
}

Status validate_kv_probe(const std::string& decode_address, int64_t bytes, int32_t rounds) {
  if (decode_address.empty()) return invalid_argument("decode_address is empty");
  if (bytes < 1 || bytes > kMaxKvProbeBytes) {
    return invalid_argument("bytes = " + n_str(bytes) + " is outside [1, " + n_str(kMaxKvProbeBytes) + "]");
  }
  if (rounds < 1 || rounds > kMaxKvProbeRounds) {
    return invalid_argument("rounds = " + n_str(rounds) + " is outside [1, " + n_str(kMaxKvProbeRounds) + "]");
  }
  return {};
}

// ---- sender ------------------------------------------------------------------------------------

KvProbeSource::KvProbeSource(const KvTransferHeader& header, int64_t chunk_bytes, const std::string& pattern,
                             const std::atomic<bool>& cancel)
    : header_(header), pattern_(pattern), cancel_(cancel) {
  const int64_t row = kv_chunk_bytes(header, 1);  // K (or V) of one token of one layer
  tokens_per_chunk_ = static_cast<int32_t>(std::clamp<int64_t>(chunk_bytes / (2 * row), 1, header.n_tokens));
}

bool KvProbeSource::next(KvChunk* c) {
  if (cancel_.load() || layer_ == header_.n_layers) return false;
  c->layer = layer_;
  c->token_start = token_;
  c->token_count = std::min(tokens_per_chunk_, header_.n_tokens - token_);
  const size_t n = static_cast<size_t>(kv_chunk_bytes(header_, c->token_count));
  // Copied out of the pattern as a real export copies out of the cache: the same host work.
  c->k.assign(pattern_.data(), n);
  c->v.assign(pattern_.data() + n, n);
  c->checksum = kv_checksum(c->k, c->v);
  token_ += c->token_count;
  if (token_ == header_.n_tokens) {
    token_ = 0;
    ++layer_;
  }
  return true;
}

std::optional<int32_t> KvProbeSource::first_token() {
  if (cancel_.load()) return std::nullopt;
  return 0;
}

Result<KvProbeResult> run_kv_probe(KvTransport& transport, const std::string& decode_address, const KvProbeShape& shape,
                                   int64_t bytes, int32_t rounds, int64_t chunk_bytes, const std::atomic<bool>& cancel) {
  BATON_RETURN_IF_ERROR(validate_kv_probe(decode_address, bytes, rounds));
  KvProbeResult r;
  r.transport = transport.name();
  const KvTransferHeader large = kv_probe_header(shape, bytes);
  const KvTransferHeader minimal = kv_probe_header(shape, 1);
  r.bytes = kv_transfer_bytes(large);
  r.latency_bytes = kv_transfer_bytes(minimal);
  // Room for K then V of the largest chunk: one buffer of random bytes serves every chunk.
  const int64_t row = kv_chunk_bytes(large, 1);
  const int64_t chunk_tokens = std::clamp<int64_t>(chunk_bytes / (2 * row), 1, large.n_tokens);
  const std::string pattern = random_bytes(static_cast<size_t>(2 * chunk_tokens * row));
  auto send = [&](const KvTransferHeader& h, std::vector<double>* seconds) -> Status {
    if (cancel.load()) return cancelled("the KV probe was cancelled");
    KvTransferHeader header = h;
    header.request_id = random_probe_id();  // each transfer its own id, as each request has
    KvProbeSource source(header, chunk_bytes, pattern, cancel);
    int64_t sent = 0;
    const auto t0 = std::chrono::steady_clock::now();
    BATON_RETURN_IF_ERROR(transport.send(decode_address, header, source, &sent));
    seconds->push_back(seconds_since(t0));
    return {};
  };
  for (int32_t i = 0; i < rounds; ++i) {
    BATON_RETURN_IF_ERROR(send(minimal, &r.latency_seconds));
    BATON_RETURN_IF_ERROR(send(large, &r.seconds));
  }
  return r;
}

// ---- receiver ----------------------------------------------------------------------------------

KvProbeSink::KvProbeSink(KvProbeShape expected, const std::string& name, Metrics* metrics)
    : expected_(std::move(expected)) {
  if (metrics == nullptr) return;
  auto labels = Metrics::role_labels("decode", name);
  bytes_ = &metrics->kv_probe_bytes_total.Add(labels);
  labels["result"] = "ok";
  ok_ = &metrics->kv_probes_total.Add(labels);
  labels["result"] = "failed";
  failed_ = &metrics->kv_probes_total.Add(labels);
}

Status KvProbeSink::kv_begin(const KvTransferHeader& h) {
  auto refuse = [this](Status s) {
    if (failed_) failed_->Increment();
    return s;
  };
  const std::string what = "KV probe " + h.request_id;
  if (!h.probe) return refuse(invalid_argument(what + " is not flagged as a probe"));
  if (h.model_fingerprint != expected_.model_fingerprint) {
    return refuse(failed_precondition(what + " comes from model fingerprint '" + h.model_fingerprint +
                                      "' but this decode worker serves '" + expected_.model_fingerprint +
                                      "' (deploy the same model file on every role)"));
  }
  if (h.dtype != expected_.dtype) {
    return refuse(failed_precondition(what + " is " + h.dtype + " but this decode worker's KV cache is " +
                                      expected_.dtype + " (set the same --kv-dtype on both workers)"));
  }
  if (h.n_layers != expected_.n_layers || h.n_kv_heads != expected_.n_kv_heads || h.head_dim != expected_.head_dim) {
    return refuse(failed_precondition(what + " has shape " + n_str(h.n_layers) + " layers x " + n_str(h.n_kv_heads) +
                                      " kv heads x " + n_str(h.head_dim) + " but the model has " +
                                      n_str(expected_.n_layers) + " x " + n_str(expected_.n_kv_heads) + " x " +
                                      n_str(expected_.head_dim)));
  }
  if (kv_transfer_bytes(h) > kMaxKvProbeBytes) {
    return refuse(invalid_argument(what + " holds " + n_str(kv_transfer_bytes(h)) + " bytes, over the limit of " +
                                   n_str(kMaxKvProbeBytes)));
  }
  int n = in_flight_.load();
  do {
    if (n >= kMaxKvProbesInFlight) {
      return refuse(resource_exhausted("this decode worker is taking " + n_str(n) +
                                       " KV probes already: probe again when they are done"));
    }
  } while (!in_flight_.compare_exchange_weak(n, n + 1));
  return {};
}

Status KvProbeSink::kv_chunk(const std::string&, const KvChunk& c) {
  // KvIncoming has checked the chunk's place, size and checksum: nothing is kept.
  if (bytes_) bytes_->Increment(static_cast<double>(c.k.size() + c.v.size()));
  return {};
}

Status KvProbeSink::kv_end(const std::string&, int32_t) {
  --in_flight_;
  ++n_received_;
  if (ok_) ok_->Increment();
  return {};
}

void KvProbeSink::kv_abort(const std::string&) {
  --in_flight_;
  if (failed_) failed_->Increment();
}

}  // namespace baton
