// Random `batonctl bench` samples for the report and plot tests: a mix of ok and failed
// requests, chat turns, optional cached-token counts, server breakdowns and finish times.
#pragma once

#include <random>
#include <vector>

#include "client/bench_report.h"

namespace baton::test {

inline std::vector<ctl::RequestSample> random_samples(std::mt19937_64& rng, size_t n, int turns, double p_fail = 0.1,
                                                      bool cached = false) {
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<ctl::RequestSample> out(n);
  for (size_t i = 0; i < n; ++i) {
    ctl::RequestSample& s = out[i];
    s.conversation = static_cast<int>(i) / std::max(turns, 1);
    s.turn = turns > 0 ? static_cast<int>(i) % turns : 0;
    s.n_prompt_sent = 10 + 7 * s.turn + std::uniform_int_distribution<int>(0, 3)(rng);
    s.arrival_at = 0.01 * static_cast<double>(i);
    s.sent_at = s.arrival_at + 0.001 * u(rng);
    s.ok = u(rng) >= p_fail;
    s.code = s.ok ? "OK" : "UNAVAILABLE";
    s.error = s.ok ? "" : "no worker";
    s.ttft = s.ok ? 0.001 + 0.3 * u(rng) * u(rng) : -1;
    s.itl.resize(s.ok ? std::uniform_int_distribution<size_t>(0, 30)(rng) : 0);
    for (double& g : s.itl) g = 0.002 + 0.05 * u(rng) * u(rng);
    s.n_output = static_cast<int>(s.itl.size()) + (s.ok ? 1 : 0);
    s.e2e = std::max(s.ttft, 0.0) + 0.01 * static_cast<double>(s.itl.size()) + 0.001;
    s.finished_at = s.sent_at + s.e2e + 0.5 * u(rng);  // finish order differs from issue order
    s.has_final = s.ok;
    if (s.ok) {
      s.n_prompt = s.n_prompt_sent;
      s.server_queue = 0.02 * u(rng);
      s.server_prefill = 0.1 * u(rng);
      s.server_kv_transfer = 0.01 * u(rng);
      s.server_decode_queue = 0.005 * u(rng);
      s.server_ttft = s.server_queue + s.server_prefill + 0.001;
      // Now and then an e2e shorter than the parts (clocks of different processes): decode is 0 then.
      s.server_e2e = s.server_queue + s.server_prefill + s.server_kv_transfer + s.server_decode_queue +
                     (u(rng) < 0.1 ? -0.001 : 0.2 * u(rng));
      if (cached) s.cached_prompt_tokens = std::uniform_int_distribution<int>(0, s.n_prompt_sent)(rng);
    }
  }
  return out;
}

}  // namespace baton::test
