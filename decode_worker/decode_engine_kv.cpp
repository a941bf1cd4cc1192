// DecodeEngine as a KvReceiver: a prefill worker's KV lands in the reserved blocks (contract in
// kv/kv_transfer.h; the rest of the engine is in decode_engine.cpp).
#include <spdlog/spdlog.h>

#include <algorithm>

#include "decode_worker/decode_engine.h"
#include "decode_worker/decode_sequence.h"
#include "model/token_checks.h"

namespace baton {

// ---- KV hand-off ------------------------------------------------------------------------------

Status DecodeEngine::kv_begin(const KvTransferHeader& h) {
  const ModelConfig& mc = model_.config();
  const std::string& id = h.request_id;
  if (h.model_fingerprint != model_.fingerprint()) {
    return failed_precondition("KV for request " + id + " comes from model fingerprint '" + h.model_fingerprint +
                               "' but this decode worker serves '" + model_.fingerprint() + "'");
  }
  const std::string want_dtype = dtype_name(config_.kv_dtype);
  if (h.dtype != want_dtype) {
    return failed_precondition("KV for request " + id + " is " + h.dtype + " but this decode worker's KV cache is " +
                               want_dtype + " (set the same --kv-dtype on both workers)");
  }
  if (h.n_layers != mc.n_layers || h.n_kv_heads != mc.n_kv_heads || h.head_dim != mc.head_dim) {
    return failed_precondition("KV for request " + id + " has shape " + n_str(h.n_layers) + " layers x " +
                               n_str(h.n_kv_heads) + " kv heads x " + n_str(h.head_dim) + " but the model has " +
                               n_str(mc.n_layers) + " x " + n_str(mc.n_kv_heads) + " x " + n_str(mc.head_dim));
  }
  if (static_cast<int64_t>(h.token_ids.size()) != h.n_tokens) {
    return invalid_argument("KV header for request " + id + " lists " +
                            n_str(static_cast<int64_t>(h.token_ids.size())) + " token ids for n_tokens " +
                            n_str(h.n_tokens));
  }
  BATON_RETURN_IF_ERROR(check_token_ids(h.token_ids, mc, "KV header for request " + id + ": token_ids"));

  std::lock_guard lk(mu_);
  if (stopping_) return unavailable("decode worker " + config_.name + " is shutting down");
  SeqPtr seq = find_locked(id);
  if (!seq || seq->state != SeqState::kWaitingKv) {
    return failed_precondition("request " + id + " is not admitted (or no longer waiting for KV) on decode worker " +
                               config_.name);
  }
  const auto& senders = seq->admit.kv_senders;
  const std::string& certificate = seq->admit.kv_sender_certificate;
  if (!certificate.empty()) {
    if (h.sender_certificate != certificate) {
      return permission_denied("KV for request " + id + " comes from a peer proving " +
                               (h.sender_certificate.empty() ? std::string("no certificate")
                                                             : "certificate '" + h.sender_certificate + "'") +
                               ", not the prefill worker's its Admit named");
    }
  } else if (!senders.empty() && std::find(senders.begin(), senders.end(), h.sender) == senders.end()) {
    return permission_denied("KV for request " + id + " comes from " + h.sender +
                             ", not from the prefill worker its Admit named");
  }
  if (h.n_tokens != seq->admit.n_prompt_tokens) {
    return invalid_argument("KV for request " + id + " covers " + n_str(h.n_tokens) + " tokens but " +
                            n_str(seq->admit.n_prompt_tokens) + " were admitted");
  }
  if (seq->kv_begun) return failed_precondition("a KV transfer for request " + id + " is already in progress");
  seq->kv_begun = true;
  ++seq->kv_epoch;
  seq->covered.assign(static_cast<size_t>(mc.n_layers) * h.n_tokens, 0);
  seq->n_covered = 0;
  seq->kv_begin_at = DecodeClock::now();
  return {};
}

Status DecodeEngine::kv_chunk(const std::string& id, const KvChunk& c) {
  const ModelConfig& mc = model_.config();
  SeqPtr seq;
  uint64_t epoch = 0;
  {
    std::lock_guard lk(mu_);
    seq = find_locked(id);
    if (!seq || seq->state != SeqState::kWaitingKv || !seq->kv_begun) {
      return failed_precondition("no KV transfer in progress for request " + id + " on decode worker " + config_.name);
    }
    const int64_t n_tokens = seq->admit.n_prompt_tokens;
    if (c.layer < 0 || c.layer >= mc.n_layers) {
      return invalid_argument("KV chunk for request " + id + " names layer " + n_str(c.layer) + " of " +
                              n_str(mc.n_layers));
    }
    if (c.token_count < 1 || c.token_start < 0 || int64_t{c.token_start} + c.token_count > n_tokens) {
      return invalid_argument("KV chunk for request " + id + " covers tokens [" + n_str(c.token_start) + ", " +
                              n_str(int64_t{c.token_start} + c.token_count) + "), outside [0, " + n_str(n_tokens) +
                              ")");
    }
    const int64_t bytes = int64_t{c.token_count} * mc.n_kv_heads * mc.head_dim * dtype_size(config_.kv_dtype);
    if (bytes > kMaxKvChunkBytes) {
      return invalid_argument("KV chunk for request " + id + " is " + n_str(bytes) + " bytes, over the limit of " +
                              n_str(kMaxKvChunkBytes) + ": send fewer tokens per chunk");
    }
    if (static_cast<int64_t>(c.k.size()) != bytes || static_cast<int64_t>(c.v.size()) != bytes) {
      return invalid_argument("KV chunk for request " + id + " layer " + n_str(c.layer) + " has " +
                              n_str(static_cast<int64_t>(c.k.size())) + " K and " +
                              n_str(static_cast<int64_t>(c.v.size())) + " V bytes; " + n_str(c.token_count) +
                              " tokens need " + n_str(bytes) + " each");
    }
    ++seq->n_importing;  // keeps `table` allocated to this request until the import returns
    epoch = seq->kv_epoch;
  }

  // Checksum and copy without the lock: they scale with the bytes moved.
  Status st;
  if (kv_checksum(c.k, c.v) != c.checksum) {
    st = data_loss("KV chunk for request " + id + " layer " + n_str(c.layer) + " tokens [" + n_str(c.token_start) +
                   ", " + n_str(int64_t{c.token_start} + c.token_count) + ") fails its checksum");
  } else {
    model_.backend().kv_import(*cache_, c.layer, seq->table.data(), c.token_start, c.token_count, c.k.data(),
                               c.v.data());
  }

  std::lock_guard lk(mu_);
  --seq->n_importing;
  if (st.ok() && seq->state == SeqState::kWaitingKv && seq->kv_epoch == epoch) {
    uint8_t* row = seq->covered.data() + static_cast<size_t>(c.layer) * seq->admit.n_prompt_tokens;
    for (int32_t t = c.token_start; t < c.token_start + c.token_count; ++t) {
      seq->n_covered += row[t] == 0;
      row[t] = 1;
    }
  }
  if (seq->n_importing == 0 && seq->free_when_idle) {
    seq->free_when_idle = false;
    pool_.release(seq->table);
    update_gauges_locked();
  }
  return st;
}

Status DecodeEngine::kv_end(const std::string& id, int32_t first_token) {
  const ModelConfig& mc = model_.config();
  BATON_RETURN_IF_ERROR(check_token_id(first_token, mc, "KV transfer for request " + id + ": first_token"));
  {
    std::lock_guard lk(mu_);
    SeqPtr seq = find_locked(id);
    if (!seq || seq->state != SeqState::kWaitingKv || !seq->kv_begun) {
      return failed_precondition("no KV transfer in progress for request " + id + " on decode worker " + config_.name);
    }
    const int32_t n_tokens = seq->admit.n_prompt_tokens;
    if (seq->n_covered != int64_t{mc.n_layers} * n_tokens) {
      for (int layer = 0; layer < mc.n_layers; ++layer) {
        const uint8_t* row = seq->covered.data() + static_cast<size_t>(layer) * n_tokens;
        const int64_t got = std::count(row, row + n_tokens, uint8_t{1});
        if (got != n_tokens) {
          return invalid_argument("KV transfer for request " + id + " ended with layer " + n_str(layer) + " holding " +
                                  n_str(got) + " of " + n_str(n_tokens) + " tokens");
        }
      }
    }
    seq->first_token = first_token;
    seq->kv_end_at = DecodeClock::now();
    seq->kv_transfer_seconds = seconds_between(seq->kv_begin_at, seq->kv_end_at);
    seq->covered = {};
    // Continue exactly where a single-process Generator would: the first token (sampled by the
    // prefill worker at position n_tokens) is the input there; draws are keyed by position.
    seq->next_token = seq->first_token;
    seq->position = n_tokens;
    seq->n_generated = 1;
    seq->state = SeqState::kRunning;
    --n_waiting_;
    if (const FinishReason end = stop_rule(seq->admit).after(seq->first_token, seq->n_generated);
        end != FinishReason::kNone) {
      finish_locked(seq, {}, finish_reason_name(end));
    } else {
      running_.push_back(seq);
    }
    update_gauges_locked();
    work_ = true;
  }
  cv_.notify_one();
  return {};
}

void DecodeEngine::kv_abort(const std::string& id) {
  std::lock_guard lk(mu_);
  SeqPtr seq = find_locked(id);
  if (!seq || seq->state != SeqState::kWaitingKv) return;
  seq->kv_begun = false;
  ++seq->kv_epoch;
  seq->covered = {};
  seq->n_covered = 0;
  spdlog::info("decode req={} KV transfer aborted; reservation kept", id);
}

}  // namespace baton
