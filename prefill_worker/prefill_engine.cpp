#include "prefill_worker/prefill_engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <span>
#include <unordered_set>

#include "common/metrics.h"
#include "common/seconds.h"
#include "common/thread_name.h"
#include "kv/prefix_hash.h"

namespace baton {

struct PrefillEngine::Job {
  PrefillJob spec;
  std::vector<uint64_t> hashes;  // chained hashes of the prompt's full blocks (empty without a prefix cache)
  // Its blocks: they cover the whole prompt from the step that starts it until finish(); the
  // first n_cached / block_size came from the prefix cache and are never written by this job.
  PrefixCacheSeq kv;
  int32_t n_cached = 0;          // leading tokens whose KV the cache had; set when it starts
  int32_t n_done = 0;            // tokens prefilled so far; guarded by mu_ (written by the engine thread)
  int32_t first_token = 0;      // set by the engine thread before it is handed to the outbox
  TokenLogprobs first_logprobs;  // the first token's, when its sampling asks
  Clock::time_point submitted;
  Clock::time_point started;  // start of the step that began its prefill
  std::atomic<bool> cancelled{false};
  // Its KV as the steps write it, for its transfer (kv/kv_sender.h); made when it starts.
  std::shared_ptr<KvOutbox> outbox;

  // The hand-off's bookkeeping, guarded by mu_.
  bool in_engine = true;       // waiting or running: the engine may still write its blocks
  bool has_sender = false;     // handed to the sender (its transfer runs, or will)
  bool sender_done = false;    // its transfer has returned
  std::optional<Status> ended;  // why it ends without a complete hand-off (the first reason wins)
  Status transfer_status;       // the transfer's result, once sender_done
  double transfer_seconds = 0;
  int64_t bytes = 0;

  int32_t n_tokens() const { return static_cast<int32_t>(spec.tokens.size()); }
  // Ends it early unless it has a reason already; its transfer stops.
  void end(const Status& why) {
    if (!ended) ended = why;
    if (outbox) outbox->abandon();
  }
  bool abandoned() const { return cancelled.load() || ended.has_value(); }
};

PrefillEngine::PrefillEngine(Model& model, KvTransport& transport, const PrefillConfig& config, Metrics* metrics)
    : model_(model),
      config_(resolve_prefill_config(config, model.config())),
      metrics_(metrics),
      hash_seed_(prefix_hash_seed(model.fingerprint(), dtype_name(config_.kv_dtype), config_.block_size)),
      blocks_(config_.n_blocks, config_.block_size, config_.prefix_cache_blocks),
      gauges_(metrics, "prefill", config_.name),
      prefix_series_(metrics, config_.name),
      sender_(transport, KvSenderConfig{config_.n_senders, config_.name}, metrics) {
  cache_ = model_.make_kv_cache(config_.n_blocks, config_.block_size, config_.kv_dtype);
  if (metrics_) {
    const auto labels = Metrics::role_labels("prefill", config_.name);
    step_tokens_hist_ = &metrics_->histogram(metrics_->prefill_step_tokens, labels);
    prefill_seconds_hist_ = &metrics_->histogram(metrics_->prefill_seconds, labels);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    update_gauges_locked();
  }
}

PrefillEngine::~PrefillEngine() {
  stop();
}

void PrefillEngine::start() {
  std::lock_guard<std::mutex> lock(mu_);
  BATON_CHECK(!stopping_, "start() after stop()");
  if (engine_running_.exchange(true)) return;
  engine_thread_ = std::thread([this] {
    set_thread_name("prefill-step");
    engine_loop();
  });
}

void PrefillEngine::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  if (engine_thread_.joinable()) engine_thread_.join();
  engine_running_ = false;

  // Jobs the engine will never prefill now. A running job's transfer (if it streams) sees the
  // reason and is abandoned; its sender finishes it.
  std::vector<std::shared_ptr<Job>> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<Job>> unfinished(waiting_.begin(), waiting_.end());
    unfinished.insert(unfinished.end(), running_.begin(), running_.end());
    waiting_.clear();
    running_.clear();
    waiting_tokens_ = 0;
    for (const auto& job : unfinished) {
      job->end(unavailable("the prefill worker is shutting down"));
      if (leave_engine_locked(job)) done.push_back(job);
    }
    update_gauges_locked();
  }
  for (const auto& job : done) finish(job);

  // Transfers already queued finish (their first token is out, the decode worker waits for them).
  sender_.stop();
}

Status PrefillEngine::submit(PrefillJob spec) {
  BATON_RETURN_IF_ERROR(spec.validate_against(model_.config()));
  BATON_RETURN_IF_ERROR(resolve_format(config_.constraints.get(), "prefill worker " + config_.name, &spec.sampling));
  const int need = blocks_.blocks_for(static_cast<int64_t>(spec.tokens.size()));  // block_size is immutable
  if (need > blocks_.n_total()) {
    return invalid_argument("request " + spec.request_id + " needs " + std::to_string(need) +
                            " KV blocks; this prefill worker has " + std::to_string(blocks_.n_total()));
  }

  auto job = std::make_shared<Job>();
  job->spec = std::move(spec);
  if (blocks_.enabled()) {
    job->hashes = prefix_block_hashes(prefix_hash_scoped_seed(hash_seed_, job->spec.sampling.cache_scope),
                                      config_.block_size, job->spec.tokens);
  }
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
    if (job->outbox) job->outbox->abandon();  // its transfer stops
    auto w = std::find(waiting_.begin(), waiting_.end(), job);
    if (w != waiting_.end()) {
      waiting_.erase(w);
      waiting_tokens_ -= job->n_tokens();
      job->end(cancelled("request " + request_id + " was cancelled while queued for prefill"));
      if (leave_engine_locked(job)) dropped = job;
      update_gauges_locked();
    }
    // Running: dropped at the next step boundary.
  }
  if (dropped) {
    finish(dropped);
  } else {
    work_cv_.notify_one();
  }
}

PrefillLoad PrefillEngine::load() const {
  std::lock_guard<std::mutex> lock(mu_);
  PrefillLoad l;
  for (const auto& job : waiting_) {
    const int reused = blocks_.match(job->hashes, job->spec.tokens, max_reused_blocks(*job));
    l.queued_prompt_tokens += job->n_tokens() - int64_t{reused} * config_.block_size;
  }
  for (const auto& job : running_) l.queued_prompt_tokens += job->n_tokens() - job->n_done;
  l.n_queued = static_cast<int>(waiting_.size());
  l.n_running = static_cast<int>(running_.size());
  l.n_sending = n_sending_locked();
  l.free_blocks = blocks_.n_free();
  l.total_blocks = blocks_.n_total();
  l.step_seconds = step_stats_.slowest_step_seconds(Clock::now());
  l.prefill_tokens_per_second = step_stats_.prompt_tokens_per_second();
  l.token_budget = config_.token_budget;
  const StepStats::Fit fit = step_stats_.step_time_fit();
  l.step_fixed_seconds = fit.fixed_seconds;
  l.step_seconds_per_token = fit.seconds_per_token;
  l.step_tokens_in_progress = step_tokens_;
  if (step_tokens_ > 0) l.step_elapsed_seconds = seconds_between(step_started_, Clock::now());
  l.prefix_cache_blocks = blocks_.max_cached();
  l.n_cached_blocks = blocks_.n_cached();
  l.prefix_hash_seed = hash_seed_;
  l.cached_block_hashes = blocks_.cached_hashes(static_cast<size_t>(config_.prefix_report_blocks));
  return l;
}

// ---- the step loop -----------------------------------------------------------------------------

bool PrefillEngine::stalled(std::chrono::steady_clock::time_point now, std::chrono::nanoseconds limit) const {
  std::lock_guard<std::mutex> lock(mu_);
  return !in_wait_ && has_work_locked() && now - beat_ > limit;
}

bool PrefillEngine::has_work_locked() const {
  if (!running_.empty()) return true;  // unfinished prompts, or cancelled ones to drop
  if (waiting_.empty()) return false;
  const Job& head = *waiting_.front();
  return blocks_.can_allocate(head.hashes, head.spec.tokens, max_reused_blocks(head),
                              blocks_.blocks_for(head.n_tokens()));
}

int PrefillEngine::max_reused_blocks(const Job& job) const {
  return (job.n_tokens() - 1) / config_.block_size;
}

void PrefillEngine::engine_loop() {
  if (Status s = model_.backend().bind_thread(); !s.ok()) {
    spdlog::warn("prefill worker {}: {}; the step loop runs unpinned", config_.name, s.to_string());
  }
  for (;;) {
    std::unique_lock<std::mutex> lock(mu_);
    in_wait_ = true;  // waiting for work is not a stall, however long
    work_cv_.wait(lock, [this] { return stopping_ || has_work_locked(); });
    in_wait_ = false;
    beat_ = Clock::now();
    if (stopping_) return;
    step(std::move(lock));
  }
}

bool PrefillEngine::run_step_for_test() {
  BATON_CHECK(!engine_running_, "run_step_for_test() while the engine thread runs");
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_ || !has_work_locked()) return false;
  step(std::move(lock));
  return true;
}

void PrefillEngine::step(std::unique_lock<std::mutex> lock) {
  std::vector<std::shared_ptr<Job>> dropped;
  std::vector<Slice> slices = plan_step_locked(&dropped);
  lock.unlock();
  for (const auto& job : dropped) finish(job);
  run_step(std::move(slices));
}

std::vector<PrefillEngine::Slice> PrefillEngine::plan_step_locked(std::vector<std::shared_ptr<Job>>* dropped) {
  // Cancelled prompts, and prompts whose transfer failed, leave first. Those without a transfer
  // still reading their blocks are finished by the caller (their blocks may then let a waiting
  // job start in the next step).
  std::vector<std::shared_ptr<Job>> leaving;
  for (const auto& job : running_) {
    if (job->abandoned()) leaving.push_back(job);
  }
  running_.erase(std::remove_if(running_.begin(), running_.end(), [](const auto& job) { return job->abandoned(); }),
                 running_.end());
  for (const auto& job : leaving) {
    job->end(cancelled("request " + job->spec.request_id + " was cancelled during prefill"));
    if (leave_engine_locked(job)) dropped->push_back(job);
  }

  std::vector<Slice> slices;
  int budget = config_.token_budget;
  // Hashes of the full blocks this step's slices complete: they are cached once it has run.
  std::unordered_set<uint64_t> completing;
  const auto add_slice = [&](const std::shared_ptr<Job>& job, int32_t start, int32_t n) {
    slices.push_back({job, start, n});
    budget -= n;
    const int bs = config_.block_size;
    for (size_t i = static_cast<size_t>(start / bs); i < job->hashes.size() && int64_t(i + 1) * bs <= start + n; ++i) {
      if (int64_t(i + 1) * bs > start) completing.insert(job->hashes[i]);
    }
  };
  // The prompt left mid-way by the previous step continues first.
  for (const auto& job : running_) {
    if (budget == 0) break;
    add_slice(job, job->n_done, std::min(job->n_tokens() - job->n_done, budget));
  }
  const Clock::time_point now = Clock::now();
  while (budget > 0 && !waiting_.empty()) {
    std::shared_ptr<Job> job = waiting_.front();
    // Prompts that arrive together with one prefix compute it once: a prompt whose next uncached
    // block this step completes for another waits for the next step, which reuses it (FIFO: the
    // jobs behind it wait too). The step is not idle meanwhile: it computes that prefix.
    if (!job->hashes.empty()) {
      const int cached = blocks_.match(job->hashes, job->spec.tokens, max_reused_blocks(*job));
      if (cached < max_reused_blocks(*job) && completing.count(job->hashes[cached]) != 0) break;
    }
    const int reused = blocks_.allocate(job->hashes, job->spec.tokens, max_reused_blocks(*job),
                                        blocks_.blocks_for(job->n_tokens()), &job->kv);
    if (reused < 0) break;  // FIFO: nobody overtakes the head
    waiting_.pop_front();
    waiting_tokens_ -= job->n_tokens();
    job->started = now;
    // The cached part is in the cache already: ready for the transfer from the start.
    job->n_cached = reused * config_.block_size;
    job->n_done = job->n_cached;
    job->outbox = make_outbox(job);
    if (blocks_.enabled()) prefix_series_.looked_up(job->n_tokens(), job->n_cached);
    running_.push_back(job);
    if (config_.stream_kv) hand_to_sender_locked(job);  // its chunks go as the steps write them
    add_slice(job, job->n_cached, std::min(job->n_tokens() - job->n_cached, budget));
  }
  step_tokens_ = config_.token_budget - budget;
  step_started_ = now;
  update_gauges_locked();
  return slices;
}

void PrefillEngine::run_step(std::vector<Slice> slices) {
  if (slices.empty()) return;
  // Jobs' token vectors and block tables do not change while they run: the batch can point at them.
  batch_.clear();
  for (const Slice& s : slices) s.job->outbox->step_begins(s.start + s.n);
  for (const Slice& s : slices) {
    const bool last = s.start + s.n == s.job->n_tokens();
    batch_.add(std::span<const int32_t>(s.job->spec.tokens).subspan(s.start, s.n), s.start, s.job->kv.table,
               last ? Logits::kLast : Logits::kNone);
  }
  // First tokens, sampled at each finished prompt's last position (logits rows in slice order),
  // where the logits are: on a GPU only the ids come back.
  std::vector<std::shared_ptr<Job>> finished;
  std::vector<SampleSpec> specs;
  std::vector<LogitAdjust> adjust;
  for (const Slice& s : slices) {
    if (s.start + s.n != s.job->n_tokens()) continue;
    // Drawn for the token after prompt + earlier output: that position's draw (model/sampler.h),
    // penalised by what the request generated before a failover.
    const PrefillJob& job = s.job->spec;
    Sampler sampler(job.sampling);
    const std::span<const int32_t> tokens(job.tokens);
    sampler.set_history(tokens.first(tokens.size() - job.n_generated), tokens.last(job.n_generated));
    sampler.adjustments(static_cast<int32_t>(specs.size()), &adjust);
    specs.push_back(sampler.spec_at(s.job->n_tokens()));
    finished.push_back(s.job);
  }
  // Streaming: each layer's K and V of the step may leave as soon as the forward wrote them.
  Model::LayerDone layer_done;
  if (config_.stream_kv) {
    layer_done = [&](int layer) {
      for (const Slice& s : slices) s.job->outbox->layer_written(layer + 1);
    };
  }
  std::vector<int32_t> first_tokens;
  std::vector<TokenLogprobs> first_logprobs;
  const Clock::time_point step_start = Clock::now();
  model_.forward_sample(batch_, *cache_, specs, adjust, &first_tokens, &first_logprobs, layer_done);
  const Clock::time_point done = Clock::now();
  n_steps_++;
  if (metrics_) step_tokens_hist_->Observe(static_cast<double>(batch_.n_tokens()));
  for (size_t i = 0; i < finished.size(); ++i) {
    finished[i]->first_token = first_tokens[i];
    if (!first_logprobs.empty()) finished[i]->first_logprobs = first_logprobs[i];
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    step_stats_.add_step(done, seconds_between(step_start, done), batch_.n_tokens());
    step_tokens_ = 0;
    for (const Slice& s : slices) {
      s.job->n_done += s.n;
      // Its blocks the forward completed are shareable from the next step on.
      blocks_.insert(&s.job->kv, s.job->hashes, s.job->spec.tokens, s.job->n_done / config_.block_size);
    }
    update_gauges_locked();
  }
  for (const Slice& s : slices) s.job->outbox->step_done();

  // Progress, for the frontend's watchdog: the prompts that go on in the next step, and those still
  // waiting for one (they hear that the worker moves, if not yet for them).
  std::vector<std::pair<std::shared_ptr<Job>, int32_t>> moving;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Slice& s : slices) {
      if (s.start + s.n < s.job->n_tokens()) moving.emplace_back(s.job, s.start + s.n);
    }
    for (const auto& job : waiting_) moving.emplace_back(job, 0);
  }
  for (const auto& [job, n_done] : moving) {
    if (!job->cancelled && job->spec.on_progress) job->spec.on_progress(n_done);
  }
  // TTFT does not wait for the KV: the first token goes out before the rest of the hand-off, and
  // before on_done. A prompt whose logits are not finite gets no first token: it ends INTERNAL,
  // and its transfer is abandoned.
  for (const auto& job : finished) {
    if (job->first_token == kNonFiniteLogits) {
      spdlog::error("req={}: the logits at position {} are not finite (NaN or infinity); ending it",
                    job->spec.request_id, job->n_tokens());
      std::lock_guard<std::mutex> lock(mu_);
      job->end(internal_error("prefill worker " + config_.name + ": the logits at position " +
                              std::to_string(job->n_tokens()) + " are not finite (NaN or infinity); no token was produced"));
      continue;
    }
    const double queue_s = seconds_between(job->submitted, job->started);
    const double prefill_s = seconds_between(job->started, done);
    if (metrics_) prefill_seconds_hist_->Observe(prefill_s);
    spdlog::debug("req={} prefilled {} tokens ({} from the prefix cache): queue {:.3f}s, prefill {:.3f}s, first token {}",
                  job->spec.request_id, job->n_tokens(), job->n_cached, queue_s, prefill_s, job->first_token);
    if (!job->cancelled && job->spec.on_first_token) {
      job->spec.on_first_token(job->first_token, queue_s, prefill_s, job->n_cached,
                               job->spec.sampling.top_logprobs >= 0 ? &job->first_logprobs : nullptr);
    }
  }
  // Only now may a transfer end (its end carries the first token): on_first_token has returned.
  std::vector<std::shared_ptr<Job>> done_jobs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& job : finished) {
      running_.erase(std::find(running_.begin(), running_.end(), job));
      if (!job->ended) {
        job->outbox->prefilled(job->first_token, done);
        if (!job->abandoned() && !job->has_sender) hand_to_sender_locked(job);
      }
      if (leave_engine_locked(job)) done_jobs.push_back(job);
    }
    update_gauges_locked();
  }
  for (const auto& job : done_jobs) finish(job);
}

// ---- KV hand-off -------------------------------------------------------------------------------

std::shared_ptr<KvOutbox> PrefillEngine::make_outbox(const std::shared_ptr<Job>& job) {
  const ModelConfig& mc = model_.config();
  KvTransferHeader header;
  header.request_id = job->spec.request_id;
  header.model_fingerprint = job->spec.model_fingerprint;
  header.dtype = dtype_name(config_.kv_dtype);
  header.n_layers = mc.n_layers;
  header.n_kv_heads = mc.n_kv_heads;
  header.head_dim = mc.head_dim;
  header.n_tokens = job->n_tokens();
  header.token_ids = job->spec.tokens;
  // The job outlives its transfer (finish() waits for it), and its block table is fixed while it runs.
  const Job* j = job.get();
  return std::make_shared<KvOutbox>(std::move(header), job->n_cached, config_.kv_chunk_bytes,
                                    [this, j](int32_t layer, int32_t start, int32_t n, char* k, char* v) {
                                      model_.backend().kv_export(*cache_, layer, j->kv.table.data(), start, n, k, v);
                                    });
}

void PrefillEngine::hand_to_sender_locked(const std::shared_ptr<Job>& job) {
  job->has_sender = true;
  sender_.send(job->outbox, job->spec.decode_address, [this, job](const Status& status, double seconds, int64_t bytes) {
    transfer_done(job, status, seconds, bytes);
  });
}

bool PrefillEngine::leave_engine_locked(const std::shared_ptr<Job>& job) {
  job->in_engine = false;
  return !job->has_sender || job->sender_done;
}

void PrefillEngine::transfer_done(const std::shared_ptr<Job>& job, const Status& status, double seconds,
                                  int64_t bytes) {
  bool done = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A failed transfer ends the job (a running prompt stops at the next step boundary).
    if (!status.ok()) {
      job->end(job->cancelled ? cancelled("request " + job->spec.request_id + " was cancelled during its KV transfer")
                              : status);
    }
    job->sender_done = true;
    job->transfer_status = status;
    job->transfer_seconds = seconds;
    job->bytes = bytes;
    done = !job->in_engine;
  }
  if (done) {
    finish(job);
  } else {
    work_cv_.notify_one();  // the engine drops the prompt at its next step boundary
  }
}

void PrefillEngine::finish(const std::shared_ptr<Job>& job) {
  Status status;
  double seconds = 0;
  int64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!job->kv.table.empty()) blocks_.release(&job->kv);
    auto it = jobs_.find(job->spec.request_id);
    if (it != jobs_.end() && it->second == job) jobs_.erase(it);
    // A job that ended early says why; otherwise its transfer's result.
    if (job->ended) {
      status = *job->ended;
    } else if (job->cancelled) {
      status = cancelled("request " + job->spec.request_id + " was cancelled");
    } else {
      status = job->transfer_status;
      seconds = job->transfer_seconds;
      bytes = job->bytes;
    }
    update_gauges_locked();
  }
  work_cv_.notify_one();  // freed blocks may let the head of the queue start
  if (job->spec.on_done) job->spec.on_done(status, seconds, bytes);
}

int PrefillEngine::n_sending_locked() const {
  int n = 0;
  for (const auto& [id, job] : jobs_) n += !job->in_engine && job->has_sender && !job->sender_done;
  return n;
}

void PrefillEngine::update_gauges_locked() {
  gauges_.set(static_cast<double>(waiting_.size()), static_cast<double>(running_.size() + n_sending_locked()),
              blocks_.n_free(), blocks_.n_total());
  prefix_series_.update(blocks_.n_cached(), blocks_.n_inserted(), blocks_.n_evicted());
}

}  // namespace baton
