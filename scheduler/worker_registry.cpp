#include "scheduler/worker_registry.h"

#include <algorithm>
#include <set>

namespace baton {

namespace {

size_t role_index(WorkerRole role) {
  return role == WorkerRole::kPrefill ? 0 : 1;
}

Status validate_load(WorkerRole role, const std::string& address, const WorkerLoad& l) {
  const auto bad = [&](const char* what) {
    return invalid_argument(std::string(worker_role_name(role)) + " worker " + address +
                            " sent a malformed load report: " + what);
  };
  if (l.free_blocks < 0 || l.total_blocks < 0) return bad("negative block count");
  if (l.free_blocks > l.total_blocks) return bad("more free blocks than blocks");
  if (l.queued_prompt_tokens < 0) return bad("negative queued prompt tokens");
  if (l.n_running < 0) return bad("negative running count");
  if (l.prefix_cache_blocks < 0) return bad("negative prefix cache size");
  // (NaN fails both comparisons: written so that it is refused too.)
  if (!(l.step_seconds >= 0 && l.step_seconds < 1e6)) return bad("step time negative, huge or not a number");
  if (!(l.prefill_tokens_per_second >= 0 && l.prefill_tokens_per_second < 1e12)) {
    return bad("prefill rate negative, huge or not a number");
  }
  if (l.step_token_budget < 0 || l.step_tokens_in_progress < 0) return bad("negative step tokens");
  if (!(l.step_fixed_seconds >= 0 && l.step_fixed_seconds < 1e6) ||
      !(l.step_seconds_per_token >= 0 && l.step_seconds_per_token < 1e6) ||
      !(l.step_elapsed_seconds >= 0 && l.step_elapsed_seconds < 1e9)) {
    return bad("step time fit or elapsed time negative, huge or not a number");
  }
  if (role == WorkerRole::kDecode && l.block_size <= 0) return bad("decode block_size <= 0");
  return {};
}

}  // namespace

const char* worker_role_name(WorkerRole role) {
  return role == WorkerRole::kPrefill ? "prefill" : "decode";
}

Status WorkerRegistryConfig::validate() const {
  if (unhealthy_after_failures < 1) {
    return invalid_argument("unhealthy_after_failures must be >= 1, got " + std::to_string(unhealthy_after_failures));
  }
  if (stale_after.count() <= 0) return invalid_argument("stale_after must be > 0");
  return {};
}

WorkerRegistry::WorkerRegistry(WorkerRegistryConfig config, const Clock& clock) : config_(config), clock_(clock) {
  const Status s = config_.validate();
  BATON_CHECK(s.ok(), "WorkerRegistryConfig: %s", s.to_string().c_str());
}

void WorkerRegistry::set_addresses(WorkerRole role, const std::vector<std::string>& addresses) {
  const std::set<std::string> wanted(addresses.begin(), addresses.end());
  std::lock_guard lock(mu_);
  auto& workers = workers_[role_index(role)];
  for (auto it = workers.begin(); it != workers.end();) {
    it = wanted.count(it->first) != 0 ? std::next(it) : workers.erase(it);
  }
  for (const auto& a : wanted) {
    if (!a.empty()) workers.try_emplace(a);
  }
}

std::vector<std::string> WorkerRegistry::addresses(WorkerRole role) const {
  std::lock_guard lock(mu_);
  std::vector<std::string> out;
  for (const auto& [address, w] : workers_[role_index(role)]) out.push_back(address);
  return out;
}

Status WorkerRegistry::report_load(WorkerRole role, const std::string& address, const WorkerLoad& load,
                                   TimePoint requested_at) {
  BATON_RETURN_IF_ERROR(validate_load(role, address, load));
  std::lock_guard lock(mu_);
  Worker* w = find_locked(role, address);
  if (w == nullptr) {
    return not_found(std::string("load report from ") + worker_role_name(role) + " worker " + address +
                     ", which is not registered (dropped by the last address update?)");
  }
  if (w->has_report && requested_at < w->requested_at) return {};  // answered out of order: stale
  w->has_report = true;
  w->load = load;
  w->requested_at = requested_at;
  w->last_report_at = clock_.now();
  // A report asked for before the worker was seen down says nothing about it now.
  if (!w->down_at.has_value() || requested_at > *w->down_at) {
    w->n_consecutive_failures = 0;
    w->down_at.reset();
  }
  // Drop what this report includes: everything the worker held before the report was requested.
  // Strictly before: at equal times the order is unknown, and keeping the adjustment is safe.
  for (auto it = w->unreported.begin(); it != w->unreported.end();) {
    if (it->second.confirmed_at.has_value() && *it->second.confirmed_at < requested_at) {
      w->n_unreported -= it->second.amount;
      it = w->unreported.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = w->sent_prefixes.begin(); it != w->sent_prefixes.end();) {
    const bool included = it->second.confirmed_at.has_value() && *it->second.confirmed_at < requested_at;
    it = included ? w->sent_prefixes.erase(it) : std::next(it);
  }
  return {};
}

void WorkerRegistry::report_failure(WorkerRole role, const std::string& address) {
  std::lock_guard lock(mu_);
  if (Worker* w = find_locked(role, address)) ++w->n_consecutive_failures;
}

bool any_placeable(const std::vector<WorkerSnapshot>& workers) {
  return std::any_of(workers.begin(), workers.end(), [](const WorkerSnapshot& w) { return w.can_place(); });
}

void WorkerRegistry::report_exhausted(const std::string& decode_address) {
  std::lock_guard lock(mu_);
  Worker* w = find_locked(WorkerRole::kDecode, decode_address);
  if (w == nullptr || !w->has_report) return;
  w->load.free_blocks = 0;
  w->requested_at = std::max(w->requested_at, clock_.now());  // older answers no longer count
}

void WorkerRegistry::report_down(WorkerRole role, const std::string& address) {
  std::lock_guard lock(mu_);
  if (Worker* w = find_locked(role, address)) {
    w->n_consecutive_failures = std::max(w->n_consecutive_failures, config_.unhealthy_after_failures);
    w->down_at = clock_.now();
  }
}

std::vector<WorkerSnapshot> WorkerRegistry::snapshot(WorkerRole role) const {
  const TimePoint now = clock_.now();
  std::lock_guard lock(mu_);
  std::vector<WorkerSnapshot> out;
  out.reserve(workers_[role_index(role)].size());
  for (const auto& [address, w] : workers_[role_index(role)]) out.push_back(snapshot_locked(role, address, w, now));
  return out;
}

std::optional<WorkerSnapshot> WorkerRegistry::find(WorkerRole role, const std::string& address) const {
  const TimePoint now = clock_.now();
  std::lock_guard lock(mu_);
  const Worker* w = find_locked(role, address);
  if (w == nullptr) return std::nullopt;
  return snapshot_locked(role, address, *w, now);
}

bool WorkerRegistry::reserve_decode(const std::string& address, const std::string& request_id, int64_t n_blocks) {
  return add_unreported(WorkerRole::kDecode, address, request_id, n_blocks, /*confirmed=*/false);
}

void WorkerRegistry::confirm_decode(const std::string& address, const std::string& request_id) {
  const TimePoint now = clock_.now();
  std::lock_guard lock(mu_);
  Worker* w = find_locked(WorkerRole::kDecode, address);
  if (w == nullptr) return;
  auto it = w->unreported.find(request_id);
  if (it != w->unreported.end() && !it->second.confirmed_at.has_value()) it->second.confirmed_at = now;
}

void WorkerRegistry::release_decode(const std::string& address, const std::string& request_id) {
  remove_unreported(WorkerRole::kDecode, address, request_id);
}

bool WorkerRegistry::add_prefill_tokens(const std::string& address, const std::string& request_id, int64_t n_tokens) {
  return add_unreported(WorkerRole::kPrefill, address, request_id, n_tokens, /*confirmed=*/true);
}

void WorkerRegistry::remove_prefill_tokens(const std::string& address, const std::string& request_id) {
  remove_unreported(WorkerRole::kPrefill, address, request_id);
}

bool WorkerRegistry::add_prefill_prefix(const std::string& address, const std::string& request_id,
                                        std::shared_ptr<const std::vector<uint64_t>> hashes) {
  std::lock_guard lock(mu_);
  Worker* w = find_locked(WorkerRole::kPrefill, address);
  if (w == nullptr) return false;
  w->sent_prefixes[request_id] = Worker::SentPrefix{std::move(hashes), std::nullopt};
  return true;
}

void WorkerRegistry::confirm_prefill_prefix(const std::string& address, const std::string& request_id) {
  const TimePoint now = clock_.now();
  std::lock_guard lock(mu_);
  Worker* w = find_locked(WorkerRole::kPrefill, address);
  if (w == nullptr) return;
  auto it = w->sent_prefixes.find(request_id);
  if (it != w->sent_prefixes.end() && !it->second.confirmed_at.has_value()) it->second.confirmed_at = now;
}

void WorkerRegistry::remove_prefill_prefix(const std::string& address, const std::string& request_id) {
  std::lock_guard lock(mu_);
  if (Worker* w = find_locked(WorkerRole::kPrefill, address)) w->sent_prefixes.erase(request_id);
}

WorkerRegistry::Worker* WorkerRegistry::find_locked(WorkerRole role, const std::string& address) {
  auto& workers = workers_[role_index(role)];
  auto it = workers.find(address);
  return it == workers.end() ? nullptr : &it->second;
}

const WorkerRegistry::Worker* WorkerRegistry::find_locked(WorkerRole role, const std::string& address) const {
  const auto& workers = workers_[role_index(role)];
  auto it = workers.find(address);
  return it == workers.end() ? nullptr : &it->second;
}

WorkerSnapshot WorkerRegistry::snapshot_locked(WorkerRole role, const std::string& address, const Worker& w,
                                               TimePoint now) const {
  WorkerSnapshot s;
  s.address = address;
  s.role = role;
  s.has_report = w.has_report;
  s.load = w.load;
  s.last_report_at = w.last_report_at;
  s.n_consecutive_failures = w.n_consecutive_failures;
  s.healthy = w.has_report && w.n_consecutive_failures < config_.unhealthy_after_failures &&
              now - w.last_report_at <= config_.stale_after;
  (role == WorkerRole::kDecode ? s.reserved_blocks : s.unreported_prompt_tokens) = w.n_unreported;
  s.n_unreported_requests = static_cast<int32_t>(w.unreported.size());
  for (const auto& [id, sent] : w.sent_prefixes) s.sent_prefixes.push_back(sent.hashes);
  return s;
}

bool WorkerRegistry::add_unreported(WorkerRole role, const std::string& address, const std::string& request_id,
                                    int64_t amount, bool confirmed) {
  BATON_CHECK(amount >= 0, "negative %s adjustment %lld for request %s", worker_role_name(role),
              static_cast<long long>(amount), request_id.c_str());
  const TimePoint now = clock_.now();
  std::lock_guard lock(mu_);
  Worker* w = find_locked(role, address);
  if (w == nullptr) return false;
  Unreported u;
  u.amount = amount;
  if (confirmed) u.confirmed_at = now;
  const bool inserted = w->unreported.emplace(request_id, u).second;
  BATON_CHECK(inserted, "request %s already has work on %s worker %s", request_id.c_str(), worker_role_name(role),
              address.c_str());
  w->n_unreported += amount;
  return true;
}

void WorkerRegistry::remove_unreported(WorkerRole role, const std::string& address, const std::string& request_id) {
  std::lock_guard lock(mu_);
  Worker* w = find_locked(role, address);
  if (w == nullptr) return;
  auto it = w->unreported.find(request_id);
  if (it == w->unreported.end()) return;
  w->n_unreported -= it->second.amount;
  w->unreported.erase(it);
}

}  // namespace baton
