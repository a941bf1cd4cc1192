#include "scheduler/scheduler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace baton {

namespace {

std::string seconds_string(std::chrono::nanoseconds d) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f s", std::chrono::duration<double>(d).count());
  return buf;
}

// `workers` without those in `avoid`.
std::vector<WorkerSnapshot> without(const std::vector<WorkerSnapshot>& workers, const std::vector<std::string>& avoid) {
  std::vector<WorkerSnapshot> out;
  for (const auto& w : workers) {
    if (std::find(avoid.begin(), avoid.end(), w.address) == avoid.end()) out.push_back(w);
  }
  return out;
}

// KV positions the largest reported decode worker holds (0 when none has reported).
int64_t largest_decode_capacity(const std::vector<WorkerSnapshot>& decode) {
  int64_t best = 0;
  for (const auto& w : decode) {
    if (w.has_report) best = std::max(best, w.load.total_blocks * w.load.block_size);
  }
  return best;
}

// The worker `policy` picks for `q`, passing over those in `avoid` while another fits.
std::optional<std::string> pick_avoiding(const PlacementPolicy& policy, const std::vector<WorkerSnapshot>& workers,
                                         const std::vector<std::string>& avoid, const PlacementRequest& q) {
  if (!avoid.empty()) {
    if (auto other = policy.pick(without(workers, avoid), q)) return other;
  }
  return policy.pick(workers, q);
}

const WorkerSnapshot* find_worker(const std::vector<WorkerSnapshot>& workers, const std::string& address) {
  const auto it =
      std::find_if(workers.begin(), workers.end(), [&](const WorkerSnapshot& w) { return w.address == address; });
  return it == workers.end() ? nullptr : &*it;
}

PlacementRequest placement_request(const PendingRequest& req) {
  std::span<const int32_t> tokens;
  if (req.tokens) tokens = *req.tokens;
  return {req.n_prompt_tokens, req.n_total_tokens, tokens};
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

// Seconds to 3 significant digits: "1.13 s", "0.005 s", "20 s".
std::string secs_string(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.3g s", v);
  return buf;
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
    if (static_cast<int64_t>(requests_.size()) >= config_.max_requests) {
      return resource_exhausted("server is at its request bound: " + std::to_string(requests_.size()) +
                                " requests in flight (max_requests = " + std::to_string(config_.max_requests) +
                                "); retry with backoff");
    }
    if (queued_prompt_tokens_ + req.n_prompt_tokens > config_.max_queued_prompt_tokens) {
      return resource_exhausted("server is at its queued prompt token bound: " + std::to_string(queued_prompt_tokens_) +
                                " queued + " + std::to_string(req.n_prompt_tokens) + " > max_queued_prompt_tokens = " +
                                std::to_string(config_.max_queued_prompt_tokens) + "; retry with backoff");
    }
    std::optional<double> predicted;
    std::optional<SloRejection> rejected;
    if (Status s = admit_to_slo_locked(req, decode, prefill, now, &predicted, &rejected); !s.ok()) {
      lock.unlock();
      if (rejected && events_.slo_rejected) events_.slo_rejected(*rejected);
      return s;
    }
    Entry e;
    e.predicted_ttft = predicted;
    e.seq = next_seq_++;
    e.queued_at = now;
    e.on_placed = std::move(on_placed);
    e.on_failed = std::move(on_failed);
    queued_prompt_tokens_ += req.n_prompt_tokens;
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
    if (e.predicted_ttft) {
      sample.emplace(*e.predicted_ttft, std::chrono::duration<double>(clock_.now() - e.req.arrival).count());
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
  return static_cast<int32_t>(requests_.size());
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
    const PlacementRequest q = placement_request(e.req);
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
  requests_.erase(it);
}

void Scheduler::release_placed_locked(const std::string& id, TimePoint now) {
  auto it = requests_.find(id);
  BATON_CHECK(it != requests_.end() && it->second.placed, "release_placed_locked(%s): not placed", id.c_str());
  const Entry& e = it->second;
  registry_.release_decode(e.placement.decode_address, id);
  released_log_locked(e.placement.decode_address, now).emplace_back(now, e.placement.decode_blocks);
  if (e.local_tokens > 0) {
    local_outstanding_[e.placement.decode_address] -= e.local_tokens;
  } else if (e.prefill_outstanding) {
    registry_.remove_prefill_tokens(e.placement.prefill_address, id);
    registry_.remove_prefill_prefix(e.placement.prefill_address, id);
  }
  requests_.erase(it);
}

std::deque<std::pair<TimePoint, int64_t>>& Scheduler::released_log_locked(const std::string& decode_address,
                                                                            TimePoint now) {
  auto& log = released_[decode_address];
  while (!log.empty() && now - log.front().first > kReleaseWindow) log.pop_front();
  return log;
}

double Scheduler::slo_of(const PendingRequest& req) const {
  const double server = config_.ttft_slo_seconds;
  const double own = req.ttft_slo_seconds;
  if (server > 0 && own > 0) return std::min(server, own);
  return std::max(server, own);
}

double Scheduler::prior_rate(const std::vector<WorkerSnapshot>& decode, const std::vector<WorkerSnapshot>& prefill,
                             int64_t n_prompt_tokens) const {
  double prior = 0;
  for (const auto* workers : {&decode, &prefill}) {
    for (const auto& o : *workers) prior = std::max(prior, predictor_.rate(o, n_prompt_tokens));
  }
  return prior;
}

Scheduler::PrefillSite Scheduler::site_locked(const PendingRequest& req, const WorkerSnapshot& w, bool local,
                                              int64_t extra_ahead, double prior) const {
  PrefillSite site;
  site.worker = &w;
  site.local = local;
  site.n_compute = req.n_prompt_tokens;
  TtftPredictor::Ahead ahead;
  ahead.report_age_seconds = std::chrono::duration<double>(clock_.now() - w.last_report_at).count();
  ahead.other = extra_ahead;
  if (local) {
    // Local prompts placed here are counted until their first token, the report's only as reported.
    const auto it = local_outstanding_.find(w.address);
    const int64_t placed = it == local_outstanding_.end() ? 0 : it->second;
    ahead.reported = std::max<int64_t>(w.load.queued_prompt_tokens - placed, 0);
    ahead.other += placed;
  } else {
    std::span<const int32_t> tokens;
    if (req.tokens) tokens = *req.tokens;
    auto hashes = prefix_routing_hashes(w, tokens);
    site.n_compute -= expected_cached_tokens(w, tokens, &hashes);
    if (!hashes.empty()) site.prefix = std::make_shared<const std::vector<uint64_t>>(std::move(hashes));
    ahead.reported = w.load.queued_prompt_tokens;
    ahead.other += w.unreported_prompt_tokens;
  }
  site.ttft = predictor_.predict(w, site.n_compute, ahead, prior);
  return site;
}

double Scheduler::decode_wait_locked(const PendingRequest& req, const std::vector<WorkerSnapshot>& decode,
                                     int64_t tokens_ahead, TimePoint now) {
  double best = std::numeric_limits<double>::infinity();
  bool any = false;
  for (const auto& d : decode) {
    if (!d.can_place() || d.load.block_size <= 0) continue;
    any = true;
    const int64_t shortfall = blocks_for(req.n_total_tokens + tokens_ahead, d.load.block_size) - d.available_blocks();
    if (shortfall <= 0) return 0;
    int64_t freed = 0;
    for (const auto& r : released_log_locked(d.address, now)) freed += r.second;
    if (freed > 0) {
      const double rate = static_cast<double>(freed) / std::chrono::duration<double>(kReleaseWindow).count();
      best = std::min(best, static_cast<double>(shortfall) / rate);
    }
  }
  return any ? best : 0;  // no decode worker placeable: the queue's own rules apply
}

Status Scheduler::admit_to_slo_locked(const PendingRequest& req, const std::vector<WorkerSnapshot>& decode,
                                      const std::vector<WorkerSnapshot>& prefill, TimePoint now,
                                      std::optional<double>* predicted, std::optional<SloRejection>* rejected) {
  // The queued requests that will be placed before this one: same or higher priority, earlier.
  const QueueKey key{req.priority, req.arrival, next_seq_, req.id};
  int64_t prompt_ahead = 0, total_ahead = 0;
  for (const QueueKey& k : queue_) {
    if (!(k < key)) break;
    const PendingRequest& r = requests_.at(k.id).req;
    prompt_ahead += r.n_prompt_tokens;
    total_ahead += r.n_total_tokens;
  }
  // Every placement the prefill rule allows (the static rule: local where allowed, else prefill
  // workers; adaptive: both).
  std::vector<const WorkerSnapshot*> local, remote;
  for (const auto& d : decode) {
    if (d.can_place() && local_on(req, d)) local.push_back(&d);
  }
  if (config_.prefill_choice == PrefillChoice::kAdaptive || local.empty()) {
    for (const auto& p : prefill) {
      if (p.can_place()) remote.push_back(&p);
    }
  }
  const size_t n_sites = local.size() + remote.size();
  if (n_sites == 0) return {};  // nothing to place on: the queue's own rules apply
  // The prompts queued here ahead spread over the placements.
  const int64_t extra = prompt_ahead / static_cast<int64_t>(n_sites);
  const double prior = prior_rate(decode, prefill, req.n_prompt_tokens);
  std::optional<PrefillSite> best, best_remote;
  for (const WorkerSnapshot* w : remote) {
    PrefillSite site = site_locked(req, *w, /*local=*/false, extra, prior);
    if (site.ttft && (!best_remote || site.ttft->seconds() < best_remote->ttft->seconds())) best_remote = site;
  }
  best = best_remote;
  for (const WorkerSnapshot* w : local) {
    PrefillSite site = site_locked(req, *w, /*local=*/true, extra, prior);
    if (!site.ttft) continue;
    // Adaptive: a decode worker counts only where the choice could take it (worth its cost).
    if (config_.prefill_choice == PrefillChoice::kAdaptive && best_remote &&
        !local_worth_it(*w, *site.ttft, *best_remote->ttft)) {
      continue;
    }
    if (!best || site.ttft->seconds() < best->ttft->seconds()) best = std::move(site);
  }
  if (!best) return {};  // no rate measured yet: nothing to predict by
  const double elapsed = std::chrono::duration<double>(now - req.arrival).count();
  const double decode_wait = decode_wait_locked(req, decode, total_ahead, now);
  const double ttft = elapsed + decode_wait + best->ttft->seconds();
  if (std::isfinite(ttft)) *predicted = ttft;
  const double slo = slo_of(req);
  if (slo <= 0 || ttft <= slo) return {};
  // The decode side when waiting for its blocks alone misses the target; else the prefill queue.
  const bool decode_side = decode_wait > 0 && elapsed + decode_wait > slo;
  *rejected = decode_side ? SloRejection::kDecodeKv : SloRejection::kPrefillQueue;
  std::string why;
  if (decode_side) {
    why = std::isfinite(decode_wait)
              ? "decode KV: no decode worker has room for its " + std::to_string(req.n_total_tokens) +
                    " KV positions for about " + secs_string(decode_wait) + " at the rate blocks were freed recently"
              : "decode KV: no decode worker has room for its " + std::to_string(req.n_total_tokens) +
                    " KV positions and none freed blocks recently";
  } else {
    const TtftPrediction& p = *best->ttft;
    why = "prefill queue: the soonest is " + std::string(best->local ? "a decode worker prefilling itself" : "a prefill worker") +
          " with " + std::to_string(p.tokens_ahead) + " prompt tokens ahead (" + secs_string(p.wait_seconds) +
          ") and " + std::to_string(best->n_compute) + " of its own at " + fixed(p.rate, 0) + " tokens/s (" +
          secs_string(p.compute_seconds) + ")";
  }
  const double over = std::isfinite(ttft) ? ttft - slo : std::chrono::duration<double>(kReleaseWindow).count();
  const auto retry = static_cast<int32_t>(std::clamp(std::ceil(over), 1.0, 3600.0));
  Status s = resource_exhausted("predicted time to first token " + (std::isfinite(ttft) ? secs_string(ttft) : std::string("unbounded")) +
                                " misses the TTFT target of " + secs_string(slo) + " on every placement; " + why +
                                "; retry after " + std::to_string(retry) + " s");
  s.set_retry_after_seconds(retry);
  return s;
}

bool Scheduler::may_hand_over(const PendingRequest& req, const PrefillSite& site) const {
  const double slo = slo_of(req);
  if (slo <= 0 || !site.ttft || site.ttft->tokens_ahead == 0) return true;
  return site.ttft->wait_seconds < config_.slo_hold_fraction * slo;
}

std::optional<Scheduler::PrefillSite> Scheduler::choose_prefill_locked(const Entry& e, const WorkerSnapshot& d,
                                                                       const std::vector<WorkerSnapshot>& decode,
                                                                       const std::vector<WorkerSnapshot>& prefill,
                                                                       TimePoint now) const {
  const PendingRequest& req = e.req;
  const bool adaptive = config_.prefill_choice == PrefillChoice::kAdaptive;
  const double prior = prior_rate(decode, prefill, req.n_prompt_tokens);
  std::optional<PrefillSite> local, remote;
  if (local_on(req, d)) local = site_locked(req, d, /*local=*/true, 0, prior);
  if (!local || adaptive) {
    if (auto p = pick_avoiding(*prefill_policy_, prefill, req.avoid_prefill, placement_request(req))) {
      const WorkerSnapshot* pw = find_worker(prefill, *p);
      BATON_CHECK(pw != nullptr, "prefill policy picked %s, which is not in the snapshot", p->c_str());
      remote = site_locked(req, *pw, /*local=*/false, 0, prior);
    }
  }
  std::optional<PrefillSite>* first = local ? &local : &remote;  // the static rule's
  std::optional<PrefillSite>* second = local ? &remote : &local;
  if (adaptive && local && remote) {
    const auto& l = local->ttft;
    const auto& r = remote->ttft;
    bool prefer_local = false;  // nothing measured yet: disaggregated
    if (l && r) {
      const bool worth_it = local_worth_it(d, *l, *r);
      const double slo = slo_of(req);
      const double elapsed = std::chrono::duration<double>(now - req.arrival).count();
      // With a target, only to meet it: the prefill worker while it is predicted to.
      prefer_local = worth_it && (slo <= 0 || (elapsed + r->seconds() > slo && elapsed + l->seconds() <= slo));
    } else if (l || r) {
      prefer_local = l.has_value();
    }
    first = prefer_local ? &local : &remote;
    second = prefer_local ? &remote : &local;
  }
  if (*first && may_hand_over(req, **first)) return std::move(*first);
  // The first is held: the other, if it is one the rule could have chosen (the decode worker only
  // when worth its cost to the batch).
  if (adaptive && *second && may_hand_over(req, **second)) {
    const bool other_ok = !(*second)->local || !remote || !remote->ttft || !local->ttft ||
                          local_worth_it(d, *local->ttft, *remote->ttft);
    if (other_ok) return std::move(*second);
  }
  return std::nullopt;
}

bool Scheduler::local_worth_it(const WorkerSnapshot& d, const TtftPrediction& local,
                               const TtftPrediction& remote) const {
  // The TTFT local prefill saves against the time it adds to the decode batch: each running
  // sequence waits for its compute.
  const int64_t n_running = d.load.n_running + d.n_unreported_requests;
  const double cost = config_.local_prefill_itl_weight * static_cast<double>(n_running) * local.compute_seconds;
  return remote.seconds() - local.seconds() > cost;
}

void Scheduler::run(Actions& actions) {
  for (auto& a : actions) a();
  actions.clear();
}

}  // namespace baton
