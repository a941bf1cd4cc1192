// baton's Prometheus metrics (names, units and labels as in DESIGN.md); server/metrics_server.h
// serves them on /metrics. One Metrics object per registry: `baton local` shares one across its roles (one
// /metrics), `baton serve` has one per process. Each role labels its samples with
// role="frontend|prefill|decode" and worker="<listen address>".
#pragma once

#include <memory>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <string>

#include "common/status.h"

namespace baton {

class Metrics {
 public:
  Metrics();

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // Histograms (seconds unless named otherwise).
  prometheus::Family<prometheus::Histogram>& queue_seconds;         // arrival → prefill compute start
  prometheus::Family<prometheus::Histogram>& prefill_seconds;       // prefill compute of one request
  prometheus::Family<prometheus::Histogram>& kv_transfer_seconds;   // labels src, dst (decode worker), transport
  prometheus::Family<prometheus::Histogram>& ttft_seconds;          // arrival → first token to the client
  prometheus::Family<prometheus::Histogram>& tpot_seconds;          // time per output token after the first
  prometheus::Family<prometheus::Histogram>& e2e_seconds;           // arrival → final message
  prometheus::Family<prometheus::Histogram>& prefill_step_tokens;   // tokens in one prefill step
  // The frontend's TTFT predictor (scheduler/ttft_predictor.h), per request that got a first
  // token: the TTFT predicted at admission, and |predicted − actual| / actual.
  prometheus::Family<prometheus::Histogram>& ttft_predicted_seconds;
  prometheus::Family<prometheus::Histogram>& ttft_prediction_error_ratio;
  // Counters.
  prometheus::Family<prometheus::Counter>& requests_total;          // label code="OK|INVALID_ARGUMENT|..."
  prometheus::Family<prometheus::Counter>& prompt_tokens_total;
  prometheus::Family<prometheus::Counter>& generation_tokens_total;
  prometheus::Family<prometheus::Counter>& kv_transfer_errors_total;  // labels src, dst, transport
  prometheus::Family<prometheus::Counter>& kv_transfer_bytes_total;   // labels src, dst, transport
  prometheus::Family<prometheus::Counter>& request_failovers_total;   // label reason="prefill|kv_handoff|decode_admit|decode"
  prometheus::Family<prometheus::Counter>& slo_rejections_total;  // label reason="prefill_queue|decode_kv" (--ttft-slo)
  // KV probes (batonctl doctor), apart from every request metric: role, worker, result="ok|failed".
  prometheus::Family<prometheus::Counter>& kv_probes_total;
  prometheus::Family<prometheus::Counter>& kv_probe_bytes_total;     // labels role, worker: K and V bytes probed
  // The prefill workers' prefix caches (role="prefill", worker): prompt tokens of the prefills
  // started with a cache (looked up), those of them whose KV came from it (hits), blocks that
  // joined it and blocks evicted from it.
  prometheus::Family<prometheus::Counter>& prefix_cache_lookup_tokens_total;
  prometheus::Family<prometheus::Counter>& prefix_cache_hit_tokens_total;
  prometheus::Family<prometheus::Counter>& prefix_cache_inserted_blocks_total;
  prometheus::Family<prometheus::Counter>& prefix_cache_evicted_blocks_total;
  // Gauges.
  prometheus::Family<prometheus::Gauge>& queue_depth;         // requests waiting (frontend: admitted, unplaced; prefill: queued)
  prometheus::Family<prometheus::Gauge>& running_sequences;   // prefill: prompts in progress; decode: sequences generating
  prometheus::Family<prometheus::Gauge>& kv_blocks_free;
  prometheus::Family<prometheus::Gauge>& kv_blocks_total;
  prometheus::Family<prometheus::Gauge>& prefix_cache_blocks;  // prefill: blocks holding cached prefixes (in use or idle)

  // Histogram of `family` for these labels, with the family's buckets.
  prometheus::Histogram& histogram(prometheus::Family<prometheus::Histogram>& family, const prometheus::Labels& labels);

  static prometheus::Labels role_labels(const std::string& role, const std::string& worker) {
    return {{"role", role}, {"worker", worker}};
  }

 private:
  explicit Metrics(std::shared_ptr<prometheus::Registry> registry);
  std::shared_ptr<prometheus::Registry> registry_;
};

// The gauges every engine keeps for its worker (role and worker labels): requests waiting,
// sequences running, KV blocks free and in all. Made without Metrics, set() does nothing.
class EngineGauges {
 public:
  EngineGauges() = default;
  EngineGauges(Metrics* metrics, const std::string& role, const std::string& worker);
  void set(double waiting, double running, double blocks_free, double blocks_total);

 private:
  prometheus::Gauge* waiting_ = nullptr;
  prometheus::Gauge* running_ = nullptr;
  prometheus::Gauge* blocks_free_ = nullptr;
  prometheus::Gauge* blocks_total_ = nullptr;
};

// A prefill worker's prefix-cache series (role="prefill"): blocks it holds, prompt tokens looked
// up and found in it, blocks inserted and evicted. Made without Metrics, it does nothing.
class PrefixCacheSeries {
 public:
  PrefixCacheSeries() = default;
  PrefixCacheSeries(Metrics* metrics, const std::string& worker);
  void looked_up(int64_t tokens, int64_t hit_tokens);
  // The cache's size and its running totals: the counters advance by what is new since the last call.
  void update(int64_t cached_blocks, int64_t n_inserted, int64_t n_evicted);

 private:
  prometheus::Gauge* cached_blocks_ = nullptr;
  prometheus::Counter* lookup_tokens_ = nullptr;
  prometheus::Counter* hit_tokens_ = nullptr;
  prometheus::Counter* inserted_blocks_ = nullptr;
  prometheus::Counter* evicted_blocks_ = nullptr;
  int64_t n_inserted_ = 0, n_evicted_ = 0;  // the totals already counted
};

}  // namespace baton
