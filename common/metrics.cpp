#include "common/metrics.h"

#include <map>

namespace baton {
namespace {

// Latency buckets from 1 ms to ~2 min (prefill of long prompts on CPU takes seconds).
const prometheus::Histogram::BucketBoundaries kSecondsBuckets = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
const prometheus::Histogram::BucketBoundaries kTokenBuckets = {1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192};
// Relative errors: 2 % to 10×, finest around the 25 % a TTFT prediction should keep within.
const prometheus::Histogram::BucketBoundaries kRatioBuckets = {0.02, 0.05, 0.1,  0.15, 0.2, 0.25, 0.3,
                                                               0.4,  0.5,  0.75, 1,    2,   5,    10};

template <typename T>
prometheus::Family<T>& family(prometheus::Registry& r, const std::string& name, const std::string& help) {
  if constexpr (std::is_same_v<T, prometheus::Histogram>) {
    return prometheus::BuildHistogram().Name(name).Help(help).Register(r);
  } else if constexpr (std::is_same_v<T, prometheus::Counter>) {
    return prometheus::BuildCounter().Name(name).Help(help).Register(r);
  } else {
    return prometheus::BuildGauge().Name(name).Help(help).Register(r);
  }
}

std::shared_ptr<prometheus::Registry> make_registry() { return std::make_shared<prometheus::Registry>(); }

}  // namespace

Metrics::Metrics() : Metrics(make_registry()) {}

Metrics::Metrics(std::shared_ptr<prometheus::Registry> r)
    : queue_seconds(family<prometheus::Histogram>(*r, "baton_request_queue_seconds",
                                                  "Arrival at the frontend to the start of prefill compute")),
      prefill_seconds(family<prometheus::Histogram>(*r, "baton_request_prefill_seconds", "Prefill compute of one request")),
      kv_transfer_seconds(family<prometheus::Histogram>(*r, "baton_kv_transfer_seconds",
                                                        "KV hand-off of one request, per link (src prefill worker, dst "
                                                        "decode worker, transport)")),
      ttft_seconds(family<prometheus::Histogram>(*r, "baton_time_to_first_token_seconds",
                                                 "Arrival to the first token written to the client stream")),
      tpot_seconds(family<prometheus::Histogram>(*r, "baton_time_per_output_token_seconds",
                                                 "Mean time between output tokens of one request, after the first")),
      e2e_seconds(family<prometheus::Histogram>(*r, "baton_request_e2e_seconds", "Arrival to the final message")),
      prefill_step_tokens(family<prometheus::Histogram>(*r, "baton_prefill_step_tokens", "Prompt tokens in one prefill step")),
      ttft_predicted_seconds(family<prometheus::Histogram>(*r, "baton_ttft_predicted_seconds",
                                                           "Time to first token the frontend predicted at admission, "
                                                           "per request that got a first token")),
      ttft_prediction_error_ratio(family<prometheus::Histogram>(*r, "baton_ttft_prediction_error_ratio",
                                                                "|predicted - actual| / actual time to first token, "
                                                                "per request that got a first token")),
      requests_total(family<prometheus::Counter>(*r, "baton_requests_total", "Finished Generate requests by gRPC status code")),
      prompt_tokens_total(family<prometheus::Counter>(*r, "baton_prompt_tokens_total", "Prompt tokens of admitted requests")),
      generation_tokens_total(family<prometheus::Counter>(*r, "baton_generation_tokens_total", "Tokens generated")),
      kv_transfer_errors_total(family<prometheus::Counter>(*r, "baton_kv_transfer_errors_total",
                                                           "KV hand-offs that failed or were refused, per link")),
      kv_transfer_bytes_total(family<prometheus::Counter>(*r, "baton_kv_transfer_bytes_total",
                                                          "K and V bytes handed off, per link (src, dst, transport)")),
      request_failovers_total(family<prometheus::Counter>(*r, "baton_request_failovers_total",
                                                          "Requests moved to other workers after a worker failed them, by what failed")),
      slo_rejections_total(family<prometheus::Counter>(*r, "baton_slo_rejections_total",
                                                       "Requests refused at admission as predicted to miss their TTFT "
                                                       "target, by the side that would make them late")),
      kv_probes_total(family<prometheus::Counter>(*r, "baton_kv_probes_total",
                                                  "Synthetic KV transfers (batonctl doctor) sent (prefill) or received "
                                                  "(decode), by result; not counted in any request metric")),
      kv_probe_bytes_total(family<prometheus::Counter>(*r, "baton_kv_probe_bytes_total",
                                                       "K and V bytes of synthetic KV transfers sent (prefill) or received (decode)")),
      prefix_cache_lookup_tokens_total(family<prometheus::Counter>(*r,
          "baton_prefix_cache_lookup_tokens_total",
          "Prompt tokens of prefills started with a prefix cache, per prefill worker")),
      prefix_cache_hit_tokens_total(family<prometheus::Counter>(*r,
          "baton_prefix_cache_hit_tokens_total",
          "Prompt tokens whose KV came from the prefix cache instead of being computed, per prefill worker")),
      prefix_cache_inserted_blocks_total(family<prometheus::Counter>(*r,
          "baton_prefix_cache_inserted_blocks_total", "KV blocks that joined the prefix cache, per prefill worker")),
      prefix_cache_evicted_blocks_total(family<prometheus::Counter>(*r,
          "baton_prefix_cache_evicted_blocks_total",
          "KV blocks evicted from the prefix cache (for room), per prefill worker")),
      queue_depth(family<prometheus::Gauge>(*r, "baton_queue_depth", "Requests waiting, per role and worker")),
      running_sequences(family<prometheus::Gauge>(*r, "baton_running_sequences", "Requests in progress, per role and worker")),
      kv_blocks_free(family<prometheus::Gauge>(*r, "baton_kv_blocks_free", "Free KV cache blocks, per worker (prefill: idle prefix-cache blocks included, they are taken back on demand)")),
      kv_blocks_total(family<prometheus::Gauge>(*r, "baton_kv_blocks_capacity", "All KV cache blocks, per worker (a gauge: _total is for counters)")),
      prefix_cache_blocks(family<prometheus::Gauge>(*r, "baton_prefix_cache_blocks",
                                                    "KV blocks holding cached prefixes (in use or idle), per prefill worker")),
      registry_(std::move(r)) {}

prometheus::Histogram& Metrics::histogram(prometheus::Family<prometheus::Histogram>& f, const prometheus::Labels& labels) {
  if (&f == &prefill_step_tokens) return f.Add(labels, kTokenBuckets);
  if (&f == &ttft_prediction_error_ratio) return f.Add(labels, kRatioBuckets);
  return f.Add(labels, kSecondsBuckets);
}

EngineGauges::EngineGauges(Metrics* metrics, const std::string& role, const std::string& worker) {
  if (metrics == nullptr) return;
  const prometheus::Labels labels = Metrics::role_labels(role, worker);
  waiting_ = &metrics->queue_depth.Add(labels);
  running_ = &metrics->running_sequences.Add(labels);
  blocks_free_ = &metrics->kv_blocks_free.Add(labels);
  blocks_total_ = &metrics->kv_blocks_total.Add(labels);
}

void EngineGauges::set(double waiting, double running, double blocks_free, double blocks_total) {
  if (waiting_ == nullptr) return;
  waiting_->Set(waiting);
  running_->Set(running);
  blocks_free_->Set(blocks_free);
  blocks_total_->Set(blocks_total);
}

PrefixCacheSeries::PrefixCacheSeries(Metrics* metrics, const std::string& worker) {
  if (metrics == nullptr) return;
  const prometheus::Labels labels = Metrics::role_labels("prefill", worker);
  cached_blocks_ = &metrics->prefix_cache_blocks.Add(labels);
  lookup_tokens_ = &metrics->prefix_cache_lookup_tokens_total.Add(labels);
  hit_tokens_ = &metrics->prefix_cache_hit_tokens_total.Add(labels);
  inserted_blocks_ = &metrics->prefix_cache_inserted_blocks_total.Add(labels);
  evicted_blocks_ = &metrics->prefix_cache_evicted_blocks_total.Add(labels);
}

void PrefixCacheSeries::looked_up(int64_t tokens, int64_t hit_tokens) {
  if (lookup_tokens_ == nullptr) return;
  lookup_tokens_->Increment(static_cast<double>(tokens));
  hit_tokens_->Increment(static_cast<double>(hit_tokens));
}

void PrefixCacheSeries::update(int64_t cached_blocks, int64_t n_inserted, int64_t n_evicted) {
  if (cached_blocks_ == nullptr) return;
  cached_blocks_->Set(static_cast<double>(cached_blocks));
  inserted_blocks_->Increment(static_cast<double>(n_inserted - n_inserted_));
  evicted_blocks_->Increment(static_cast<double>(n_evicted - n_evicted_));
  n_inserted_ = n_inserted;
  n_evicted_ = n_evicted;
}

}  // namespace baton
