#include "scheduler/scheduler.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace baton {

namespace {

std::string seconds_string(std::chrono::nanoseconds d) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f s", std::chrono::duration<double>(d).count());
  return buf;
}

// KV positions the largest reported decode worker holds (0 when none has reported).
int64_t largest_decode_capacity(const std::vector<WorkerSnapshot>& decode) {
  int64_t best = 0;
  for (const auto& w : decode) {
    if (w.has_report) best = std::max(best, w.load.total_blocks * w.load.block_size);
  }
  return best;
}

}  // namespace

const char* slo_rejection_name(SloRejection reason) {
  switch (reason) {
    case SloRejection::kPrefillQueue: return "prefill_queue";
    case SloRejection::kDecodeKv: return "decode_kv";
  }
  return "unknown";
}

Status SchedulerConfig::validate() const {
  if (max_requests < 1) return invalid_argument("max_requests must be >= 1, got " + std::to_string(max_requests));
  if (max_queued_prompt_tokens < 1) {
    return invalid_argument("max_queued_prompt_tokens must be >= 1, got " + std::to_string(max_queued_prompt_tokens));
  }
  if (max_head_bypass.count() < 0) return invalid_argument("max_head_bypass must be >= 0");
  if (no_worker_timeout.count() <= 0) return invalid_argument("no_worker_timeout must be > 0");
  if (local_prefill_max_tokens < 0) return invalid_argument("local_prefill_max_tokens must be >= 0");
  if (!(prefill_queue_weight >= 0) || !std::isfinite(prefill_queue_weight)) {
    return invalid_argument("prefill_queue_weight must be a finite number >= 0");
  }
  if (!(ttft_slo_seconds >= 0) || !std::isfinite(ttft_slo_seconds)) {
    return invalid_argument("ttft_slo_seconds must be a finite number >= 0 (0: none)");
  }
  if (!(slo_hold_fraction > 0 && slo_hold_fraction <= 1)) return invalid_argument("slo_hold_fraction must be in (0, 1]");
  if (!(local_prefill_itl_weight >= 0) || !std::isfinite(local_prefill_itl_weight)) {
    return invalid_argument("local_prefill_itl_weight must be a finite number >= 0");
  }
  return {};
}

bool Scheduler::QueueKey::operator<(const QueueKey& o) const {
  if (priority != o.priority) return priority > o.priority;
  if (arrival != o.arrival) return arrival < o.arrival;
  return seq < o.seq;
}

Scheduler::Scheduler(SchedulerConfig config, WorkerRegistry& registry, const Clock& clock)
    : config_(config),
      registry_(registry),
      clock_(clock),
      decode_policy_(std::make_unique<DecodePlacement>()),
      prefill_policy_(nullptr) {
  const Status s = config_.validate();
  BATON_CHECK(s.ok(), "SchedulerConfig: %s", s.to_string().c_str());
  prefill_policy_ = std::make_unique<PrefillPlacement>(config_.prefill_queue_weight);
}

bool Scheduler::local_on(const PendingRequest& req, const WorkerSnapshot& d) const {
  return req.n_prompt_tokens <= config_.local_prefill_max_tokens && req.n_prompt_tokens <= d.load.local_prefill_max_tokens;
}

bool Scheduler::needs_prefill_worker(const PendingRequest& req, const std::vector<WorkerSnapshot>& decode,
                                     bool or_unreported) const {
  if (req.n_prompt_tokens > config_.local_prefill_max_tokens) return true;
  for (const auto& d : decode) {
    if ((d.can_place() && local_on(req, d)) || (or_unreported && !d.has_report)) return false;
  }
  return true;
}

Status Scheduler::check_servable(const PendingRequest& req, const std::vector<WorkerSnapshot>& decode,
                                 const std::vector<WorkerSnapshot>& prefill) const {
  if (decode.empty()) {
    return unavailable("no decode worker addresses are known (check the decode worker flag or its DNS name)");
  }
  // A decode worker that has not reported yet may turn out to prefill locally: wait for it.
  if (prefill.empty() && needs_prefill_worker(req, decode, /*or_unreported=*/true)) {
    return unavailable("no prefill worker addresses are known (check the prefill worker flag or its DNS name)");
  }
  // Until some decode worker has reported, its size is unknown: the request waits.
  const int64_t capacity = largest_decode_capacity(decode);
  if (capacity > 0 && req.n_total_tokens > capacity) {
    return invalid_argument("request " + req.id + " needs " + std::to_string(req.n_total_tokens) +
                            " KV positions (prompt " + std::to_string(req.n_prompt_tokens) + " + max new tokens " +
                            std::to_string(req.n_total_tokens - req.n_prompt_tokens) +
                            ") but the largest decode worker holds " + std::to_string(capacity) +
                            "; shorten the prompt or lower max_tokens");
  }
  return {};
}

Status Scheduler::submit(PendingRequest req, PlacedFn on_placed, FailedFn on_failed) {
  BATON_CHECK(on_placed && on_failed, "Scheduler::submit of %s without both callbacks", req.id.c_str());
  if (req.id.empty()) return invalid_argument("request id is empty");
  if (req.n_prompt_tokens <= 0) return invalid_argument("request " + req.id + " has an empty prompt");
  if (req.tokens && static_cast<int64_t>(req.tokens->size()) != req.n_prompt_tokens) {
    return invalid_argument("request " + req.id + " has " + std::to_string(req.tokens->size()) +
                            " tokens for n_prompt_tokens " + std::to_string(req.n_prompt_tokens));
  }
  if (req.n_total_tokens < req.n_prompt_tokens) {
    return invalid_argument("request " + req.id + ": n_total_tokens " + std::to_string(req.n_total_tokens) +
                            " < n_prompt_tokens " + std::to_string(req.n_prompt_tokens));
  }
  if (req.n_prompt_tokens > config_.max_queued_prompt_tokens) {
    return invalid_argument("prompt of " + std::to_string(req.n_prompt_tokens) +
                            " tokens is longer than the admission bound max_queued_prompt_tokens = " +
                            std::to_string(config_.max_queued_prompt_tokens) +
                            "; shorten the prompt (or raise the bound)");
  }
  // Snapshots before our lock: the registry never calls us, and a snapshot a moment old is as
  // good as one taken under the lock (workers change independently of us anyway).
  const auto decode = registry_.snapshot(WorkerRole::kDecode);
  const auto prefill = registry_.snapshot(WorkerRole::kPrefill);
  BATON_RETURN_IF_ERROR(check_servable(req, decode, prefill));
  const TimePoint now = clock_.now();
  if (req.deadline.has_value() && *req.deadline <= now) {
    return deadline_exceeded("request " + req.id + " arrived after its deadline");
  }

  Actions actions;
  {
    std::unique_lock lock(mu_);
    if (requests_.count(req.id) != 0) return invalid_argument("request id " + req.id + " is already in use");
    const int64_t weight = 1 + std::max(req.n_followers, 0);
    if (weight > config_.max_requests) {
      return invalid_argument("request " + req.id + " asks for " + std::to_string(weight) +
                              " choices; the server admits at most " + std::to_string(config_.max_requests) +
                              " requests and choices at once (--max-requests)");
    }
    // A refused fork's count moves from its leader (PendingRequest::counted_by).
    Entry* leader = nullptr;
    if (!req.counted_by.empty()) {
      auto l = requests_.find(req.counted_by);
      if (l != requests_.end() && l->second.req.n_followers > 0) leader = &l->second;
    }
    if (leader == nullptr && admitted_weight_ + weight > config_.max_requests) {
      return resource_exhausted("server is at its request bound: " + std::to_string(admitted_weight_) +
                                " requests and choices in flight" +
                                (weight > 1 ? " + this request's " + std::to_string(weight) + " choices" : std::string()) +
                                " (max_requests = " + std::to_string(config_.max_requests) + "); retry with backoff");
    }
    if (queued_prompt_tokens_ + req.n_prompt_tokens > config_.max_queued_prompt_tokens) {
      return resource_exhausted("server is at its queued prompt token bound: " + std::to_string(queued_prompt_tokens_) +
                                " queued + " + std::to_string(req.n_prompt_tokens) + " > max_queued_prompt_tokens = " +
                                std::to_string(config_.max_queued_prompt_tokens) + "; retry with backoff");
    }
    std::optional<TtftForecast> predicted;
    std::optional<SloRejection> rejected;
    if (Status s = admit_to_slo_locked(req, decode, prefill, now, &predicted, &rejected); !s.ok()) {
      lock.unlock();
      if (rejected && events_.slo_rejected) events_.slo_rejected(*rejected);
      return s;
    }
    Entry e;
    e.predicted = predicted;
    e.seq = next_seq_++;
    e.queued_at = now;
    e.on_placed = std::move(on_placed);
    e.on_failed = std::move(on_failed);
    queued_prompt_tokens_ += req.n_prompt_tokens;
    if (leader != nullptr) {
      --leader->req.n_followers;
    } else {
      admitted_weight_ += weight;
    }
    e.req = std::move(req);
    queue_.insert(key_of(e));
    const std::string id = e.req.id;
    requests_.emplace(id, std::move(e));
    fail_unservable_locked(now, actions);
    place_locked(now, actions);
  }
  run(actions);
  return {};
}

void Scheduler::poll() {
  Actions actions;
  {
    std::lock_guard lock(mu_);
    const TimePoint now = clock_.now();
    fail_unservable_locked(now, actions);
    place_locked(now, actions);
  }
  run(actions);
}

void Scheduler::decode_admitted(const std::string& id) {
  std::lock_guard lock(mu_);
  auto it = requests_.find(id);
  if (it == requests_.end() || !it->second.placed) return;
  registry_.confirm_decode(it->second.placement.decode_address, id);
}

void Scheduler::prefill_done(const std::string& id) {
  Actions actions;
  {
    std::lock_guard lock(mu_);
    auto it = requests_.find(id);
    if (it == requests_.end() || !it->second.prefill_outstanding) return;
    Entry& e = it->second;
    if (e.local_tokens > 0) {
      local_outstanding_[e.placement.decode_address] -= e.local_tokens;
      e.local_tokens = 0;
    } else {
      registry_.remove_prefill_tokens(e.placement.prefill_address, id);
      registry_.confirm_prefill_prefix(e.placement.prefill_address, id);  // its blocks are cached now
    }
    e.prefill_outstanding = false;
    // A worker holding less may be handed the next prompt (a TTFT target holds them back).
    place_locked(clock_.now(), actions);
  }
  run(actions);
}

void Scheduler::first_token(const std::string& id, double prefill_seconds, int64_t cached_tokens) {
  std::optional<std::pair<double, double>> sample;  // predicted, seen
  {
    std::lock_guard lock(mu_);
    auto it = requests_.find(id);
    if (it == requests_.end() || !it->second.placed || !it->second.prefill_outstanding) return;
    const Entry& e = it->second;
    const std::string& where =
        e.placement.prefill_address.empty() ? e.placement.decode_address : e.placement.prefill_address;
    predictor_.observe(where, e.req.n_prompt_tokens - cached_tokens, prefill_seconds);
    if (e.predicted) {
      const TtftForecast& f = *e.predicted;
      const double seen = std::chrono::duration<double>(clock_.now() - e.req.arrival).count();
      sample.emplace(f.seconds, seen);
      if (f.seconds > 0) {
        seen_over_predicted_.push_back(seen / f.seconds);
        if (seen_over_predicted_.size() > kErrorSamples) seen_over_predicted_.pop_front();
      }
      spdlog::debug(
          "ttft req={}: predicted {:.3f} s (admitted after {:.3f} + decode KV {:.3f} + {} tokens ahead {:.3f} + "
          "{} of its own at {:.0f}/s {:.3f}{}), seen {:.3f} s ({} of {} computed in {:.3f} s on {})",
          id, f.seconds, f.elapsed, f.decode_wait, f.site.tokens_ahead, f.site.wait_seconds, f.n_compute, f.site.rate,
          f.site.compute_seconds, f.local ? ", locally" : "", seen, e.req.n_prompt_tokens - cached_tokens,
          e.req.n_prompt_tokens, prefill_seconds, where);
    }
  }
  if (sample && events_.ttft) events_.ttft(sample->first, sample->second);
  prefill_done(id);
}

void Scheduler::finished(const std::string& id) {
  cancel(id);
}

void Scheduler::cancel(const std::string& id) {
  Actions actions;
  {
    std::lock_guard lock(mu_);
    auto it = requests_.find(id);
    if (it == requests_.end()) return;
    if (it->second.placed) {
      release_placed_locked(id, clock_.now());
    } else {
      fail_queued_locked(id, cancelled("request " + id + " was cancelled while queued"), actions);
    }
    const TimePoint now = clock_.now();
    fail_unservable_locked(now, actions);
    place_locked(now, actions);
  }
  run(actions);
}

int32_t Scheduler::n_queued() const {
  std::lock_guard lock(mu_);
  return static_cast<int32_t>(queue_.size());
}

int32_t Scheduler::n_admitted() const {
  std::lock_guard lock(mu_);
  return static_cast<int32_t>(admitted_weight_);
}

int64_t Scheduler::queued_prompt_tokens() const {
  std::lock_guard lock(mu_);
  return queued_prompt_tokens_;
}

void Scheduler::fail_unservable_locked(TimePoint now, Actions& actions) {
  if (queue_.empty()) return;
  const auto decode = registry_.snapshot(WorkerRole::kDecode);
  const auto prefill = registry_.snapshot(WorkerRole::kPrefill);
  std::vector<std::pair<std::string, Status>> failures;
  for (const QueueKey& k : queue_) {
    const PendingRequest& req = requests_.at(k.id).req;
    if (req.deadline.has_value() && *req.deadline <= now) {
      failures.emplace_back(
          k.id,
          deadline_exceeded("request " + k.id + " missed its deadline after " + seconds_string(now - req.arrival) +
                            " in the queue: no healthy worker pair could take it (it needs " +
                            std::to_string(req.n_total_tokens) + " KV positions on one decode worker)"));
      continue;
    }
    Status s = check_servable(req, decode, prefill);
    if (!s.ok()) {
      failures.emplace_back(k.id, std::move(s));
      continue;
    }
    const bool no_decode = !any_placeable(decode);
    const bool no_prefill = !any_placeable(prefill) && needs_prefill_worker(req, decode, /*or_unreported=*/false);
    const auto waited = now - requests_.at(k.id).queued_at;
    if ((no_decode || no_prefill) && waited >= config_.no_worker_timeout) {
      failures.emplace_back(k.id, unavailable(std::string("no healthy ") + (no_decode ? "decode" : "prefill") +
                                              " worker for " + seconds_string(waited) +
                                              " (none answers its load poll, or all are draining); retry later"));
    }
  }
  for (auto& [id, status] : failures) fail_queued_locked(id, std::move(status), actions);
}

void Scheduler::place_locked(TimePoint now, Actions& actions) {
  if (queue_.empty()) return;
  auto decode = registry_.snapshot(WorkerRole::kDecode);
  auto prefill = registry_.snapshot(WorkerRole::kPrefill);
  bool head_seen = false;  // the first request in order that could not be placed
  for (auto it = queue_.begin(); it != queue_.end();) {
    Entry& e = requests_.at(it->id);
    const PlacementRequest q = e.req.placement();
    const WorkerSnapshot* w = nullptr;
    if (auto d = pick_avoiding(*decode_policy_, decode, e.req.avoid_decode, q)) {
      w = find_worker(decode, *d);
      BATON_CHECK(w != nullptr, "decode policy picked %s, which is not in the snapshot", d->c_str());
    }
    std::optional<PrefillSite> site;
    if (w != nullptr) site = choose_prefill_locked(e, *w, decode, prefill, now);
    bool placed = false;
    if (site.has_value()) {
      const std::string d = w->address;
      const int64_t blocks = blocks_for(e.req.n_total_tokens, w->load.block_size);
      const std::string p = site->local ? std::string() : site->worker->address;
      // Either may fail when an address update dropped the worker since the snapshot.
      if (registry_.reserve_decode(d, e.req.id, blocks)) {
        if (site->local || registry_.add_prefill_tokens(p, e.req.id, site->n_compute)) {
          if (site->prefix) registry_.add_prefill_prefix(p, e.req.id, site->prefix);
          if (site->local) {
            e.local_tokens = e.req.n_prompt_tokens;
            local_outstanding_[d] += e.local_tokens;
          } else {
            recent_log_locked(sent_, p, now).emplace_back(now, site->n_compute);
          }
          placed = true;
          e.placed = true;
          e.prefill_outstanding = true;
          e.placement = Placement{e.req.id, p, d, blocks};
          queued_prompt_tokens_ -= e.req.n_prompt_tokens;
          actions.push_back([fn = std::move(e.on_placed), placement = e.placement] { fn(placement); });
          e.on_placed = nullptr;
          e.on_failed = nullptr;  // resolved: on_failed will never run
        } else {
          registry_.release_decode(d, e.req.id);
        }
      }
      // The registry changed (or a worker vanished): later requests must see the new numbers.
      decode = registry_.snapshot(WorkerRole::kDecode);
      prefill = registry_.snapshot(WorkerRole::kPrefill);
    }
    if (placed) {
      it = queue_.erase(it);
      continue;
    }
    if (!head_seen) {
      head_seen = true;
      // Past its bypass allowance the head holds everything behind it (see scheduler.h).
      if (now - e.req.arrival >= config_.max_head_bypass) break;
    }
    ++it;
  }
}

void Scheduler::fail_queued_locked(const std::string& id, Status status, Actions& actions) {
  auto it = requests_.find(id);
  BATON_CHECK(it != requests_.end() && !it->second.placed, "fail_queued_locked(%s): not queued", id.c_str());
  Entry& e = it->second;
  queue_.erase(key_of(e));
  queued_prompt_tokens_ -= e.req.n_prompt_tokens;
  actions.push_back([fn = std::move(e.on_failed), status = std::move(status)] { fn(status); });
  admitted_weight_ -= 1 + std::max(e.req.n_followers, 0);
  requests_.erase(it);
}

void Scheduler::release_placed_locked(const std::string& id, TimePoint now) {
  auto it = requests_.find(id);
  BATON_CHECK(it != requests_.end() && it->second.placed, "release_placed_locked(%s): not placed", id.c_str());
  const Entry& e = it->second;
  registry_.release_decode(e.placement.decode_address, id);
  recent_log_locked(released_, e.placement.decode_address, now).emplace_back(now, e.placement.decode_blocks);
  if (e.local_tokens > 0) {
    local_outstanding_[e.placement.decode_address] -= e.local_tokens;
  } else if (e.prefill_outstanding) {
    registry_.remove_prefill_tokens(e.placement.prefill_address, id);
    registry_.remove_prefill_prefix(e.placement.prefill_address, id);
  }
  admitted_weight_ -= 1 + std::max(e.req.n_followers, 0);
  requests_.erase(it);
}

void Scheduler::run(Actions& actions) {
  for (auto& a : actions) a();
  actions.clear();
}

}  // namespace baton
