// The scheduler's predictions (scheduler.h, "Admission to a TTFT target"): the TTFT of each place
// a prompt could be prefilled, the wait for a decode worker's KV blocks, admission to a TTFT
// target on them, and the per-request choice between a prefill worker and local prefill. Members
// of Scheduler, called under its lock from submit() and place_locked() (scheduler.cpp).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "scheduler/scheduler.h"

namespace baton {

namespace {

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

Scheduler::RecentLog& Scheduler::recent_log_locked(std::unordered_map<std::string, RecentLog>& logs,
                                                  const std::string& address, TimePoint now) {
  auto& log = logs[address];
  while (!log.empty() && now - log.front().first > kReleaseWindow) log.pop_front();
  return log;
}

double Scheduler::sent_rate_locked(const std::string& address, TimePoint now) const {
  const auto it = sent_.find(address);
  if (it == sent_.end()) return 0;
  int64_t tokens = 0;
  for (const auto& [when, n] : it->second) {
    if (now - when <= kReleaseWindow) tokens += n;
  }
  return static_cast<double>(tokens) / std::chrono::duration<double>(kReleaseWindow).count();
}

std::vector<std::pair<double, int64_t>> Scheduler::sent_since_report_locked(const WorkerSnapshot& w,
                                                                             int64_t* rest) const {
  std::vector<std::pair<double, int64_t>> sent;
  int64_t left = std::max<int64_t>(w.unreported_prompt_tokens, 0);
  if (const auto it = sent_.find(w.address); it != sent_.end()) {
    for (auto e = it->second.rbegin(); e != it->second.rend() && e->second <= left; ++e) {
      left -= e->second;
      sent.emplace_back(std::max(0.0, std::chrono::duration<double>(e->first - w.last_report_at).count()), e->second);
    }
  }
  std::reverse(sent.begin(), sent.end());
  *rest = left;
  return sent;
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
    auto hashes = prefix_routing_hashes(w, tokens, req.cache_scope);
    site.n_compute -= expected_cached_tokens(w, tokens, &hashes);
    if (!hashes.empty()) site.prefix = std::make_shared<const std::vector<uint64_t>>(std::move(hashes));
    ahead.reported = w.load.queued_prompt_tokens;
    int64_t untimed = 0;
    ahead.sent = sent_since_report_locked(w, &untimed);
    ahead.other += untimed;
    ahead.arriving_tokens_per_second = sent_rate_locked(w.address, clock_.now());
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
    for (const auto& r : recent_log_locked(released_, d.address, now)) freed += r.second;
    if (freed > 0) {
      const double rate = static_cast<double>(freed) / std::chrono::duration<double>(kReleaseWindow).count();
      best = std::min(best, static_cast<double>(shortfall) / rate);
    }
  }
  return any ? best : 0;  // no decode worker placeable: the queue's own rules apply
}

Status Scheduler::admit_to_slo_locked(const PendingRequest& req, const std::vector<WorkerSnapshot>& decode,
                                      const std::vector<WorkerSnapshot>& prefill, TimePoint now,
                                      std::optional<TtftForecast>* predicted, std::optional<SloRejection>* rejected) {
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
  if (std::isfinite(ttft)) {
    *predicted = TtftForecast{ttft, elapsed, decode_wait, *best->ttft, best->local, best->n_compute};
  }
  const double slo = slo_of(req);
  const double margin = slo_margin_locked();
  if (slo <= 0 || ttft * margin <= slo) return {};
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
  const double over =
      std::isfinite(ttft) ? ttft * margin - slo : std::chrono::duration<double>(kReleaseWindow).count();
  const auto retry = static_cast<int32_t>(std::clamp(std::ceil(over), 1.0, 3600.0));
  const std::string with_margin =
      margin > 1 ? " (× " + fixed(margin, 2) + ", the p99 of the predictor's recent misses)" : std::string();
  Status s = resource_exhausted("predicted time to first token " + (std::isfinite(ttft) ? secs_string(ttft) : std::string("unbounded")) +
                                with_margin + " misses the TTFT target of " + secs_string(slo) + " on every placement; " + why +
                                "; retry after " + std::to_string(retry) + " s");
  s.set_retry_after_seconds(retry);
  return s;
}

double Scheduler::slo_margin_locked() const {
  if (seen_over_predicted_.size() < kMinErrorSamples) return 1;
  std::vector<double> r(seen_over_predicted_.begin(), seen_over_predicted_.end());
  const auto q = r.begin() + static_cast<std::ptrdiff_t>((r.size() - 1) * 99 / 100);
  std::nth_element(r.begin(), q, r.end());
  return std::clamp(*q, 1.0, 2.0);
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
    if (auto p = pick_avoiding(*prefill_policy_, prefill, req.avoid_prefill, req.placement())) {
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

}  // namespace baton
