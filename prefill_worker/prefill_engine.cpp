#include "prefill_worker/prefill_engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <span>

#include "common/metrics.h"

namespace baton {

struct PrefillEngine::Job {
  PrefillJob spec;
  std::vector<int32_t> blocks;  // cover the whole prompt from the step that starts it; guarded by mu_
  int32_t n_done = 0;           // tokens prefilled so far; guarded by mu_ (written by the engine thread)
  int32_t first_token = 0;
  Clock::time_point submitted;
  Clock::time_point started;  // start of the step that began its prefill
  std::atomic<bool> cancelled{false};

  int32_t n_tokens() const { return static_cast<int32_t>(spec.tokens.size()); }
};

namespace {

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Checks the config (an invalid one is a bug in the caller, which validates flags first) and
// resolves n_blocks = 0 against the model: room for a few steps' prompts, and at least one prompt
// of the model's full context.
PrefillConfig resolve_config(PrefillConfig c, const ModelConfig& model) {
  const Status s = validate_prefill_config(c);
  BATON_CHECK(s.ok(), "invalid PrefillConfig: %s", s.to_string().c_str());
  if (c.n_blocks == 0) {
    const int64_t tokens = std::max<int64_t>(int64_t{4} * c.token_budget, model.n_ctx);
    c.n_blocks = static_cast<int>((tokens + c.block_size - 1) / c.block_size);
  }
  return c;
}

}  // namespace

Status validate_prefill_config(const PrefillConfig& c) {
  if (c.token_budget < 1)
    return invalid_argument("prefill token budget must be >= 1, got " + std::to_string(c.token_budget));
  if (c.n_blocks < 0)
    return invalid_argument("prefill n_blocks must be >= 0 (0: sized from the model), got " +
                            std::to_string(c.n_blocks));
  if (c.block_size < 1) return invalid_argument("prefill block_size must be >= 1, got " + std::to_string(c.block_size));
  if (c.max_queued_tokens < 1) {
    return invalid_argument("prefill max_queued_tokens must be >= 1, got " + std::to_string(c.max_queued_tokens));
  }
  if (c.n_senders < 1) return invalid_argument("prefill n_senders must be >= 1, got " + std::to_string(c.n_senders));
  if (c.kv_chunk_bytes < 1 || c.kv_chunk_bytes > kMaxKvChunkBytes) {
    return invalid_argument("prefill kv_chunk_bytes must be in [1, " + std::to_string(kMaxKvChunkBytes) + "], got " +
                            std::to_string(c.kv_chunk_bytes));
  }
  return {};
}

PrefillEngine::PrefillEngine(Model& model, KvTransport& transport, const PrefillConfig& config, Metrics* metrics)
    : model_(model),
      transport_(transport),
      config_(resolve_config(config, model.config())),
      metrics_(metrics),
      n_vocab_(model.config().n_vocab),
      n_ctx_(model.config().n_ctx),
      pool_(config_.n_blocks, config_.block_size) {
  cache_ = model_.make_kv_cache(config_.n_blocks, config_.block_size, config_.kv_dtype);
  if (metrics_) {
    const auto labels = Metrics::role_labels("prefill", config_.name);
    metrics_->kv_blocks_total.Add(labels).Set(pool_.n_total());
    step_tokens_hist_ = &metrics_->histogram(metrics_->prefill_step_tokens, labels);
    prefill_seconds_hist_ = &metrics_->histogram(metrics_->prefill_seconds, labels);
    queue_depth_gauge_ = &metrics_->queue_depth.Add(labels);
    running_gauge_ = &metrics_->running_sequences.Add(labels);
    blocks_free_gauge_ = &metrics_->kv_blocks_free.Add(labels);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    update_gauges_locked();
  }
  for (int i = 0; i < config_.n_senders; ++i) sender_threads_.emplace_back([this] { sender_loop(); });
}

PrefillEngine::~PrefillEngine() {
  stop();
}

void PrefillEngine::start() {
  std::lock_guard<std::mutex> lock(mu_);
  BATON_CHECK(!stopping_, "start() after stop()");
  if (engine_running_.exchange(true)) return;
  engine_thread_ = std::thread([this] { engine_loop(); });
}

void PrefillEngine::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  if (engine_thread_.joinable()) engine_thread_.join();
  engine_running_ = false;

  // Jobs the engine will never prefill now.
  std::vector<std::shared_ptr<Job>> unfinished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    unfinished.assign(waiting_.begin(), waiting_.end());
    unfinished.insert(unfinished.end(), running_.begin(), running_.end());
    waiting_.clear();
    running_.clear();
    waiting_tokens_ = 0;
  }
  for (const auto& job : unfinished) finish(job, unavailable("the prefill worker is shutting down"), 0, 0, false);

  // Transfers already queued finish (their first token is out, the decode worker waits for them).
  {
    std::lock_guard<std::mutex> lock(mu_);
    senders_stop_ = true;
  }
  send_cv_.notify_all();
  for (std::thread& t : sender_threads_) {
    if (t.joinable()) t.join();
  }
}

Status PrefillEngine::submit(PrefillJob spec) {
  if (spec.request_id.empty()) return invalid_argument("the request id is empty");
  if (spec.tokens.empty()) return invalid_argument("request " + spec.request_id + " has no prompt tokens");
  for (size_t i = 0; i < spec.tokens.size(); ++i) {
    if (spec.tokens[i] < 0 || spec.tokens[i] >= n_vocab_) {
      return invalid_argument("request " + spec.request_id + ": token " + std::to_string(i) + " has id " +
                              std::to_string(spec.tokens[i]) + ", outside the vocabulary [0, " +
                              std::to_string(n_vocab_) + ")");
    }
  }
  if (spec.n_generated < 0 || spec.n_generated >= static_cast<int64_t>(spec.tokens.size())) {
    return invalid_argument("request " + spec.request_id + ": n_generated " + std::to_string(spec.n_generated) +
                            " must be in [0, " + std::to_string(spec.tokens.size()) + ")");
  }
  // The first token goes at position tokens.size(): it must be inside the context.
  if (static_cast<int64_t>(spec.tokens.size()) >= n_ctx_) {
    return invalid_argument("request " + spec.request_id + " has " + std::to_string(spec.tokens.size()) +
                            " tokens; the model's context of " + std::to_string(n_ctx_) +
                            " leaves no room for a new one");
  }
  BATON_RETURN_IF_ERROR(validate_sampling(spec.sampling));
  if (spec.decode_address.empty()) return invalid_argument("request " + spec.request_id + " has no decode address");
  const int need = pool_.blocks_for(static_cast<int64_t>(spec.tokens.size()));  // block_size is immutable
  if (need > pool_.n_total()) {
    return invalid_argument("request " + spec.request_id + " needs " + std::to_string(need) +
                            " KV blocks; this prefill worker has " + std::to_string(pool_.n_total()));
  }

  auto job = std::make_shared<Job>();
  job->spec = std::move(spec);
  job->submitted = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return unavailable("the prefill worker is shutting down");
    if (jobs_.count(job->spec.request_id)) {
      return failed_precondition("request " + job->spec.request_id + " is already in progress on this prefill worker");
    }
    if (!waiting_.empty() && waiting_tokens_ + job->n_tokens() > config_.max_queued_tokens) {
      return resource_exhausted("the prefill queue is full (" + std::to_string(waiting_tokens_) +
                                " prompt tokens waiting, bound " + std::to_string(config_.max_queued_tokens) + ")");
    }
    jobs_.emplace(job->spec.request_id, job);
    waiting_.push_back(job);
    waiting_tokens_ += job->n_tokens();
    update_gauges_locked();
  }
  work_cv_.notify_one();
  spdlog::debug("req={} queued for prefill: {} tokens, KV to {}", job->spec.request_id, job->n_tokens(),
                job->spec.decode_address);
  return {};
}

void PrefillEngine::cancel(const std::string& request_id) {
  std::shared_ptr<Job> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(request_id);
    if (it == jobs_.end()) return;
    std::shared_ptr<Job> job = it->second;
    job->cancelled = true;
    auto w = std::find(waiting_.begin(), waiting_.end(), job);
    if (w != waiting_.end()) {
      waiting_.erase(w);
      waiting_tokens_ -= job->n_tokens();
      dropped = job;
    }
    // Running: dropped at the next step boundary. Sending: its chunk source sees the flag.
  }
  if (dropped) {
    finish(dropped, cancelled("request " + request_id + " was cancelled while queued for prefill"), 0, 0, false);
  } else {
    work_cv_.notify_one();
  }
}

PrefillLoad PrefillEngine::load() const {
  std::lock_guard<std::mutex> lock(mu_);
  PrefillLoad l;
  l.queued_prompt_tokens = waiting_tokens_;
  for (const auto& job : running_) l.queued_prompt_tokens += job->n_tokens() - job->n_done;
  l.n_queued = static_cast<int>(waiting_.size());
  l.n_running = static_cast<int>(running_.size());
  l.n_sending = n_sending_;
  l.free_blocks = pool_.n_free();
  l.total_blocks = pool_.n_total();
  return l;
}

// ---- the step loop -----------------------------------------------------------------------------

bool PrefillEngine::stalled(std::chrono::steady_clock::time_point now, std::chrono::nanoseconds limit) const {
  std::lock_guard<std::mutex> lock(mu_);
  return !in_wait_ && has_work_locked() && now - beat_ > limit;
}

bool PrefillEngine::has_work_locked() const {
  if (!running_.empty()) return true;  // unfinished prompts, or cancelled ones to drop
  return !waiting_.empty() && pool_.can_allocate(pool_.blocks_for(waiting_.front()->n_tokens()));
}

void PrefillEngine::engine_loop() {
  if (Status s = model_.backend().bind_thread(); !s.ok()) {
    spdlog::warn("prefill worker {}: {}; the step loop runs unpinned", config_.name, s.to_string());
  }
  for (;;) {
    std::vector<std::shared_ptr<Job>> dropped;
    std::vector<Slice> slices;
    {
      std::unique_lock<std::mutex> lock(mu_);
      in_wait_ = true;  // waiting for work is not a stall, however long
      work_cv_.wait(lock, [this] { return stopping_ || has_work_locked(); });
      in_wait_ = false;
      beat_ = Clock::now();
      if (stopping_) return;
      slices = plan_step_locked(&dropped);
    }
    for (const auto& job : dropped) {
      finish(job, cancelled("request " + job->spec.request_id + " was cancelled during prefill"), 0, 0, false);
    }
    run_step(std::move(slices));
  }
}

bool PrefillEngine::run_step_for_test() {
  BATON_CHECK(!engine_running_, "run_step_for_test() while the engine thread runs");
  std::vector<std::shared_ptr<Job>> dropped;
  std::vector<Slice> slices;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || !has_work_locked()) return false;
    slices = plan_step_locked(&dropped);
  }
  for (const auto& job : dropped) {
    finish(job, cancelled("request " + job->spec.request_id + " was cancelled during prefill"), 0, 0, false);
  }
  run_step(std::move(slices));
  return true;
}

std::vector<PrefillEngine::Slice> PrefillEngine::plan_step_locked(std::vector<std::shared_ptr<Job>>* dropped) {
  // Cancelled prompts leave first: their blocks may let a waiting job start in this very step.
  auto is_cancelled = [](const std::shared_ptr<Job>& job) { return job->cancelled.load(); };
  for (const auto& job : running_) {
    if (is_cancelled(job)) dropped->push_back(job);
  }
  running_.erase(std::remove_if(running_.begin(), running_.end(), is_cancelled), running_.end());
  for (auto& job : *dropped) pool_.release(job->blocks);

  std::vector<Slice> slices;
  int budget = config_.token_budget;
  // The prompt left mid-way by the previous step continues first.
  for (const auto& job : running_) {
    if (budget == 0) break;
    const int32_t n = std::min(job->n_tokens() - job->n_done, budget);
    slices.push_back({job, job->n_done, n});
    budget -= n;
  }
  const Clock::time_point now = Clock::now();
  while (budget > 0 && !waiting_.empty()) {
    std::shared_ptr<Job> job = waiting_.front();
    if (!pool_.grow_to(job->blocks, job->n_tokens())) break;  // FIFO: nobody overtakes the head
    waiting_.pop_front();
    waiting_tokens_ -= job->n_tokens();
    job->started = now;
    running_.push_back(job);
    const int32_t n = std::min(job->n_tokens(), budget);
    slices.push_back({job, 0, n});
    budget -= n;
  }
  update_gauges_locked();
  return slices;
}

void PrefillEngine::run_step(std::vector<Slice> slices) {
  if (slices.empty()) return;
  // Jobs' token vectors and block tables do not change while they run: the batch can point at them.
  batch_.clear();
  for (const Slice& s : slices) {
    const bool last = s.start + s.n == s.job->n_tokens();
    batch_.add(std::span<const int32_t>(s.job->spec.tokens).subspan(s.start, s.n), s.start, s.job->blocks,
               last ? Logits::kLast : Logits::kNone);
  }
  // First tokens, sampled at each finished prompt's last position (logits rows in slice order),
  // where the logits are: on a GPU only the ids come back.
  std::vector<std::shared_ptr<Job>> finished;
  std::vector<SampleSpec> specs;
  for (const Slice& s : slices) {
    if (s.start + s.n != s.job->n_tokens()) continue;
    // Drawn for the token after prompt + earlier output: that position's draw (model/sampler.h).
    specs.push_back(Sampler(s.job->spec.sampling).spec_at(s.job->n_tokens()));
    finished.push_back(s.job);
  }
  std::vector<int32_t> first_tokens;
  model_.forward_sample(batch_, *cache_, specs, &first_tokens);
  const Clock::time_point done = Clock::now();
  n_steps_++;
  if (metrics_) step_tokens_hist_->Observe(static_cast<double>(batch_.n_tokens()));
  for (size_t i = 0; i < finished.size(); ++i) finished[i]->first_token = first_tokens[i];
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Slice& s : slices) s.job->n_done += s.n;
    for (const auto& job : finished) running_.erase(std::find(running_.begin(), running_.end(), job));
    n_sending_ += static_cast<int>(finished.size());
    update_gauges_locked();
  }

  // TTFT does not wait for the KV: the first token goes out before the job reaches a sender (and
  // before on_done, which only a sender calls from here on).
  // A prompt whose logits are not finite gets no first token: it ends INTERNAL, and its KV is
  // not sent.
  std::vector<std::shared_ptr<Job>> broken;
  for (auto it = finished.begin(); it != finished.end();) {
    if ((*it)->first_token != kNonFiniteLogits) {
      ++it;
      continue;
    }
    spdlog::error("req={}: the logits at position {} are not finite (NaN or infinity); ending it", (*it)->spec.request_id,
                  (*it)->n_tokens());
    broken.push_back(*it);
    it = finished.erase(it);
  }
  for (const auto& job : broken) {
    finish(job,
           internal_error("prefill worker " + config_.name + ": the logits at position " + std::to_string(job->n_tokens()) +
                          " are not finite (NaN or infinity); no token was produced"),
           0, 0, /*was_sending=*/true);
  }
  for (const auto& job : finished) {
    const double queue_s = seconds_between(job->submitted, job->started);
    const double prefill_s = seconds_between(job->started, done);
    if (metrics_) prefill_seconds_hist_->Observe(prefill_s);
    spdlog::debug("req={} prefilled {} tokens: queue {:.3f}s, prefill {:.3f}s, first token {}", job->spec.request_id,
                  job->n_tokens(), queue_s, prefill_s, job->first_token);
    if (!job->cancelled && job->spec.on_first_token) job->spec.on_first_token(job->first_token, queue_s, prefill_s);
  }
  if (!finished.empty()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      to_send_.insert(to_send_.end(), finished.begin(), finished.end());
    }
    send_cv_.notify_all();
  }
}

// ---- KV hand-off -------------------------------------------------------------------------------

void PrefillEngine::sender_loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      send_cv_.wait(lock, [this] { return senders_stop_ || !to_send_.empty(); });
      if (to_send_.empty()) return;  // stopping, and every queued transfer is done
      job = to_send_.front();
      to_send_.pop_front();
    }
    send_kv(job);
  }
}

void PrefillEngine::send_kv(const std::shared_ptr<Job>& job) {
  const Clock::time_point t0 = Clock::now();
  const std::string& id = job->spec.request_id;
  if (job->cancelled) {
    finish(job, cancelled("request " + id + " was cancelled before its KV transfer"), 0, 0, true);
    return;
  }
  const ModelConfig& mc = model_.config();
  KvTransferHeader header;
  header.request_id = id;
  header.model_fingerprint = job->spec.model_fingerprint;
  header.dtype = dtype_name(config_.kv_dtype);
  header.n_layers = mc.n_layers;
  header.n_kv_heads = mc.n_kv_heads;
  header.head_dim = mc.head_dim;
  header.n_tokens = job->n_tokens();
  header.first_token = job->first_token;
  header.token_ids = job->spec.tokens;

  // Chunks are exported lazily, one at a time, as the transport asks for them: at most one
  // chunk of this job's KV is in host memory here.
  //
  // Concurrency: this runs on a sender thread while the engine thread runs later steps. It only
  // reads this job's blocks, which no step writes any more (the prompt is complete) and which
  // are not freed before the transfer ends, so on CPU (plain memory) the copies cannot race. The
  // CUDA backend copies on its own stream under its own lock; the forward that wrote these blocks
  // finished before its first tokens came back.
  const int64_t row_bytes = kv_chunk_bytes(header, 1);
  const int32_t tokens_per_chunk =
      static_cast<int32_t>(std::clamp<int64_t>(config_.kv_chunk_bytes / (2 * row_bytes), 1, header.n_tokens));
  int32_t layer = 0;
  int32_t start = 0;
  Backend& backend = model_.backend();
  auto next = [&](KvChunk* c) -> bool {
    // A cancelled job ends its transfer early: the receiver refuses the incomplete KV.
    if (layer == header.n_layers || job->cancelled) return false;
    const int32_t n = std::min(tokens_per_chunk, header.n_tokens - start);
    c->layer = layer;
    c->token_start = start;
    c->token_count = n;
    c->k.resize(static_cast<size_t>(n * row_bytes));
    c->v.resize(static_cast<size_t>(n * row_bytes));
    backend.kv_export(*cache_, layer, job->blocks.data(), start, n, c->k.data(), c->v.data());
    c->checksum = kv_checksum(c->k, c->v);
    start += n;
    if (start == header.n_tokens) {
      start = 0;
      ++layer;
    }
    return true;
  };
  int64_t bytes = 0;
  Status status = transport_.send(job->spec.decode_address, header, next, &bytes);
  const double seconds = seconds_between(t0, Clock::now());
  if (!status.ok() && job->cancelled) {
    status = cancelled("request " + id + " was cancelled during its KV transfer");
  }
  if (metrics_) {
    // Per link: this prefill worker, the decode worker, the transport.
    prometheus::Labels labels = Metrics::role_labels("prefill", config_.name);
    labels["src"] = config_.name;
    labels["dst"] = job->spec.decode_address;
    labels["transport"] = transport_.name();
    if (status.ok()) {
      metrics_->histogram(metrics_->kv_transfer_seconds, labels).Observe(seconds);
      metrics_->kv_transfer_bytes_total.Add(labels).Increment(static_cast<double>(bytes));
    } else if (status.code() != StatusCode::kCancelled) {
      metrics_->kv_transfer_errors_total.Add(labels).Increment();
    }
  }
  if (status.ok()) {
    spdlog::debug("req={} KV sent to {}: {} bytes in {:.3f}s", id, job->spec.decode_address, bytes, seconds);
  } else if (status.code() != StatusCode::kCancelled) {
    spdlog::warn("req={} KV transfer failed: {}", id, status.to_string());
  }
  finish(job, status, seconds, bytes, true);
}

void PrefillEngine::finish(const std::shared_ptr<Job>& job, const Status& status, double transfer_seconds,
                           int64_t bytes, bool was_sending) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!job->blocks.empty()) pool_.release(job->blocks);
    auto it = jobs_.find(job->spec.request_id);
    if (it != jobs_.end() && it->second == job) jobs_.erase(it);
    if (was_sending) --n_sending_;
    update_gauges_locked();
  }
  work_cv_.notify_one();  // freed blocks may let the head of the queue start
  if (job->spec.on_done) job->spec.on_done(status, transfer_seconds, bytes);
}

void PrefillEngine::update_gauges_locked() {
  if (!metrics_) return;
  queue_depth_gauge_->Set(static_cast<double>(waiting_.size()));
  running_gauge_->Set(static_cast<double>(running_.size() + n_sending_));
  blocks_free_gauge_->Set(pool_.n_free());
}

}  // namespace baton
