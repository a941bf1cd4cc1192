#include "decode_worker/decode_engine.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <span>

#include "common/metrics.h"
#include "common/thread_name.h"
#include "decode_worker/decode_sequence.h"
#include "model/batch.h"

namespace baton {

// A finished request whose Stream never attaches is forgotten after this long (its blocks were
// freed when it finished; only the buffered events are kept).
constexpr auto kUndeliveredTtl = std::chrono::minutes(2);

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
      pool_(config.n_blocks, config.block_size),
      gauges_(metrics, "decode", config.name) {
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
  thread_ = std::thread([this] {
    set_thread_name("decode-step");
    run();
  });
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
    while (!fork_holds_.empty()) drop_fork_hold_locked(fork_holds_.begin());
    collect_deliveries_locked(&deliveries);
    seqs_.clear();
    update_gauges_locked();
  }
  deliver(deliveries);
}

// ---- admission ----------------------------------------------------------------------------------

Status DecodeEngine::admit(const DecodeAdmit& admitted, int64_t* reserved_blocks) {
  const ModelConfig& mc = model_.config();
  DecodeAdmit r = admitted;
  if (r.request_id.empty()) return invalid_argument("request_id is empty");
  BATON_RETURN_IF_ERROR(r.validate_against(mc));  // the sizes first: the messages below quote fields
  if (r.model_fingerprint != model_.fingerprint()) {
    return failed_precondition("request " + r.request_id + " is for model fingerprint '" + r.model_fingerprint +
                               "' but decode worker " + config_.name + " serves '" + model_.fingerprint() + "'");
  }
  // The format last: compiling a schema is the costliest check.
  BATON_RETURN_IF_ERROR(resolve_format(config_.constraints.get(), "decode worker " + config_.name, &r.sampling));
  const bool local = !r.prefill_tokens.empty();
  if (local && static_cast<int64_t>(r.prefill_tokens.size()) > config_.local_prefill_max_tokens) {
    return failed_precondition("request " + r.request_id + " asks decode worker " + config_.name + " to prefill " +
                               n_str(static_cast<int64_t>(r.prefill_tokens.size())) +
                               " tokens; it prefills prompts of up to " + n_str(config_.local_prefill_max_tokens) +
                               " tokens itself (--local-prefill-max-tokens)");
  }
  const int64_t n_positions = int64_t{r.n_prompt_tokens} + r.max_tokens;

  std::unique_lock lk(mu_);
  if (stopping_) return unavailable("decode worker " + config_.name + " is shutting down");
  if (seqs_.count(r.request_id) != 0) return invalid_argument("request " + r.request_id + " is already admitted");
  // An id whose prompt is still held for its forks is in use too: admitted again, its new hold
  // would have replaced the old one and leaked that one's blocks.
  if (fork_holds_.count(r.request_id) != 0) {
    return invalid_argument("request " + r.request_id + " still holds its prompt's KV for forks; use another id");
  }
  if (!r.fork_of.empty()) {
    BATON_RETURN_IF_ERROR(admit_fork_locked(r, reserved_blocks));
    lk.unlock();
    cv_.notify_one();  // its one-token prefill
    return {};
  }
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
  if (local) {
    seq->state = SeqState::kPrefilling;
    prefilling_.push_back(seq);
    seq->set_sampler_history(r.prefill_tokens);
  }
  update_gauges_locked();
  if (r.deadline || local) work_ = true;  // the engine thread re-arms its timer, or prefills
  if (reserved_blocks != nullptr) *reserved_blocks = n_blocks;
  spdlog::info("decode req={} admitted: {} prompt tokens{}, max_tokens {}, {} blocks reserved, {} free", r.request_id,
               r.n_prompt_tokens, local ? " (prefilled here)" : "", r.max_tokens, n_blocks, pool_.n_free());
  lk.unlock();
  if (r.deadline || local) cv_.notify_one();
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
    if (seq->state == SeqState::kRunning || seq->state == SeqState::kPrefilling) {
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
    if (seq->state == SeqState::kRunning || seq->state == SeqState::kPrefilling) {
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
  return !in_wait_ && (!running_.empty() || !prefilling_.empty()) && now - beat_ > limit;
}

DecodeLoad DecodeEngine::load() const {
  std::lock_guard lk(mu_);
  DecodeLoad l;
  l.free_blocks = pool_.n_free();
  l.total_blocks = pool_.n_total();
  l.block_size = pool_.block_size();
  l.n_running = static_cast<int32_t>(running_.size());
  l.n_waiting = n_waiting_;
  l.local_prefill_max_tokens = config_.local_prefill_max_tokens;
  for (const SeqPtr& seq : prefilling_) l.queued_prompt_tokens += seq->admit.n_prompt_tokens - seq->n_prefilled;
  l.step_seconds = step_stats_.slowest_step_seconds(DecodeClock::now());
  l.prefill_tokens_per_second = step_stats_.prompt_tokens_per_second();
  return l;
}

// ---- the engine thread ------------------------------------------------------------------------

void DecodeEngine::run() {
  if (Status s = model_.backend().bind_thread(); !s.ok()) {
    spdlog::warn("decode worker {}: {}; the step loop runs unpinned", config_.name, s.to_string());
  }
  std::vector<SeqPtr> batch;
  std::vector<int32_t> sampled;
  std::vector<TokenLogprobs> sampled_logprobs;
  std::vector<Delivery> deliveries;
  std::unique_lock lk(mu_);
  while (true) {
    work_ = false;
    beat_ = DecodeClock::now();
    // Step boundary: apply cancellations, deadlines; hand out events.
    for (auto* list : {&running_, &prefilling_}) {
      for (size_t i = 0; i < list->size();) {
        SeqPtr seq = (*list)[i];
        if (seq->cancel_why) {
          finish_locked(seq, *seq->cancel_why, "");  // erases it from the list
        } else {
          ++i;
        }
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
    if (running_.empty() && prefilling_.empty()) {
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
    const std::vector<PrefillSlice> prefills = plan_prefills_locked();
    for (const PrefillSlice& p : prefills) {
      if (!p.seq->prefill_started) {
        p.seq->prefill_started = true;
        p.seq->prefill_start_at = step_start;
      }
    }
    lk.unlock();
    for (const PrefillSlice& p : prefills) {
      if (p.seq->n_copy > 0) copy_fork_prefix(*p.seq);  // before its slice reads those positions
    }
    step(batch, prefills, &sampled, &sampled_logprobs);
    lk.lock();
    for (const PrefillSlice& p : prefills) release_fork_copy_locked(*p.seq);
    const auto step_end = DecodeClock::now();
    int64_t step_prompt_tokens = 0;
    for (const PrefillSlice& p : prefills) step_prompt_tokens += p.n;
    step_stats_.add_step(step_end, seconds_between(step_start, step_end), step_prompt_tokens);
    // Prompts prefilled here: the chunk's KV is in, and a finished prompt's first token sampled
    // (after the decode sequences' samples, in slice order).
    size_t next_sample = batch.size();
    for (const PrefillSlice& p : prefills) {
      Sequence& s = *p.seq;
      s.n_prefilled = p.start + p.n;
      if (s.n_prefilled == s.admit.n_prompt_tokens) {
        const TokenLogprobs* lp = sampled_logprobs.empty() ? nullptr : &sampled_logprobs[next_sample];
        prefilled_locked(p.seq, sampled[next_sample++], lp, step_end);
      }
    }

    // Those still waiting for a slot: a beat now and then (their tokens come when others finish).
    for (size_t i = batch.size(); i < running_.size(); ++i) {
      Sequence& s = *running_[i];
      if (s.sink && step_end - s.last_beat >= config_.slot_wait_beat) {
        s.last_beat = step_end;
        s.has_pending = true;
      }
    }
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
      s.sampler.observe(id);
      s.pending.token_ids.push_back(id);
      if (s.admit.sampling.top_logprobs >= 0) s.pending.logprobs.push_back(sampled_logprobs[i]);
      s.has_pending = true;
      if (const FinishReason end = stop_rule(s.admit).after(id, s.n_generated); end != FinishReason::kNone) {
        finish_locked(batch[i], {}, finish_reason_name(end));
      } else {
        s.next_token = id;
        ++s.position;
      }
    }
  }
}

void DecodeEngine::step(const std::vector<SeqPtr>& batch, const std::vector<PrefillSlice>& prefills,
                        std::vector<int32_t>* sampled, std::vector<TokenLogprobs>* logprobs) {
  StepBatch b;
  for (const SeqPtr& s : batch) {
    BATON_CHECK(s->position < static_cast<int64_t>(s->table.size()) * config_.block_size,
                "position %d beyond the reserved blocks of request %s", s->position, s->admit.request_id.c_str());
    b.add(std::span(&s->next_token, 1), s->position, s->table, Logits::kLast);
  }
  for (const PrefillSlice& p : prefills) {
    const bool last = p.start + p.n == p.seq->admit.n_prompt_tokens;
    b.add(std::span<const int32_t>(p.seq->admit.prefill_tokens).subspan(p.start, p.n), p.start, p.seq->table,
          last ? Logits::kLast : Logits::kNone);
  }
  // Sampled where the logits are: on a GPU only the ids come back.
  specs_.clear();
  adjust_.clear();
  for (const SeqPtr& s : batch) {
    s->sampler.adjustments(static_cast<int32_t>(specs_.size()), &adjust_);
    specs_.push_back(s->sampler.spec_at(s->position + 1));  // the token after the input
  }
  for (const PrefillSlice& p : prefills) {
    // The first token, at the position after the prompt, as a prefill worker draws it.
    if (p.start + p.n == p.seq->admit.n_prompt_tokens) {
      p.seq->sampler.adjustments(static_cast<int32_t>(specs_.size()), &adjust_);
      specs_.push_back(p.seq->sampler.spec_at(p.seq->admit.n_prompt_tokens));
    }
  }
  model_.forward_sample(b, *cache_, specs_, adjust_, sampled, logprobs);
}

std::vector<DecodeEngine::PrefillSlice> DecodeEngine::plan_prefills_locked() const {
  std::vector<PrefillSlice> out;
  int budget = config_.local_prefill_token_budget;
  for (const SeqPtr& seq : prefilling_) {
    if (budget == 0) break;
    const int32_t n = std::min(seq->admit.n_prompt_tokens - seq->n_prefilled, budget);
    out.push_back({seq, seq->n_prefilled, n});
    budget -= n;
  }
  return out;
}

void DecodeEngine::prefilled_locked(const SeqPtr& seq, int32_t first, const TokenLogprobs* logprobs,
                                    DecodeClock::time_point step_end) {
  Sequence& s = *seq;
  s.queue_seconds = seconds_between(s.admitted_at, s.prefill_start_at);
  s.prefill_seconds = seconds_between(s.prefill_start_at, step_end);
  if (first == kNonFiniteLogits) {
    spdlog::error("decode req={}: the logits at position {} are not finite (NaN or infinity); ending it",
                  s.admit.request_id, s.admit.n_prompt_tokens);
    finish_locked(seq, internal_error("decode worker " + config_.name + ": the logits at position " +
                                          std::to_string(s.admit.n_prompt_tokens) +
                                          " are not finite (NaN or infinity); no token was produced"),
                  "");
    return;
  }
  prefilling_.erase(std::remove(prefilling_.begin(), prefilling_.end(), seq), prefilling_.end());
  --n_waiting_;
  hold_for_forks_locked(s, s.admit.prefill_tokens);
  s.state = SeqState::kRunning;
  s.kv_end_at = step_end;  // decode queue: from here to its first decode step
  s.next_token = first;
  s.position = s.admit.n_prompt_tokens;
  s.n_generated = 1;
  s.sampler.observe(first);
  s.pending.token_ids.push_back(first);
  if (logprobs != nullptr && s.admit.sampling.top_logprobs >= 0) s.pending.logprobs.push_back(*logprobs);
  s.pending.first_token_included = true;
  s.has_pending = true;
  if (const FinishReason end = stop_rule(s.admit).after(first, s.n_generated); end != FinishReason::kNone) {
    finish_locked(seq, {}, finish_reason_name(end));
  } else {
    running_.push_back(seq);
  }
}

// ---- helpers (under mu_) ------------------------------------------------------------------------

void DecodeEngine::finish_locked(const SeqPtr& seq, const Status& status, const std::string& finish_reason) {
  Sequence& s = *seq;
  if (s.state == SeqState::kFinished) return;
  if (s.state == SeqState::kRunning) {
    running_.erase(std::remove(running_.begin(), running_.end(), seq), running_.end());
  } else {
    if (s.state == SeqState::kPrefilling) {
      prefilling_.erase(std::remove(prefilling_.begin(), prefilling_.end(), seq), prefilling_.end());
    }
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
  if (s.n_importing > 0) {
    s.free_when_idle = true;  // a kv_chunk is writing into these blocks right now
    return;
  }
  pool_.release(s.table);
  release_fork_copy_locked(s);  // a fork that ended before its first step
}

void DecodeEngine::collect_deliveries_locked(std::vector<Delivery>* out) {
  for (auto it = seqs_.begin(); it != seqs_.end();) {
    Sequence& s = *it->second;
    if (s.sink && s.has_pending) {
      DecodeOutput o = std::move(s.pending);
      s.pending = {};
      s.has_pending = false;
      if (!s.timing_sent && (!o.token_ids.empty() || o.done)) {
        s.timing_sent = true;
        o.decode_queue_seconds = s.decode_queue_seconds;
        o.kv_transfer_seconds = s.kv_transfer_seconds;
        o.queue_seconds = s.queue_seconds;
        o.prefill_seconds = s.prefill_seconds;
        o.cached_tokens = s.n_forked;
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
  for (auto it = fork_holds_.begin(); it != fork_holds_.end();) {
    if (it->second.expires <= now) {
      spdlog::info("decode req={}: {} announced forks did not come within {} ms; its prompt blocks are released",
                   it->first, it->second.n_left, config_.fork_hold.count());
      drop_fork_hold_locked(it++);
    } else {
      consider(it->second.expires);
      ++it;
    }
  }
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
  gauges_.set(n_waiting_, static_cast<double>(running_.size()), pool_.n_free(), pool_.n_total());
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
