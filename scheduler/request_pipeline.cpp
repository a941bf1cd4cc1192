#include "scheduler/request_pipeline.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>

#include "model/stop_rule.h"
#include "scheduler/redact.h"

namespace baton {
namespace {

// Errors that say the worker (or the path to it) failed, not that the request is wrong: the
// attempt fails over. Refusals (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, FAILED_PRECONDITION, …),
// deadlines and cancellations end the request instead, and so does INTERNAL: a worker that
// answers at all and says INTERNAL (logits that are not finite, say) would say it again.
bool is_worker_fault(const Status& s) {
  return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDataLoss;
}

// The decode stream: also a reservation the worker no longer knows (it restarted since Admit).
bool is_stream_fault(const Status& s) { return is_worker_fault(s) || s.code() == StatusCode::kNotFound; }

// The KV hand-off, after the first token: whatever broke it, another pair can redo it; only the
// request's own deadline or cancellation end it.
bool is_handoff_fault(const Status& s) {
  return s.code() != StatusCode::kDeadlineExceeded && s.code() != StatusCode::kCancelled;
}

void add_unique(std::vector<std::string>& v, const std::string& s) {
  if (std::find(v.begin(), v.end(), s) == v.end()) v.push_back(s);
}

std::string join(const std::vector<std::string>& parts) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) out += "; ";
    out += "attempt " + std::to_string(i + 1) + ": " + parts[i];
  }
  return out;
}

}  // namespace

const char* pipeline_state_name(PipelineState state) {
  switch (state) {
    case PipelineState::kNew: return "new";
    case PipelineState::kQueued: return "queued";
    case PipelineState::kAdmitting: return "admitting";
    case PipelineState::kPrefilling: return "prefilling";
    case PipelineState::kDecoding: return "decoding";
    case PipelineState::kEnded: return "ended";
  }
  return "?";
}

// The pipeline's mutex, and the scheduler calls (which may call back into this or another
// pipeline) to make once it is released.
class RequestPipeline::Guard {
 public:
  explicit Guard(RequestPipeline& p) : lock_(p.mu_) {}
  ~Guard() {
    lock_.unlock();
    for (auto& a : after_) a();
  }
  void after(std::function<void()> fn) { after_.push_back(std::move(fn)); }

 private:
  std::unique_lock<std::mutex> lock_;
  std::vector<std::function<void()>> after_;
};

std::shared_ptr<RequestPipeline> RequestPipeline::create(const PipelineDeps& deps, PipelineRequest request,
                                                         std::shared_ptr<ResponseSink> sink) {
  BATON_CHECK(deps.scheduler && deps.registry && deps.client && deps.clock && sink, "RequestPipeline without its parts");
  BATON_CHECK(!request.prompt_ids.empty() && request.max_tokens >= 1, "RequestPipeline given an unvalidated request");
  return std::shared_ptr<RequestPipeline>(new RequestPipeline(deps, std::move(request), std::move(sink)));
}

RequestPipeline::RequestPipeline(const PipelineDeps& deps, PipelineRequest request, std::shared_ptr<ResponseSink> sink)
    : deps_(deps), req_(std::move(request)), sink_(std::move(sink)) {}

PipelineState RequestPipeline::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

std::string RequestPipeline::attempt_id() const {
  std::lock_guard<std::mutex> lock(mu_);
  return attempt_.id;
}

void RequestPipeline::report_fault(WorkerRole role, const std::string& address, const Status& status) {
  // A broken connection takes the worker out of placement at once; other errors count towards
  // the registry's unhealthy threshold.
  if (status.code() == StatusCode::kUnavailable) {
    deps_.registry->report_down(role, address);
  } else {
    deps_.registry->report_failure(role, address);
  }
}

Status RequestPipeline::with_history(const Status& status) const {
  if (history_.empty()) return status;
  return status.with_message(status.message() + " (after failovers: " + join(history_) + ")");
}

std::string RequestPipeline::for_client(std::string text) const {
  return redact_for_client(std::move(text), req_.label, attempt_ids_, worker_addresses_);
}

std::string RequestPipeline::log_name() const {
  return (req_.label.empty() ? "-" : req_.label) + " attempt " + std::to_string(attempt_.number + 1) + " (" +
         attempt_.id + ", prefill " +
         (attempt_.placement.prefill_address.empty() ? "-" : attempt_.placement.prefill_address) + ", decode " +
         (attempt_.placement.decode_address.empty() ? "-" : attempt_.placement.decode_address) + ")";
}

double RequestPipeline::since_arrival(TimePoint t) const {
  return std::chrono::duration<double>(t - req_.arrival).count();
}

void RequestPipeline::start() {
  {
    Guard g(*this);
    if (state_ != PipelineState::kNew) return;
    if (is_follower()) {
      state_ = PipelineState::kQueued;  // no attempt yet: it waits for the leader's KV
      std::weak_ptr<RequestPipeline> weak = weak_from_this();
      g.after([weak, group = req_.group] {
        group->follow([weak](const std::optional<ChoiceGroup::Source>& source) {
          if (auto self = weak.lock()) self->on_fork_source(source);
        });
      });
    } else {
      submit_attempt_locked(g);
    }
  }
  if (deps_.watch != nullptr) deps_.watch->add(weak_from_this());
}

void RequestPipeline::cancel(const Status& why) {
  Guard g(*this);
  if (state_ == PipelineState::kEnded) return;
  end_locked(g, why);
}

void RequestPipeline::submit_attempt_locked(Guard& g) {
  const int32_t number = attempt_.number + 1;
  attempt_ = Attempt{};
  attempt_.number = number;
  attempt_.id = random_request_id();
  attempt_ids_.push_back(attempt_.id);
  attempt_.handed_to_scheduler = true;
  kv_sent_reported_ = false;
  state_ = PipelineState::kQueued;
  PendingRequest pending;
  pending.id = attempt_.id;
  pending.n_prompt_tokens = static_cast<int64_t>(req_.prompt_ids.size() + emitted_.size());
  pending.n_total_tokens = static_cast<int64_t>(req_.prompt_ids.size()) + req_.max_tokens;
  pending.priority = req_.priority;
  pending.ttft_slo_seconds = req_.ttft_slo_seconds;
  pending.arrival = req_.arrival;  // a failover keeps its place in the order
  pending.deadline = req_.deadline;
  pending.avoid_decode = avoid_decode_;
  pending.avoid_prefill = avoid_prefill_;
  auto tokens = std::make_shared<std::vector<int32_t>>(req_.prompt_ids);
  tokens->insert(tokens->end(), emitted_.begin(), emitted_.end());
  pending.tokens = std::move(tokens);
  pending.cache_scope = req_.sampling.cache_scope;
  // A leader not yet published counts its prompt's other choices, which will fork its KV without
  // passing the scheduler, against the request bound. (Their KV is the decode worker's to admit:
  // each fork reserves its own blocks there or is refused, and a refused one is admitted here on
  // its own. Counted into this request's KV, a prompt whose choices no one worker holds at once
  // would be refused, where its choices are served on several.)
  if (is_leader() && !group_published_) pending.n_followers = req_.group->n_choices() - 1;
  pending.counted_by = std::exchange(counted_by_, {});
  std::weak_ptr<RequestPipeline> weak = weak_from_this();
  g.after([weak, number, id = attempt_.id, pending = std::move(pending), scheduler = deps_.scheduler]() mutable {
    const Status s = scheduler->submit(
        std::move(pending),
        [weak, number](const Placement& p) {
          if (auto self = weak.lock()) self->on_placed(number, p);
        },
        [weak, number](const Status& st) {
          if (auto self = weak.lock()) self->on_queue_failed(number, st);
        });
    if (auto self = weak.lock()) self->on_submitted(number, id, s);
  });
}

void RequestPipeline::on_fork_source(const std::optional<ChoiceGroup::Source>& source) {
  Guard g(*this);
  if (state_ != PipelineState::kQueued || attempt_.number != -1) return;  // ended while it waited
  if (!source) {
    submit_attempt_locked(g);
    return;
  }
  attempt_ = Attempt{};
  attempt_.number = 0;
  attempt_.id = random_request_id();
  attempt_.fork = true;
  attempt_.fork_of = source->request_id;
  attempt_ids_.push_back(attempt_.id);
  attempt_.placement.request_id = attempt_.id;
  attempt_.placement.decode_address = source->decode_address;
  attempt_.last_progress = deps_.clock->now();
  add_unique(worker_addresses_, source->decode_address);
  state_ = PipelineState::kAdmitting;
  AdmitCall call;
  call.request_id = attempt_.id;
  call.n_prompt_tokens = source->n_prompt_tokens;
  call.max_tokens = req_.max_tokens;
  call.sampling = req_.sampling;
  call.ignore_eos = req_.ignore_eos;
  call.model_fingerprint = req_.model_fingerprint;
  call.fork_of = source->request_id;
  mark_prefill_sent_locked();
  send_admit_locked(call);
}

void RequestPipeline::publish_locked(Guard& g, std::optional<ChoiceGroup::Source> source) {
  if (!is_leader() || group_published_) return;
  group_published_ = true;
  g.after([group = req_.group, source = std::move(source)] { group->publish(source); });
}

void RequestPipeline::kv_placed_locked(Guard& g) {
  if (!is_leader() || group_published_ || attempt_.fork) return;
  ChoiceGroup::Source source;
  source.decode_address = attempt_.placement.decode_address;
  source.request_id = attempt_.id;
  source.n_prompt_tokens = static_cast<int32_t>(req_.prompt_ids.size());
  publish_locked(g, std::move(source));
}

void RequestPipeline::mark_prefill_sent_locked() {
  if (prefill_sent_marked_) return;
  prefill_sent_marked_ = true;
  prefill_sent_ = deps_.clock->now();
}

void RequestPipeline::on_submitted(int32_t attempt, const std::string& id, const Status& status) {
  Guard g(*this);
  if (!current(attempt)) {
    // Abandoned while being handed over: the finished() sent then may have run before submit
    // took the id. Say it again (finished is idempotent; ids are never reused).
    if (status.ok()) g.after([s = deps_.scheduler, id] { s->finished(id); });
    return;
  }
  if (status.ok()) return;
  attempt_.handed_to_scheduler = false;  // refused: the scheduler holds nothing of it
  end_locked(g, with_history(status));
}

void RequestPipeline::on_placed(int32_t attempt, const Placement& placement) {
  Guard g(*this);
  if (!current(attempt)) {
    // Placed after the attempt was abandoned: give the placement back.
    g.after([s = deps_.scheduler, id = placement.request_id] { s->finished(id); });
    return;
  }
  attempt_.placement = placement;
  attempt_.last_progress = deps_.clock->now();
  add_unique(worker_addresses_, placement.prefill_address);
  add_unique(worker_addresses_, placement.decode_address);
  state_ = PipelineState::kAdmitting;
  AdmitCall call;
  call.request_id = attempt_.id;
  call.n_prompt_tokens = static_cast<int32_t>(req_.prompt_ids.size() + emitted_.size());
  call.n_output_tokens = static_cast<int32_t>(emitted_.size());
  call.max_tokens = req_.max_tokens - static_cast<int32_t>(emitted_.size());
  call.sampling = req_.sampling;
  call.ignore_eos = req_.ignore_eos;
  call.model_fingerprint = req_.model_fingerprint;
  call.kv_sender = placement.prefill_address;
  // A leader's attempt announces its followers' forks until it has told them where (or that
  // nothing is held): only then are they still to come.
  if (is_leader() && !group_published_) call.n_forks = req_.group->n_choices() - 1;
  if (!placement.prefill_address.empty()) {
    if (const auto prefill = deps_.registry->find(WorkerRole::kPrefill, placement.prefill_address)) {
      call.kv_sender_certificate = prefill->load.certificate;
    }
  }
  if (placement.prefill_address.empty()) {  // local prefill: the decode worker prefills it itself
    call.prefill_ids = req_.prompt_ids;
    call.prefill_ids.insert(call.prefill_ids.end(), emitted_.begin(), emitted_.end());
    mark_prefill_sent_locked();  // its queue time runs on from the Admit
  }
  send_admit_locked(call);
}

void RequestPipeline::send_admit_locked(const AdmitCall& call) {
  const int32_t attempt = attempt_.number;
  // An Admit answers in milliseconds. The watchdog fails a silent one over after the grace; the
  // call itself cannot be cancelled, so its deadline is bounded too, well past the grace.
  CallDeadline admit_deadline = req_.call_deadline;
  if (deps_.config.progress.enabled) {
    const ProgressConfig& pc = deps_.config.progress;
    admit_deadline = std::min(admit_deadline, std::chrono::system_clock::now() +
                                                  std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                                      std::chrono::duration<double>(2 * pc.slack * pc.grace_seconds)));
  }
  std::weak_ptr<RequestPipeline> weak = weak_from_this();
  deps_.client->admit(attempt_.placement.decode_address, call, admit_deadline,
                      [weak, attempt, client = deps_.client, addr = attempt_.placement.decode_address,
                       id = attempt_.id](const Status& s) {
                        // Admitted for an attempt that is gone: the reservation is nobody's.
                        const auto self = weak.lock();
                        const bool taken = self && self->on_admitted(attempt, s);
                        if (!taken && s.ok()) client->release(addr, id);
                      });
}

void RequestPipeline::on_queue_failed(int32_t attempt, const Status& status) {
  Guard g(*this);
  if (!current(attempt)) return;
  attempt_.handed_to_scheduler = false;  // the scheduler forgot it
  end_locked(g, with_history(status));
}

bool RequestPipeline::on_admitted(int32_t attempt, const Status& status) {
  Guard g(*this);
  if (!current(attempt)) return false;
  const std::string& addr = attempt_.placement.decode_address;
  if (!status.ok() && attempt_.fork && !is_worker_fault(status) && status.code() != StatusCode::kDeadlineExceeded &&
      status.code() != StatusCode::kCancelled) {
    // The worker holds no such prompt for forks (the leader's hold expired, its forks were taken),
    // or has no room: this choice is admitted with its own KV instead. Nothing failed.
    spdlog::info("req={}: the fork was refused ({}); admitting it with its own KV", log_name(), status.to_string());
    counted_by_ = attempt_.fork_of;  // its leader's admission counted it: the count moves over
    abandon_attempt_locked(g);
    submit_attempt_locked(g);
    return true;
  }
  if (!status.ok()) {
    if (is_worker_fault(status)) {
      report_fault(WorkerRole::kDecode, addr, status);
      attempt_.admitted = true;  // it may have admitted before the error reached us: release
      failover_locked(g, "decode_admit", "the decode worker", status);
      return true;
    }
    if (status.code() == StatusCode::kResourceExhausted) {
      // The worker is fuller than its last report said: wait in the queue for one with room
      // (not a failover: nothing failed).
      spdlog::debug("req={}: decode worker {} is full ({}); queued again", req_.label, addr, status.message());
      deps_.registry->report_exhausted(addr);
      abandon_attempt_locked(g);
      submit_attempt_locked(g);
      return true;
    }
    spdlog::warn("req={}: the decode worker refused the request: {}", log_name(), status.to_string());
    end_locked(g, Status(status.code(), "the decode worker refused the request: " + status.message()));
    return true;
  }
  attempt_.admitted = true;
  attempt_.last_progress = deps_.clock->now();
  if (!attempt_.fork) g.after([s = deps_.scheduler, id = attempt_.id] { s->decode_admitted(id); });
  state_ = PipelineState::kPrefilling;
  open_worker_calls_locked();
  return true;
}

void RequestPipeline::open_worker_calls_locked() {
  const int32_t attempt = attempt_.number;
  std::weak_ptr<RequestPipeline> weak = weak_from_this();
  attempt_.decode = deps_.client->stream(
      attempt_.placement.decode_address, attempt_.id, req_.call_deadline,
      [weak, attempt](const DecodeUpdate& u) {
        if (auto self = weak.lock()) self->on_decode_update(attempt, u);
      },
      [weak, attempt](const Status& s) {
        if (auto self = weak.lock()) self->on_decode_done(attempt, s);
      });
  if (attempt_.placement.prefill_address.empty()) return;  // local prefill: the stream brings the first token
  PrefillCall call;
  call.request_id = attempt_.id;
  call.prompt_ids = req_.prompt_ids;
  call.generated_ids = emitted_;
  call.sampling = req_.sampling;
  call.decode_address = attempt_.placement.decode_address;
  // Before the call: the worker may take the request (and start its queue clock) before the call
  // returns here, and the two parts of the queue time must not overlap.
  mark_prefill_sent_locked();
  attempt_.prefill = deps_.client->prefill(
      attempt_.placement.prefill_address, call, req_.call_deadline,
      [weak, attempt](const PrefillUpdate& u) {
        if (auto self = weak.lock()) self->on_prefill_update(attempt, u);
      },
      [weak, attempt](const Status& s) {
        if (auto self = weak.lock()) self->on_prefill_done(attempt, s);
      });
}

void RequestPipeline::on_prefill_update(int32_t attempt, const PrefillUpdate& u) {
  Guard g(*this);
  if (!current(attempt)) return;
  attempt_.last_progress = deps_.clock->now();
  if (u.kind == PrefillUpdate::Kind::kProgress) return;  // (the time above is all it brings)
  if (u.kind == PrefillUpdate::Kind::kKvSent) {
    kv_transfer_s_ = u.transfer_seconds;
    kv_sent_reported_ = true;
    kv_placed_locked(g);
    return;
  }
  if (attempt_.first_token) return;  // a worker that sends two: the first stands
  if (wants_logprobs() && !u.logprobs) {
    failover_locked(g, "prefill", "the prefill worker",
                    internal_error("its first token came without the log-probabilities asked for"));
    return;
  }
  first_token_locked(g, u.token_id, u.logprobs ? &*u.logprobs : nullptr, u.queue_seconds, u.prefill_seconds,
                     u.cached_tokens);
  if (state_ == PipelineState::kEnded) return;
  maybe_complete_locked(g);
}

void RequestPipeline::first_token_locked(Guard& g, int32_t token, const TokenLogprobs* logprobs,
                                         double queue_seconds, double prefill_seconds, int32_t cached_tokens) {
  attempt_.first_token = true;
  if (!attempt_.fork) {  // (the scheduler placed no fork: it learns prefill rates from the others)
    g.after([s = deps_.scheduler, id = attempt_.id, prefill_seconds, cached_tokens] {
      s->first_token(id, prefill_seconds, cached_tokens);
    });
  }
  state_ = PipelineState::kDecoding;
  if (!have_first_token_) {
    have_first_token_ = true;
    first_token_at_ = deps_.clock->now();
    queue_s_ = std::chrono::duration<double>(prefill_sent_ - req_.arrival).count() + queue_seconds;
    prefill_s_ = prefill_seconds;
    cached_prompt_tokens_ = cached_tokens;
  }
  emit_locked(g, std::span(&token, 1), logprobs != nullptr ? std::span(logprobs, 1) : std::span<const TokenLogprobs>());
  if (state_ == PipelineState::kEnded) return;
  std::vector<int32_t> early;
  std::vector<TokenLogprobs> early_logprobs;
  early.swap(attempt_.early);
  early_logprobs.swap(attempt_.early_logprobs);
  emit_locked(g, early, early_logprobs);
}

void RequestPipeline::on_prefill_done(int32_t attempt, const Status& status) {
  Guard g(*this);
  if (!current(attempt)) return;
  attempt_.prefill = nullptr;
  const std::string& addr = attempt_.placement.prefill_address;
  if (status.ok()) {
    if (!attempt_.first_token) {
      failover_locked(g, "prefill", "the prefill worker", internal_error("it ended without a first token"));
    }
    return;
  }
  if (attempt_.first_token ? !is_handoff_fault(status) : !is_worker_fault(status)) {
    spdlog::warn("req={}: prefill failed: {}", log_name(), status.to_string());
    end_locked(g, Status(status.code(), "prefill failed: " + status.message()));
    return;
  }
  if (!attempt_.first_token) {
    report_fault(WorkerRole::kPrefill, addr, status);
    failover_locked(g, "prefill", "the prefill worker", status);
  } else {
    // The KV hand-off failed: either end may be at fault (a dead decode worker also breaks
    // the decode stream; whichever arrives first fails the attempt over).
    failover_locked(g, "kv_handoff", "the KV hand-off from the prefill to the decode worker", status);
  }
}

void RequestPipeline::on_decode_update(int32_t attempt, const DecodeUpdate& u) {
  Guard g(*this);
  if (!current(attempt)) return;
  attempt_.last_progress = deps_.clock->now();
  kv_placed_locked(g);  // a decode event comes only once the prompt's KV is complete there
  if (u.decode_queue_seconds > 0) decode_queue_s_ = u.decode_queue_seconds;
  // The prefill worker's figure (first token → KV acknowledged) is the hand-off's cost to the
  // request; the decode worker's (first byte → last, which overlaps the prefill when the KV
  // streams) stands in only until that report arrives.
  if (u.kv_transfer_seconds > 0 && !kv_sent_reported_) kv_transfer_s_ = u.kv_transfer_seconds;
  std::span<const int32_t> tokens(u.token_ids);
  std::span<const TokenLogprobs> logprobs(u.logprobs);
  if (wants_logprobs() && logprobs.size() != tokens.size()) {
    failover_locked(g, "decode", "the decode worker",
                    internal_error("it sent " + std::to_string(tokens.size()) + " tokens with " +
                                   std::to_string(logprobs.size()) + " log-probabilities"));
    return;
  }
  if (u.first_token_included && !attempt_.first_token && !tokens.empty()) {
    // Prefilled by the decode worker itself: the stream's first token is the request's.
    first_token_locked(g, tokens.front(), logprobs.empty() ? nullptr : &logprobs.front(), u.queue_seconds,
                       u.prefill_seconds, u.cached_tokens);
    if (state_ == PipelineState::kEnded) return;
    tokens = tokens.subspan(1);
    if (!logprobs.empty()) logprobs = logprobs.subspan(1);
  }
  if (!attempt_.first_token) {
    attempt_.early.insert(attempt_.early.end(), tokens.begin(), tokens.end());
    attempt_.early_logprobs.insert(attempt_.early_logprobs.end(), logprobs.begin(), logprobs.end());
  } else {
    emit_locked(g, tokens, logprobs);
    if (state_ == PipelineState::kEnded) return;
  }
  if (u.done) {
    attempt_.decode_done = true;
    if (finish_reason_.empty()) finish_reason_ = u.length ? "length" : "stop";
    maybe_complete_locked(g);
  }
}

void RequestPipeline::on_decode_done(int32_t attempt, const Status& status) {
  Guard g(*this);
  if (!current(attempt)) return;
  attempt_.decode = nullptr;
  const std::string& addr = attempt_.placement.decode_address;
  if (status.ok()) {
    if (!attempt_.decode_done) {
      failover_locked(g, "decode", "the decode worker", internal_error("it ended the stream without a final event"));
    }
    return;
  }
  if (!is_stream_fault(status)) {
    spdlog::warn("req={}: decode failed: {}", log_name(), status.to_string());
    end_locked(g, Status(status.code(), "decode failed: " + status.message()));
    return;
  }
  report_fault(WorkerRole::kDecode, addr, status);
  failover_locked(g, "decode", "the decode worker", status);
}

ProgressInputs RequestPipeline::progress_inputs_locked() const {
  using Phase = ProgressInputs::Phase;
  const Placement& p = attempt_.placement;
  const std::optional<WorkerSnapshot> decode = deps_.registry->find(WorkerRole::kDecode, p.decode_address);
  std::optional<WorkerSnapshot> prefill;
  if (!p.prefill_address.empty()) prefill = deps_.registry->find(WorkerRole::kPrefill, p.prefill_address);
  const Phase phase = state_ == PipelineState::kAdmitting     ? Phase::kAdmitting
                      : state_ != PipelineState::kPrefilling ? Phase::kDecoding
                      : p.prefill_address.empty()            ? Phase::kLocalPrefill
                                                             : Phase::kPrefill;
  return progress_inputs(phase, prefill ? &*prefill : nullptr, decode ? &*decode : nullptr,
                         static_cast<int64_t>(req_.prompt_ids.size() + emitted_.size()),
                         attempt_.prefill != nullptr && !kv_sent_reported_);
}

bool RequestPipeline::another_worker(WorkerRole role, const std::string& address) const {
  for (const WorkerSnapshot& w : deps_.registry->snapshot(role)) {
    if (w.address != address && w.can_place()) return true;
  }
  return false;
}

void RequestPipeline::check_progress(TimePoint now) {
  Guard g(*this);
  if (!deps_.config.progress.enabled) return;
  if (state_ != PipelineState::kAdmitting && state_ != PipelineState::kPrefilling &&
      state_ != PipelineState::kDecoding) {
    return;  // queued (the scheduler's), new or ended
  }
  const ProgressInputs in = progress_inputs_locked();
  const double bound = progress_bound(deps_.config.progress, in);
  const double silent = std::chrono::duration<double>(now - attempt_.last_progress).count();
  if (silent <= bound) return;
  char what[160];
  std::snprintf(what, sizeof what, "no progress for %.1f s while %s (bound %.1f s: --progress-grace-seconds %.1f + "
                "--progress-slack %.1f x what it reported)", silent, progress_phase_name(in.phase).c_str(), bound,
                deps_.config.progress.grace_seconds, deps_.config.progress.slack);
  const Status cause = unavailable(what);
  using Phase = ProgressInputs::Phase;
  // Failing over to the same stuck worker gains nothing: with no other worker to move to, the
  // attempt waits for this one (said once in the log) and moves when another turns up.
  const bool decode_side = in.phase != Phase::kPrefill;
  const bool prefill_side = in.phase == Phase::kPrefill || (in.phase == Phase::kDecoding && in.handoff_in_flight);
  const bool elsewhere = (decode_side && another_worker(WorkerRole::kDecode, attempt_.placement.decode_address)) ||
                         (prefill_side && another_worker(WorkerRole::kPrefill, attempt_.placement.prefill_address));
  if (!elsewhere) {
    if (!attempt_.stuck_logged) {
      attempt_.stuck_logged = true;
      spdlog::warn("req={}: {}; no other worker to move to, waiting for this one", log_name(), what);
    }
    return;
  }
  switch (in.phase) {
    case Phase::kAdmitting:
      deps_.registry->report_down(WorkerRole::kDecode, attempt_.placement.decode_address);
      attempt_.admitted = true;  // its answer may still come: release whatever it reserved
      failover_locked(g, "decode_admit", "the decode worker", cause);
      return;
    case Phase::kPrefill:
      deps_.registry->report_down(WorkerRole::kPrefill, attempt_.placement.prefill_address);
      failover_locked(g, "prefill", "the prefill worker", cause);
      return;
    case Phase::kLocalPrefill:
    case Phase::kDecoding:
      if (in.handoff_in_flight && attempt_.first_token && !attempt_.decode_done) {
        // Silence while the KV moves: either end may be stuck; the hand-off is redone elsewhere.
        failover_locked(g, "kv_handoff", "the KV hand-off from the prefill to the decode worker", cause);
        return;
      }
      deps_.registry->report_down(WorkerRole::kDecode, attempt_.placement.decode_address);
      failover_locked(g, "decode", "the decode worker", cause);
      return;
  }
}

void RequestPipeline::emit_locked(Guard& g, std::span<const int32_t> ids, std::span<const TokenLogprobs> logprobs) {
  if (state_ == PipelineState::kEnded || ids.empty()) return;
  if (!wants_logprobs()) logprobs = {};
  // Never more than max_tokens, and nothing after a stop id, whatever a worker sends: the rule the
  // decode engine applied, applied again.
  const StopRule rule{req_.stop_ids, req_.ignore_eos, req_.max_tokens};
  const StopRule::Taken taken = rule.take(ids, static_cast<int64_t>(emitted_.size()));
  const std::span<const int32_t> offered = ids.subspan(0, taken.n);
  const ResponseSink::Accepted a = sink_->on_tokens(offered, logprobs.empty() ? logprobs : logprobs.first(taken.n));
  const size_t n = std::min(a.n, offered.size());
  emitted_.insert(emitted_.end(), offered.begin(), offered.begin() + static_cast<std::ptrdiff_t>(n));
  // The end the rule found counts only once the sink has kept every token offered.
  const bool all_kept = n == offered.size();
  if (a.stop || (all_kept && taken.end == FinishReason::kStop)) {
    finish_reason_ = finish_reason_name(FinishReason::kStop);
    end_locked(g, Status());
  } else if (all_kept && taken.end == FinishReason::kLength) {
    if (finish_reason_.empty()) finish_reason_ = finish_reason_name(FinishReason::kLength);
    end_locked(g, Status());
  }
}

void RequestPipeline::maybe_complete_locked(Guard& g) {
  if (state_ == PipelineState::kEnded || !attempt_.first_token || !attempt_.decode_done) return;
  end_locked(g, Status());
}

void RequestPipeline::failover_locked(Guard& g, const std::string& reason, const std::string& who,
                                      const Status& cause) {
  // The log has the attempt's id and workers; the history (which the client may read) has neither.
  spdlog::warn("req={} failed ({}): {}: {}; {}", log_name(), reason, who, cause.to_string(),
               static_cast<int32_t>(history_.size()) < deps_.config.max_failovers
                   ? "failing over, re-prefilling " + std::to_string(req_.prompt_ids.size()) + " prompt + " +
                         std::to_string(emitted_.size()) + " generated tokens"
                   : std::string("no failover left (--max-failovers)"));
  history_.push_back(reason + ": " + std::string(status_code_name(cause.code())) + ": " + who + ": " +
                     for_client(cause.message()));
  if (static_cast<int32_t>(history_.size()) > deps_.config.max_failovers) {
    end_locked(g, unavailable("no worker could finish the request after " + std::to_string(history_.size()) +
                              " attempts (--max-failovers " + std::to_string(deps_.config.max_failovers) +
                              "): " + join(history_)));
    return;
  }
  if (reason == "decode" || reason == "decode_admit" || reason == "kv_handoff") {
    add_unique(avoid_decode_, attempt_.placement.decode_address);
  }
  if (reason == "prefill" || reason == "kv_handoff") add_unique(avoid_prefill_, attempt_.placement.prefill_address);
  sink_->on_failover(reason, Status(cause.code(), who + ": " + for_client(cause.message())));
  abandon_attempt_locked(g);
  submit_attempt_locked(g);
}

void RequestPipeline::abandon_attempt_locked(Guard& g) {
  Attempt& a = attempt_;
  if (a.prefill != nullptr) a.prefill->cancel();
  if (a.decode != nullptr) a.decode->cancel();
  a.prefill = nullptr;
  a.decode = nullptr;
  // The decode worker frees the blocks itself when the sequence ends normally; otherwise
  // release the reservation (harmless when a cancelled stream already freed it).
  if (a.admitted && !a.decode_done) deps_.client->release(a.placement.decode_address, a.id);
  if (a.handed_to_scheduler) g.after([s = deps_.scheduler, id = a.id] { s->finished(id); });
  a.handed_to_scheduler = false;
  // A leader whose KV was not placed: its followers go alone (told after finished() above has
  // released the leader's count of them, so they are not counted twice).
  publish_locked(g, std::nullopt);
}

void RequestPipeline::end_locked(Guard& g, const Status& status) {
  if (state_ == PipelineState::kEnded) return;
  abandon_attempt_locked(g);
  state_ = PipelineState::kEnded;
  const TimePoint now = deps_.clock->now();
  PipelineOutcome o;
  o.finish_reason = status.ok() ? (finish_reason_.empty() ? "stop" : finish_reason_) : "";
  o.n_prompt_tokens = static_cast<int32_t>(req_.prompt_ids.size());
  o.n_generated = static_cast<int32_t>(emitted_.size());
  o.queue_seconds = queue_s_;
  o.prefill_seconds = prefill_s_;
  o.cached_prompt_tokens = cached_prompt_tokens_;
  o.kv_transfer_seconds = kv_transfer_s_;
  o.decode_queue_seconds = decode_queue_s_;
  o.ttft_seconds = have_first_token_ ? since_arrival(first_token_at_) : 0;
  o.e2e_seconds = since_arrival(now);
  o.failovers = static_cast<int32_t>(history_.size());
  o.failover_history = history_;
  o.prefill_address = attempt_.placement.prefill_address;
  o.decode_address = attempt_.placement.decode_address;
  std::shared_ptr<ResponseSink> sink = std::move(sink_);
  // Everything a status says reaches the client: the request by its label, workers by role.
  sink->on_end(status.ok() ? status : status.with_message(for_client(status.message())), o);
}

}  // namespace baton
