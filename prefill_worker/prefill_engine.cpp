#include "prefill_worker/prefill_engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <span>
#include <unordered_set>

#include "common/metrics.h"
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
  int32_t first_token = 0;      // set by the engine thread before `prefilled`
  Clock::time_point submitted;
  Clock::time_point started;  // start of the step that began its prefill
  std::atomic<bool> cancelled{false};

  // The hand-off, guarded by mu_. Tokens [0, kv_done) have every layer in the cache; the step in
  // flight covers [kv_done, kv_step_end) and has written layers [0, kv_layers) of it.
  int32_t kv_done = 0;
  int32_t kv_step_end = 0;
  int32_t kv_layers = 0;
  bool prefilled = false;      // the prompt is complete and first_token set
  Clock::time_point prefilled_at;
  bool in_engine = true;       // waiting or running: the engine may still write its blocks
  bool has_sender = false;     // handed to the senders (its transfer runs, or will)
  bool sender_done = false;    // its transfer has returned
  std::optional<Status> ended;  // why it ends without a complete hand-off (the first reason wins)
  Status transfer_status;       // the transfer's result, once sender_done
  double transfer_seconds = 0;
  int64_t bytes = 0;

  int32_t n_tokens() const { return static_cast<int32_t>(spec.tokens.size()); }
  // Ends it early unless it has a reason already.
  void end(const Status& why) {
    if (!ended) ended = why;
  }
  bool abandoned() const { return cancelled.load() || ended.has_value(); }
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
  if (c.prefix_cache_blocks < 0 || c.prefix_cache_blocks > c.n_blocks) c.prefix_cache_blocks = c.n_blocks;
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
  if (c.prefix_cache_blocks < -1) {
    return invalid_argument("prefix cache blocks must be >= 0 (0: no prefix cache), or -1 (the whole pool), got " +
                            std::to_string(c.prefix_cache_blocks));
  }
  if (c.prefix_report_blocks < 0) {
    return invalid_argument("prefix_report_blocks must be >= 0, got " + std::to_string(c.prefix_report_blocks));
  }
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
      hash_seed_(prefix_hash_seed(model.fingerprint(), dtype_name(config_.kv_dtype), config_.block_size)),
      blocks_(config_.n_blocks, config_.block_size, config_.prefix_cache_blocks) {
  cache_ = model_.make_kv_cache(config_.n_blocks, config_.block_size, config_.kv_dtype);
  if (metrics_) {
    const auto labels = Metrics::role_labels("prefill", config_.name);
    metrics_->kv_blocks_total.Add(labels).Set(blocks_.n_total());
    step_tokens_hist_ = &metrics_->histogram(metrics_->prefill_step_tokens, labels);
    prefill_seconds_hist_ = &metrics_->histogram(metrics_->prefill_seconds, labels);
    queue_depth_gauge_ = &metrics_->queue_depth.Add(labels);
    running_gauge_ = &metrics_->running_sequences.Add(labels);
    blocks_free_gauge_ = &metrics_->kv_blocks_free.Add(labels);
    cached_blocks_gauge_ = &metrics_->prefix_cache_blocks.Add(labels);
    lookup_tokens_counter_ = &metrics_->prefix_cache_lookup_tokens_total.Add(labels);
    hit_tokens_counter_ = &metrics_->prefix_cache_hit_tokens_total.Add(labels);
    inserted_blocks_counter_ = &metrics_->prefix_cache_inserted_blocks_total.Add(labels);
    evicted_blocks_counter_ = &metrics_->prefix_cache_evicted_blocks_total.Add(labels);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    update_gauges_locked();
  }
  for (int i = 0; i < config_.n_senders; ++i) sender_threads_.emplace_back([this] {
      set_thread_name("prefill-kv-send");
      sender_loop();
    });
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
  kv_cv_.notify_all();
  for (const auto& job : done) finish(job);

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
  const int need = blocks_.blocks_for(static_cast<int64_t>(spec.tokens.size()));  // block_size is immutable
  if (need > blocks_.n_total()) {
    return invalid_argument("request " + spec.request_id + " needs " + std::to_string(need) +
                            " KV blocks; this prefill worker has " + std::to_string(blocks_.n_total()));
  }

  auto job = std::make_shared<Job>();
  job->spec = std::move(spec);
  if (blocks_.enabled()) job->hashes = prefix_block_hashes(hash_seed_, config_.block_size, job->spec.tokens);
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
      job->end(cancelled("request " + request_id + " was cancelled while queued for prefill"));
      if (leave_engine_locked(job)) dropped = job;
      update_gauges_locked();
    }
    // Running: dropped at the next step boundary. Its transfer (running or queued) sees the flag.
  }
  kv_cv_.notify_all();
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
      finish(job);
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
    finish(job);
  }
  run_step(std::move(slices));
  return true;
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
    job->n_done = job->kv_done = job->kv_step_end = job->n_cached;
    if (metrics_ && blocks_.enabled()) {
      lookup_tokens_counter_->Increment(job->n_tokens());
      hit_tokens_counter_->Increment(job->n_cached);
    }
    running_.push_back(job);
    if (config_.stream_kv) hand_to_sender_locked(job);  // its chunks go as the steps write them
    add_slice(job, job->n_cached, std::min(job->n_tokens() - job->n_cached, budget));
  }
  update_gauges_locked();
  return slices;
}

void PrefillEngine::run_step(std::vector<Slice> slices) {
  if (slices.empty()) return;
  const int n_layers = model_.config().n_layers;
  // Jobs' token vectors and block tables do not change while they run: the batch can point at them.
  batch_.clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Slice& s : slices) {
      s.job->kv_step_end = s.start + s.n;
      s.job->kv_layers = 0;
    }
  }
  for (const Slice& s : slices) {
    const bool last = s.start + s.n == s.job->n_tokens();
    batch_.add(std::span<const int32_t>(s.job->spec.tokens).subspan(s.start, s.n), s.start, s.job->kv.table,
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
  // Streaming: each layer's K and V of the step may leave as soon as the forward wrote them.
  Model::LayerDone layer_done;
  if (config_.stream_kv) {
    layer_done = [&](int layer) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (const Slice& s : slices) s.job->kv_layers = layer + 1;
      }
      kv_cv_.notify_all();
    };
  }
  std::vector<int32_t> first_tokens;
  const Clock::time_point step_start = Clock::now();
  model_.forward_sample(batch_, *cache_, specs, &first_tokens, layer_done);
  const Clock::time_point done = Clock::now();
  n_steps_++;
  if (metrics_) step_tokens_hist_->Observe(static_cast<double>(batch_.n_tokens()));
  for (size_t i = 0; i < finished.size(); ++i) finished[i]->first_token = first_tokens[i];
  {
    std::lock_guard<std::mutex> lock(mu_);
    step_stats_.add_step(done, seconds_between(step_start, done), batch_.n_tokens());
    for (const Slice& s : slices) {
      s.job->n_done += s.n;
      s.job->kv_done = s.job->kv_step_end;
      s.job->kv_layers = n_layers;
      // Its blocks the forward completed are shareable from the next step on.
      blocks_.insert(&s.job->kv, s.job->hashes, s.job->spec.tokens, s.job->n_done / config_.block_size);
    }
    update_gauges_locked();
  }
  kv_cv_.notify_all();

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
      job->spec.on_first_token(job->first_token, queue_s, prefill_s, job->n_cached);
    }
  }
  // Only now may a transfer end (its end carries the first token): on_first_token has returned.
  std::vector<std::shared_ptr<Job>> done_jobs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& job : finished) {
      running_.erase(std::find(running_.begin(), running_.end(), job));
      job->prefilled = !job->ended.has_value();
      job->prefilled_at = done;
      if (job->prefilled && !job->abandoned() && !job->has_sender) hand_to_sender_locked(job);
      if (leave_engine_locked(job)) done_jobs.push_back(job);
    }
    update_gauges_locked();
  }
  kv_cv_.notify_all();
  for (const auto& job : done_jobs) finish(job);
}

// ---- KV hand-off -------------------------------------------------------------------------------

void PrefillEngine::hand_to_sender_locked(const std::shared_ptr<Job>& job) {
  job->has_sender = true;
  to_send_.push_back(job);
  send_cv_.notify_one();
}

bool PrefillEngine::leave_engine_locked(const std::shared_ptr<Job>& job) {
  job->in_engine = false;
  return !job->has_sender || job->sender_done;
}

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

// The chunks of one job, in the order the steps write them: for each stretch of tokens the
// engine has taken up (a step's, or everything done before the sender got to the job), layer 0's
// chunks, then layer 1's, ... Each waits until the forward has written its layer.
//
// Concurrency: next() runs on a sender thread while the engine thread runs the forward. It only
// reads positions whose layer the forward has already written, and no step writes those again;
// blocks are not freed before the transfer ends. On CPU (plain memory) the copies cannot race;
// the CUDA backend writes asynchronously, so there the forward reports no layer early (the
// step's KV is complete when forward returns) and copies go on its own stream under its lock.
class PrefillEngine::JobSource final : public KvSource {
 public:
  JobSource(PrefillEngine& engine, std::shared_ptr<Job> job, const KvTransferHeader& header)
      : e_(engine),
        job_(std::move(job)),
        header_(header),
        row_bytes_(kv_chunk_bytes(header, 1)),
        layer_(header.n_layers) {
    tokens_per_chunk_ = static_cast<int32_t>(
        std::clamp<int64_t>(e_.config_.kv_chunk_bytes / (2 * row_bytes_), 1, header.n_tokens));
  }

  bool next(KvChunk* c) override {
    const int32_t n_tokens = header_.n_tokens;
    {
      std::unique_lock<std::mutex> lock(e_.mu_);
      for (;;) {
        if (job_->abandoned()) return false;  // the receiver refuses what it got
        if (layer_ == header_.n_layers) {  // the stretch is out: the next one, when there is one
          if (stretch_end_ == n_tokens) {
            if (job_->prefilled) return false;
          } else if (job_->kv_step_end > stretch_end_ || job_->kv_done > stretch_end_) {
            stretch_start_ = start_ = stretch_end_;
            // The cached part first, on its own: it is complete now, whatever the step in flight.
            stretch_end_ = stretch_end_ < job_->n_cached ? job_->n_cached : std::max(job_->kv_done, job_->kv_step_end);
            layer_ = 0;
            continue;
          }
        } else if (stretch_end_ <= job_->kv_done || layer_ < job_->kv_layers) {
          break;  // this layer of the stretch is in the cache
        }
        e_.kv_cv_.wait(lock);
      }
    }
    const int32_t n = std::min(tokens_per_chunk_, stretch_end_ - start_);
    c->layer = layer_;
    c->token_start = start_;
    c->token_count = n;
    c->k.resize(static_cast<size_t>(n * row_bytes_));
    c->v.resize(static_cast<size_t>(n * row_bytes_));
    e_.model_.backend().kv_export(*e_.cache_, layer_, job_->kv.table.data(), start_, n, c->k.data(), c->v.data());
    c->checksum = kv_checksum(c->k, c->v);
    start_ += n;
    if (start_ == stretch_end_) {
      start_ = stretch_start_;
      ++layer_;
    }
    return true;
  }

  std::optional<int32_t> first_token() override {
    std::lock_guard<std::mutex> lock(e_.mu_);
    if (job_->abandoned() || !job_->prefilled) return std::nullopt;
    return job_->first_token;
  }

 private:
  PrefillEngine& e_;
  std::shared_ptr<Job> job_;
  const KvTransferHeader& header_;
  const int64_t row_bytes_;
  int32_t tokens_per_chunk_ = 1;
  // The stretch [stretch_start_, stretch_end_) being sent: `layer_`'s chunks from `start_` on.
  // layer_ == n_layers: the stretch is out (initially the empty stretch [0, 0)).
  int32_t stretch_start_ = 0, stretch_end_ = 0, start_ = 0;
  int32_t layer_ = 0;
};

void PrefillEngine::send_kv(const std::shared_ptr<Job>& job) {
  const Clock::time_point t0 = Clock::now();
  const std::string& id = job->spec.request_id;
  const ModelConfig& mc = model_.config();
  KvTransferHeader header;
  header.request_id = id;
  header.model_fingerprint = job->spec.model_fingerprint;
  header.dtype = dtype_name(config_.kv_dtype);
  header.n_layers = mc.n_layers;
  header.n_kv_heads = mc.n_kv_heads;
  header.head_dim = mc.head_dim;
  header.n_tokens = job->n_tokens();
  header.token_ids = job->spec.tokens;

  Status status;
  int64_t bytes = 0;
  if (job->abandoned()) {
    status = cancelled("request " + id + " ended before its KV transfer");
  } else {
    // Chunks are exported lazily, one at a time, as the transport asks for them: at most one
    // chunk of this job's KV is in host memory here.
    JobSource source(*this, job, header);
    status = transport_.send(job->spec.decode_address, header, source, &bytes);
  }
  const Clock::time_point t1 = Clock::now();
  bool done = false;
  double seconds = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // What the hand-off adds to the request: from the first token (or the transfer's start, when
    // it began later) to the decode worker's acknowledgement.
    seconds = seconds_between(job->prefilled ? std::max(t0, job->prefilled_at) : t0, t1);
    // A failed transfer ends the job (a running prompt stops at the next step boundary).
    if (!status.ok()) job->end(job->cancelled ? cancelled("request " + id + " was cancelled during its KV transfer") : status);
    job->sender_done = true;
    job->transfer_status = status;
    job->transfer_seconds = seconds;
    job->bytes = bytes;
    done = !job->in_engine;
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
    } else if (status.code() != StatusCode::kCancelled && !job->cancelled) {
      metrics_->kv_transfer_errors_total.Add(labels).Increment();
    }
  }
  if (status.ok()) {
    spdlog::debug("req={} KV sent to {}: {} bytes, {:.3f}s after the first token", id, job->spec.decode_address, bytes,
                  seconds);
  } else if (status.code() != StatusCode::kCancelled && !job->cancelled) {
    spdlog::warn("req={} KV transfer failed: {}", id, status.to_string());
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
  if (!metrics_) return;
  queue_depth_gauge_->Set(static_cast<double>(waiting_.size()));
  running_gauge_->Set(static_cast<double>(running_.size() + n_sending_locked()));
  blocks_free_gauge_->Set(blocks_.n_free());
  cached_blocks_gauge_->Set(blocks_.n_cached());
  inserted_blocks_counter_->Increment(static_cast<double>(blocks_.n_inserted() - n_inserted_counted_));
  evicted_blocks_counter_->Increment(static_cast<double>(blocks_.n_evicted() - n_evicted_counted_));
  n_inserted_counted_ = blocks_.n_inserted();
  n_evicted_counted_ = blocks_.n_evicted();
}

}  // namespace baton
