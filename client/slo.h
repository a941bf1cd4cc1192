// Service-level objectives for `batonctl bench`: which requests met them, the attainment and the
// goodput (DistServe's measure: requests per second that met every SLO, so a server cannot look
// fast by serving many requests badly).
//
// A request meets the SLOs when it succeeded, its client-side TTFT is <= the TTFT bound and its
// ITL is <= the ITL bound. A request's ITL is the p99 (nearest rank) of its own inter-token gaps
// — the max gap for requests of up to 100 tokens, so one stall is enough to miss it; a request
// with no gap (one token message) meets any ITL bound. An absent bound is met by every request.
#pragma once

#include <algorithm>
#include <cstddef>
#include <optional>
#include <vector>

#include "client/latency_stats.h"

namespace baton::ctl {

struct Slo {
  std::optional<double> ttft_seconds;  // --slo-ttft: bound on the time to first token
  std::optional<double> itl_seconds;   // --slo-itl: bound on the request's p99 inter-token gap
  bool any() const { return ttft_seconds.has_value() || itl_seconds.has_value(); }
};

// One request as the SLOs see it.
struct SloInput {
  bool ok = false;
  double ttft_seconds = -1;  // < 0: no token arrived (misses any TTFT bound)
  double itl_seconds = 0;    // request_itl_seconds() of its gaps
};

// The request's ITL measure: p99 (nearest rank) of its inter-token gaps, 0 when it has none.
inline double request_itl_seconds(std::vector<double> gaps) {
  if (gaps.empty()) return 0;
  std::sort(gaps.begin(), gaps.end());
  return percentile_nearest_rank(gaps, 99);
}

inline bool meets_ttft(const SloInput& r, const Slo& slo) {
  return r.ok && (!slo.ttft_seconds || (r.ttft_seconds >= 0 && r.ttft_seconds <= *slo.ttft_seconds));
}
inline bool meets_itl(const SloInput& r, const Slo& slo) {
  return r.ok && (!slo.itl_seconds || r.itl_seconds <= *slo.itl_seconds);
}
inline bool meets_slo(const SloInput& r, const Slo& slo) {
  return meets_ttft(r, slo) && meets_itl(r, slo);
}

struct SloSummary {
  size_t n_total = 0;     // requests sent (failed ones included: they miss every SLO)
  size_t n_met = 0;       // met both
  size_t n_met_ttft = 0;  // met the TTFT bound (whatever their ITL)
  size_t n_met_itl = 0;   // met the ITL bound (whatever their TTFT)
  double attainment = 0;  // n_met / n_total; 0 without requests
  double goodput = 0;     // n_met / wall_seconds, requests per second; 0 without wall time
};

inline SloSummary summarize_slo(const std::vector<SloInput>& requests, const Slo& slo, double wall_seconds) {
  SloSummary s;
  s.n_total = requests.size();
  for (const SloInput& r : requests) {
    s.n_met += meets_slo(r, slo);
    s.n_met_ttft += meets_ttft(r, slo);
    s.n_met_itl += meets_itl(r, slo);
  }
  if (s.n_total > 0) s.attainment = static_cast<double>(s.n_met) / static_cast<double>(s.n_total);
  if (wall_seconds > 0) s.goodput = static_cast<double>(s.n_met) / wall_seconds;
  return s;
}

}  // namespace baton::ctl
