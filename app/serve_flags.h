// The flags every `baton serve` role and `baton local` share, in one struct, and where CLI11 is told
// about them (each with its BATON_* environment variable).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "common/tls.h"
#include "scheduler/progress_watch.h"

namespace baton {

struct ServeArgs {
  std::string role;
  std::string model;
  std::string listen = "0.0.0.0:50051";
  std::string metrics_listen;  // "" = no metrics endpoint
  int threads = 0;
  std::string cpus;  // serve: the engine's cores (CPU list; "" = any)
  // local: the decode and prefill engines' cores ("" = an automatic split, "all" = every core,
  // shared). The frontend, gRPC and KV sender threads run on the prefill cores.
  std::string decode_cpus, prefill_cpus;
  std::string device = "cpu";
  std::string dtype = "auto";  // auto | bf16 | f32 (BackendOptions::measure_dtype)
  std::string kv_dtype;  // empty: the backend's default_kv_dtype() (resolve_kv_dtype)
  std::string kv_transport = "tcp";  // prefill: how KV reaches decode workers (tcp | cuda_ipc | nccl)
  std::string weights = "auto";      // auto | native | dense (engine_commands.h)
  int block_size = 16;
  int kv_blocks = 0;
  std::string kv_memory;  // empty: kv_blocks or the default (common/memory_limit.h's MemoryAmount)
  // frontend
  std::string prefill_addresses, prefill_dns, decode_addresses, decode_dns;
  int max_requests = 256;
  int max_priority = 0;
  int max_failovers = 2;
  // The watchdog's defaults are ProgressConfig's (scheduler/progress_watch.h).
  double progress_grace_seconds = ProgressConfig{}.grace_seconds;  // 0: no progress watchdog
  double progress_slack = ProgressConfig{}.slack;
  double progress_min_prefill_rate = ProgressConfig{}.min_prefill_tokens_per_second;  // of a worker not measured yet
  double worker_keepalive_seconds = 10;
  double worker_keepalive_timeout_seconds = 5;
  int max_message_bytes = 4 << 20;  // public API: one request message (gRPC) or body (HTTP)
  std::string http_listen;  // "" = no OpenAI-compatible HTTP API
  int http_threads = 512;   // HTTP requests served at once (idle connections hold no thread)
  double no_worker_timeout = 5.0;  // seconds
  int64_t max_queued_prompt_tokens = 256 * 1024;
  std::string chat_template;
  // prefill
  // Steps short enough that a prompt's first token does not wait for seven others (bench/RESULTS.md,
  // "Serving at c=8": on a CPU core a 2,048-token step is ~3 s; a GPU may take a larger budget).
  int prefill_token_budget = 512;
  // prefill: the engine's step threads' niceness, so that the threads that share its cores (gRPC,
  // KV senders, in `baton local` the frontend relaying decode tokens) preempt it (0: none)
  int prefill_nice = 10;
  // decode
  int max_batch = 32;
  // frontend + decode: prompts up to this many tokens are prefilled by the decode worker itself (0: never)
  int local_prefill_max_tokens = 0;
  int local_prefill_token_budget = 512;  // decode: most prompt tokens one decode step prefills
  // prefill
  bool kv_stream = true;  // stream each layer's KV while the prompt is prefilled
  int prefix_cache_blocks = -1;  // most blocks of the prefix cache (-1: the whole KV pool; 0: off)
  // frontend: prefix-aware prefill routing, queue tokens per cached prompt token (SchedulerConfig)
  double prefill_queue_weight = 1.0;
  // frontend: TTFT-target admission and where to prefill (SchedulerConfig)
  double ttft_slo = 0;
  std::string prefill_placement = "static";
  double slo_hold_fraction = 0.5;
  double local_prefill_itl_weight = 1.0;
  int max_request_seconds = 3600;  // a request's KV blocks are held at most this long
  // local
  int n_prefill_workers = 1;
  int n_decode_workers = 1;
  std::string log_level = "info";
  std::string log_format = "text";
  std::string name;  // metric `worker` label and log name; "" = the listen address
  int drain_timeout = 30;  // seconds in-flight work may take after SIGTERM
  int stall_timeout = 120;  // workers: seconds a step loop with work may not move before NOT_SERVING (0: off)
  // Security (common/tls.h, common/api_keys.h)
  TlsFiles public_tls;    // frontend: --tls-cert, --tls-key, --tls-client-ca
  TlsFiles internal_tls;  // every role: --internal-tls-cert, --internal-tls-key, --internal-tls-ca
  int tls_refresh_seconds = 60;  // how often certificate files are looked at again
  std::string api_key_file;      // frontend: "" = no API keys
  std::string health_listen;     // "" = health on the main listener only
  bool insecure = false;         // allow listening beyond loopback without authentication
};

std::vector<std::string> split_list(const std::string& s);

// Adds the shared flags to `c` (serve and local).
void add_serve_flags(CLI::App* c, ServeArgs& a);

}  // namespace baton
