#include "decode_worker/decode_engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <span>

#include "common/metrics.h"
#include "model/batch.h"

namespace baton {
namespace {

// A finished request whose Stream never attaches is forgotten after this long (its blocks were
// freed when it finished; only the buffered events are kept).
constexpr auto kUndeliveredTtl = std::chrono::minutes(2);

double seconds_between(DecodeClock::time_point a, DecodeClock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::string n_str(int64_t n) {
  return std::to_string(n);
}

}  // namespace

Status validate_decode_config(const DecodeConfig& c) {
  if (c.max_batch < 1) return invalid_argument("max_batch must be >= 1 (got " + n_str(c.max_batch) + ")");
  if (c.block_size < 1) return invalid_argument("block_size must be >= 1 (got " + n_str(c.block_size) + ")");
  if (c.n_blocks < 1) return invalid_argument("n_blocks must be >= 1 (got " + n_str(c.n_blocks) + ")");
  return {};
}

int64_t decode_kv_block_bytes(const ModelConfig& m, int block_size, DType kv_dtype) {
  return int64_t{2} * m.n_layers * block_size * m.n_kv_heads * m.head_dim * static_cast<int64_t>(dtype_size(kv_dtype));
}

enum class SeqState {
  kWaitingKv,  // admitted: blocks reserved, KV not (completely) arrived
  kRunning,    // KV complete: in running_, generating
  kFinished,   // ended; blocks freed (or freed when the last import returns); events may wait for a sink
};

// One request. Fields marked (engine) are touched only by the engine thread once the sequence is
// running; everything else is guarded by DecodeEngine::mu_.
struct DecodeEngine::Sequence {
  explicit Sequence(const DecodeAdmit& a) : admit(a), sampler(a.sampling) {}

  DecodeAdmit admit;
  SeqState state = SeqState::kWaitingKv;
  std::vector<int32_t> table;  // blocks covering n_prompt_tokens + max_tokens positions
  DecodeClock::time_point admitted_at = DecodeClock::now();

  // ---- KV transfer (kWaitingKv) ----
  bool kv_begun = false;
  uint64_t kv_epoch = 0;  // bumped by begin/abort: an import from an aborted transfer counts for nothing
  int32_t first_token = 0;
  std::vector<uint8_t> covered;  // [n_layers][n_prompt_tokens]: position received
  int64_t n_covered = 0;
  int n_importing = 0;          // kv_import calls in flight (outside the lock) into `table`
  bool free_when_idle = false;  // finished while importing: the last import frees the blocks
  DecodeClock::time_point kv_begin_at, kv_end_at;

  // ---- decoding ----
  Sampler sampler;                   // (engine)
  int32_t next_token = 0;            // (engine) input of the next step
  int32_t position = 0;              // (engine) its position
  int32_t n_generated = 0;           // tokens produced, counting the first (from prefill)
  bool stepped = false;              // the first decode step ran
  std::optional<Status> cancel_why;  // a running sequence ends with this at the next step boundary

  // ---- output ----
  DecodeSink sink;       // set once by attach()
  DecodeOutput pending;  // events not yet handed to the sink, merged
  bool has_pending = false;
  bool timing_sent = false;  // the timings go on the first delivered event only
  double decode_queue_seconds = 0;
  double kv_transfer_seconds = 0;
  DecodeClock::time_point finished_at;
};

Result<std::unique_ptr<DecodeEngine>> DecodeEngine::create(Model& model, std::vector<int32_t> stop_ids,
                                                           const DecodeConfig& config, Metrics* metrics) {
  BATON_RETURN_IF_ERROR(validate_decode_config(config));
  return std::unique_ptr<DecodeEngine>(new DecodeEngine(model, std::move(stop_ids), config, metrics));
}

DecodeEngine::DecodeEngine(Model& model, std::vector<int32_t> stop_ids, const DecodeConfig& config, Metrics* metrics)
    : model_(model),
      stop_ids_(std::move(stop_ids)),
      config_(config),
      cache_(model.make_kv_cache(config.n_blocks, config.block_size, config.kv_dtype)),
      pool_(config.n_blocks, config.block_size) {
  if (metrics != nullptr) {
    const auto labels = Metrics::role_labels("decode", config.name);
    g_running_ = &metrics->running_sequences.Add(labels);
    g_waiting_ = &metrics->queue_depth.Add(labels);
    g_blocks_free_ = &metrics->kv_blocks_free.Add(labels);
    g_blocks_total_ = &metrics->kv_blocks_total.Add(labels);
  }
  std::lock_guard lk(mu_);
  update_gauges_locked();
}

DecodeEngine::~DecodeEngine() {
  stop();
}

void DecodeEngine::start() {
  std::lock_guard lk(mu_);
  if (started_ || stopping_) return;
  started_ = true;
  thread_ = std::thread([this] { run(); });
}

void DecodeEngine::stop() {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
    work_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();

  // The engine thread is gone: end everything still live, hand out what sinks are owed, forget
  // the rest.
  std::vector<Delivery> deliveries;
  {
    std::lock_guard lk(mu_);
    const Status why = unavailable("decode worker " + config_.name + " is shutting down");
    for (auto& [id, seq] : seqs_) finish_locked(seq, why, "");
    collect_deliveries_locked(&deliveries);
    seqs_.clear();
    update_gauges_locked();
  }
  deliver(deliveries);
}

// ---- admission ----------------------------------------------------------------------------------

Status DecodeEngine::admit(const DecodeAdmit& r, int64_t* reserved_blocks) {
  const ModelConfig& mc = model_.config();
  if (r.request_id.empty()) return invalid_argument("request_id is empty");
  if (r.model_fingerprint != model_.fingerprint()) {
    return failed_precondition("request " + r.request_id + " is for model fingerprint '" + r.model_fingerprint +
                               "' but decode worker " + config_.name + " serves '" + model_.fingerprint() + "'");
  }
  if (r.n_prompt_tokens < 1)
    return invalid_argument("n_prompt_tokens must be >= 1 (got " + n_str(r.n_prompt_tokens) + ")");
  if (r.max_tokens < 1) return invalid_argument("max_tokens must be >= 1 (got " + n_str(r.max_tokens) + ")");
  const int64_t n_positions = int64_t{r.n_prompt_tokens} + r.max_tokens;
  if (n_positions > mc.n_ctx) {
    return invalid_argument("prompt (" + n_str(r.n_prompt_tokens) + " tokens) + max_tokens (" + n_str(r.max_tokens) +
                            ") exceeds the model's context of " + n_str(mc.n_ctx));
  }
  BATON_RETURN_IF_ERROR(validate_sampling(r.sampling));

  std::lock_guard lk(mu_);
  if (stopping_) return unavailable("decode worker " + config_.name + " is shutting down");
  if (seqs_.count(r.request_id) != 0) return invalid_argument("request " + r.request_id + " is already admitted");
  const int n_blocks = pool_.blocks_for(n_positions);
  if (n_blocks > pool_.n_total()) {
    return resource_exhausted("request " + r.request_id + " needs " + n_str(n_blocks) + " KV blocks (" +
                              n_str(n_positions) + " tokens), more than decode worker " + config_.name + " has (" +
                              n_str(pool_.n_total()) + " blocks of " + n_str(pool_.block_size()) + " tokens)");
  }
  auto seq = std::make_shared<Sequence>(r);
  if (!pool_.grow_to(seq->table, n_positions)) {
    return resource_exhausted("request " + r.request_id + " needs " + n_str(n_blocks) +
                              " KV blocks but decode worker " + config_.name + " has " + n_str(pool_.n_free()) +
                              " of " + n_str(pool_.n_total()) + " free: retry later or elsewhere");
  }
  seqs_.emplace(r.request_id, seq);
  ++n_waiting_;
  update_gauges_locked();
  if (r.deadline) work_ = true;  // the engine thread re-arms its timer
  if (reserved_blocks != nullptr) *reserved_blocks = n_blocks;
  spdlog::info("decode req={} admitted: {} prompt tokens, max_tokens {}, {} blocks reserved, {} free", r.request_id,
               r.n_prompt_tokens, r.max_tokens, n_blocks, pool_.n_free());
  if (r.deadline) cv_.notify_one();
  return {};
}

namespace {

// Stream and Release for a request come from the peer that admitted it, or not at all.
Status check_owner(const std::string& id, const std::string& admitted_by, const std::string& caller) {
  if (admitted_by.empty() || caller == admitted_by) return {};
  return permission_denied("request " + id + " was admitted by another peer (" + admitted_by +
                           "); Stream and Release are honoured only from the peer that admitted it");
}

}  // namespace

Status DecodeEngine::attach(const std::string& id, DecodeSink sink, std::optional<DecodeClock::time_point> deadline,
                            const std::string& owner) {
  BATON_CHECK(sink != nullptr, "attach needs a sink");
  {
    std::lock_guard lk(mu_);
    if (stopping_) return unavailable("decode worker " + config_.name + " is shutting down");
    SeqPtr seq = find_locked(id);
    if (!seq) return not_found("request " + id + " is not admitted on decode worker " + config_.name);
    BATON_RETURN_IF_ERROR(check_owner(id, seq->admit.owner, owner));
    if (seq->sink) return failed_precondition("request " + id + " already has a stream attached");
    seq->sink = std::move(sink);
    if (deadline) seq->admit.deadline = deadline;
    work_ = true;  // buffered events to deliver, or a new deadline to arm
  }
  cv_.notify_one();
  return {};
}

void DecodeEngine::cancel(const std::string& id, const Status& why) {
  const Status reason = why.ok() ? cancelled("request " + id + " was cancelled") : why;
  {
    std::lock_guard lk(mu_);
    SeqPtr seq = find_locked(id);
    if (!seq || seq->state == SeqState::kFinished) return;
    if (seq->state == SeqState::kRunning) {
      if (!seq->cancel_why) seq->cancel_why = reason;  // applied by the engine at the step boundary
      work_ = true;
    } else {
      finish_locked(seq, reason, "");
    }
  }
  cv_.notify_one();
}

Status DecodeEngine::release(const std::string& id, const std::string& owner) {
  {
    std::lock_guard lk(mu_);
    SeqPtr seq = find_locked(id);
    if (!seq) return {};
    BATON_RETURN_IF_ERROR(check_owner(id, seq->admit.owner, owner));
    const Status why = cancelled("request " + id + "'s reservation was released");
    if (seq->state == SeqState::kRunning) {
      if (!seq->cancel_why) seq->cancel_why = why;
      work_ = true;
    } else if (seq->sink) {
      finish_locked(seq, why, "");  // an open stream still gets its final event
    } else {
      finish_locked(seq, why, "");
      seqs_.erase(id);
    }
    update_gauges_locked();
  }
  cv_.notify_one();
  return {};
}

bool DecodeEngine::stalled(DecodeClock::time_point now, std::chrono::nanoseconds limit) const {
  std::lock_guard lk(mu_);
  return !in_wait_ && !running_.empty() && now - beat_ > limit;
}

DecodeLoad DecodeEngine::load() const {
  std::lock_guard lk(mu_);
  DecodeLoad l;
  l.free_blocks = pool_.n_free();
  l.total_blocks = pool_.n_total();
  l.block_size = pool_.block_size();
  l.n_running = static_cast<int32_t>(running_.size());
  l.n_waiting = n_waiting_;
  return l;
}

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
  for (int32_t t : h.token_ids) {
    if (t < 0 || t >= mc.n_vocab)
      return invalid_argument("KV header for request " + id + " has token id " + n_str(t) + " outside the vocabulary");
  }

  std::lock_guard lk(mu_);
  if (stopping_) return unavailable("decode worker " + config_.name + " is shutting down");
  SeqPtr seq = find_locked(id);
  if (!seq || seq->state != SeqState::kWaitingKv) {
    return failed_precondition("request " + id + " is not admitted (or no longer waiting for KV) on decode worker " +
                               config_.name);
  }
  const auto& senders = seq->admit.kv_senders;
  if (!senders.empty() && std::find(senders.begin(), senders.end(), h.sender) == senders.end()) {
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
  if (first_token < 0 || first_token >= mc.n_vocab) {
    return invalid_argument("KV transfer for request " + id + " ends with first token " + n_str(first_token) +
                            ", outside the vocabulary [0, " + n_str(mc.n_vocab) + ")");
  }
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
    if (!seq->admit.ignore_eos && is_stop(seq->first_token)) {
      finish_locked(seq, {}, "stop");
    } else if (seq->n_generated >= seq->admit.max_tokens) {
      finish_locked(seq, {}, "length");
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

// ---- the engine thread ------------------------------------------------------------------------

void DecodeEngine::run() {
  if (Status s = model_.backend().bind_thread(); !s.ok()) {
    spdlog::warn("decode worker {}: {}; the step loop runs unpinned", config_.name, s.to_string());
  }
  std::vector<SeqPtr> batch;
  std::vector<int32_t> sampled;
  std::vector<Delivery> deliveries;
  std::unique_lock lk(mu_);
  while (true) {
    work_ = false;
    beat_ = DecodeClock::now();
    // Step boundary: apply cancellations, deadlines; hand out events.
    for (size_t i = 0; i < running_.size();) {
      SeqPtr seq = running_[i];
      if (seq->cancel_why) {
        finish_locked(seq, *seq->cancel_why, "");  // erases it from running_
      } else {
        ++i;
      }
    }
    const auto next_wake = expire_locked(DecodeClock::now());
    collect_deliveries_locked(&deliveries);
    update_gauges_locked();
    if (!deliveries.empty()) {
      lk.unlock();
      deliver(deliveries);
      lk.lock();
    }
    if (stopping_) break;
    if (running_.empty()) {
      in_wait_ = true;  // waiting for work is not a stall, however long
      if (next_wake) {
        cv_.wait_until(lk, *next_wake, [this] { return work_; });
      } else {
        cv_.wait(lk, [this] { return work_; });
      }
      in_wait_ = false;
      continue;
    }

    // First come, first served: the first max_batch runnable sequences (blocks are reserved at
    // admission, so nothing is ever preempted and everything that waits gets a slot in turn).
    const size_t n = std::min(running_.size(), static_cast<size_t>(config_.max_batch));
    batch.assign(running_.begin(), running_.begin() + static_cast<std::ptrdiff_t>(n));
    const auto step_start = DecodeClock::now();
    lk.unlock();
    step(batch, &sampled);
    lk.lock();

    for (size_t i = 0; i < batch.size(); ++i) {
      Sequence& s = *batch[i];
      if (!s.stepped) {
        s.stepped = true;
        s.decode_queue_seconds = seconds_between(s.kv_end_at, step_start);
      }
      const int32_t id = sampled[i];
      if (id == kNonFiniteLogits) {
        // No token comes of a broken step: the request ends INTERNAL, the others go on.
        spdlog::error("decode req={}: the logits at position {} are not finite (NaN or infinity); ending it",
                      s.admit.request_id, s.position + 1);
        finish_locked(batch[i], internal_error("decode worker " + config_.name + ": the logits at position " +
                                                   std::to_string(s.position + 1) +
                                                   " are not finite (NaN or infinity); no token was produced"),
                      "");
        continue;
      }
      ++s.n_generated;
      s.pending.token_ids.push_back(id);
      s.has_pending = true;
      if (!s.admit.ignore_eos && is_stop(id)) {
        finish_locked(batch[i], {}, "stop");
      } else if (s.n_generated >= s.admit.max_tokens) {
        finish_locked(batch[i], {}, "length");
      } else {
        s.next_token = id;
        ++s.position;
      }
    }
  }
}

void DecodeEngine::step(const std::vector<SeqPtr>& batch, std::vector<int32_t>* sampled) {
  StepBatch b;
  for (const SeqPtr& s : batch) {
    BATON_CHECK(s->position < static_cast<int64_t>(s->table.size()) * config_.block_size,
                "position %d beyond the reserved blocks of request %s", s->position, s->admit.request_id.c_str());
    b.add(std::span(&s->next_token, 1), s->position, s->table, Logits::kLast);
  }
  // Sampled where the logits are: on a GPU only the ids come back.
  specs_.clear();
  for (const SeqPtr& s : batch) specs_.push_back(s->sampler.spec_at(s->position + 1));  // the token after the input
  model_.forward_sample(b, *cache_, specs_, sampled);
}

// ---- helpers (under mu_) ------------------------------------------------------------------------

void DecodeEngine::finish_locked(const SeqPtr& seq, const Status& status, const std::string& finish_reason) {
  Sequence& s = *seq;
  if (s.state == SeqState::kFinished) return;
  if (s.state == SeqState::kRunning) {
    running_.erase(std::remove(running_.begin(), running_.end(), seq), running_.end());
  } else {
    --n_waiting_;
  }
  s.state = SeqState::kFinished;
  s.finished_at = DecodeClock::now();
  free_blocks_locked(s);
  s.pending.done = true;
  s.pending.status = status;
  s.pending.finish_reason = status.ok() ? finish_reason : "";
  s.has_pending = true;
  work_ = true;  // the engine thread delivers the final event (callers off it notify cv_)
  const int n_new = std::max(0, s.n_generated - 1);
  if (status.ok()) {
    spdlog::info(
        "decode req={} finished: {} after {} tokens ({} new here), kv transfer {:.3f}s, decode queue {:.3f}s, "
        "total {:.3f}s",
        s.admit.request_id, finish_reason, s.n_generated, n_new, s.kv_transfer_seconds, s.decode_queue_seconds,
        seconds_between(s.admitted_at, s.finished_at));
  } else {
    spdlog::info("decode req={} ended: {} after {} tokens", s.admit.request_id, status.to_string(), s.n_generated);
  }
}

void DecodeEngine::free_blocks_locked(Sequence& s) {
  s.covered = {};
  if (s.n_importing > 0) {
    s.free_when_idle = true;  // a kv_chunk is writing into these blocks right now
    return;
  }
  pool_.release(s.table);
}

void DecodeEngine::collect_deliveries_locked(std::vector<Delivery>* out) {
  for (auto it = seqs_.begin(); it != seqs_.end();) {
    Sequence& s = *it->second;
    if (s.sink && s.has_pending) {
      DecodeOutput o = std::move(s.pending);
      s.pending = {};
      s.has_pending = false;
      if (!s.timing_sent) {
        s.timing_sent = true;
        o.decode_queue_seconds = s.decode_queue_seconds;
        o.kv_transfer_seconds = s.kv_transfer_seconds;
      }
      const bool done = o.done;
      out->emplace_back(it->second, std::move(o));
      if (done) {
        it = seqs_.erase(it);
        continue;
      }
    }
    ++it;
  }
}

std::optional<DecodeClock::time_point> DecodeEngine::expire_locked(DecodeClock::time_point now) {
  std::optional<DecodeClock::time_point> next;
  auto consider = [&](DecodeClock::time_point t) {
    if (!next || t < *next) next = t;
  };
  for (auto it = seqs_.begin(); it != seqs_.end();) {
    SeqPtr seq = it->second;
    if (seq->state == SeqState::kFinished) {
      // Undelivered results of a Stream that never came.
      if (!seq->sink && now - seq->finished_at >= kUndeliveredTtl) {
        spdlog::warn("decode req={} finished but no stream attached within {}s: dropped", it->first,
                     std::chrono::duration_cast<std::chrono::seconds>(kUndeliveredTtl).count());
        it = seqs_.erase(it);
        continue;
      }
      if (!seq->sink) consider(seq->finished_at + kUndeliveredTtl);
    } else if (seq->admit.deadline) {
      if (*seq->admit.deadline <= now) {
        finish_locked(
            seq, deadline_exceeded("request " + it->first + " passed its deadline on decode worker " + config_.name),
            "");
      } else {
        consider(*seq->admit.deadline);
      }
    }
    ++it;
  }
  return next;
}

void DecodeEngine::update_gauges_locked() {
  if (g_running_ == nullptr) return;
  g_running_->Set(static_cast<double>(running_.size()));
  g_waiting_->Set(n_waiting_);
  g_blocks_free_->Set(pool_.n_free());
  g_blocks_total_->Set(pool_.n_total());
}

bool DecodeEngine::is_stop(int32_t id) const {
  return std::find(stop_ids_.begin(), stop_ids_.end(), id) != stop_ids_.end();
}

DecodeEngine::SeqPtr DecodeEngine::find_locked(const std::string& id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : it->second;
}

void DecodeEngine::deliver(std::vector<Delivery>& deliveries) {
  for (auto& [seq, out] : deliveries) seq->sink(out);
  deliveries.clear();
}

}  // namespace baton
