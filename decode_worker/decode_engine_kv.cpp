// DecodeEngine as a KvReceiver: a prefill worker's KV lands in the reserved blocks (contract in
// kv/kv_transfer.h; the rest of the engine is in decode_engine.cpp). Every transport drives the
// engine through a KvIncoming (kv/kv_incoming.h), which has checked the stream itself: the
// header's shape, each chunk's place, size and checksum, every layer complete before kv_end.
// What is left here is the engine's own: the header against the model and the admission.
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
  seq->kv_begin_at = DecodeClock::now();
  seq->set_sampler_history(h.token_ids);
  if (seq->admit.n_forks > 0) seq->kv_tokens = h.token_ids;
  return {};
}

Status DecodeEngine::kv_chunk(const std::string& id, const KvChunk& c) {
  SeqPtr seq;
  {
    std::lock_guard lk(mu_);
    seq = find_locked(id);
    if (!seq || seq->state != SeqState::kWaitingKv || !seq->kv_begun) {
      return failed_precondition("no KV transfer in progress for request " + id + " on decode worker " + config_.name);
    }
    ++seq->n_importing;  // keeps `table` allocated to this request until the import returns
  }
  // The copy without the lock: it scales with the bytes moved.
  model_.backend().kv_import(*cache_, c.layer, seq->table.data(), c.token_start, c.token_count, c.k.data(),
                             c.v.data());
  std::lock_guard lk(mu_);
  if (--seq->n_importing == 0 && seq->free_when_idle) {
    seq->free_when_idle = false;
    pool_.release(seq->table);
    update_gauges_locked();
  }
  return {};
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
    seq->first_token = first_token;
    seq->kv_end_at = DecodeClock::now();
    seq->kv_transfer_seconds = seconds_between(seq->kv_begin_at, seq->kv_end_at);
    // Continue exactly where a single-process Generator would: the first token (sampled by the
    // prefill worker at position n_tokens) is the input there; draws are keyed by position.
    seq->next_token = seq->first_token;
    seq->position = n_tokens;
    seq->n_generated = 1;
    seq->sampler.observe(first_token);
    seq->state = SeqState::kRunning;
    --n_waiting_;
    hold_for_forks_locked(*seq, std::move(seq->kv_tokens));
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
  spdlog::info("decode req={} KV transfer aborted; reservation kept", id);
}

}  // namespace baton
