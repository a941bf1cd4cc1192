#include "app/serve_flags.h"

#include <sstream>

#include "app/engine_commands.h"
#include "common/memory_limit.h"
#include "server/request_validation.h"

namespace baton {

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

void add_serve_flags(CLI::App* c, ServeArgs& a) {
  c->add_option("--model", a.model, "GGUF model file, or a Hugging Face model directory (config.json, safetensors, tokenizer.json)")
      ->required()
      ->envname("BATON_MODEL");
  c->add_option("--listen", a.listen, "gRPC listen address host:port")->envname("BATON_LISTEN");
  c->add_option("--metrics-listen", a.metrics_listen, "Prometheus /metrics address host:port")
      ->envname("BATON_METRICS_LISTEN");
  c->add_option("--threads", a.threads, "CPU threads per engine (0: one per core it owns, or all cores)")
      ->envname("BATON_THREADS");
  c->add_option("--device", a.device, "cpu, or cuda[:N] for the CUDA backend (bf16)")->envname("BATON_DEVICE");
  c->add_option("--dtype", a.dtype,
                "GEMM compute type: auto (default: bf16 where the CPU has it; a prefill-only worker measures bf16 "
                "against f32 at start and takes the faster), bf16 or f32")
      ->check(CLI::IsMember({"auto", "f32", "bf16"}))
      ->envname("BATON_DTYPE");
  c->add_option("--kv-dtype", a.kv_dtype, "KV cache type: f32, bf16 or f16 (default: bf16 with --dtype bf16 where the device computes in bf16, else f32)")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}))
      ->envname("BATON_KV_DTYPE");
  c->add_option("--weights", a.weights, kWeightsHelp)
      ->check(CLI::IsMember({"auto", "native", "dense"}))
      ->envname("BATON_WEIGHTS");
  c->add_option("--kv-transport", a.kv_transport,
                "Prefill: how KV reaches decode workers: tcp (gRPC, anywhere), cuda_ipc (same node), nccl")
      ->check(CLI::IsMember({"tcp", "cuda_ipc", "nccl"}))
      ->envname("BATON_KV_TRANSPORT");
  c->add_option("--block-size", a.block_size, "KV block size in tokens")->check(CLI::Range(1, 4096))->envname("BATON_BLOCK_SIZE");
  CLI::Option* kv_blocks = c->add_option("--kv-blocks", a.kv_blocks, "KV blocks per worker (0: automatic)")
                               ->check(CLI::NonNegativeNumber)
                               ->envname("BATON_KV_BLOCKS");
  c->add_option("--kv-memory", a.kv_memory,
                "KV pool per worker in bytes (512MiB, 1.5G) or as a share of the memory still available once "
                "the model is loaded (30%: of the memory limit, else of MemAvailable)")
      ->check(
          [](const std::string& text) {
            const Result<MemoryAmount> amount = parse_memory_amount(text);
            return amount.ok() ? std::string() : amount.status().message();
          },
          "SIZE|N%")
      ->excludes(kv_blocks)
      ->envname("BATON_KV_MEMORY");
  c->add_option("--prefill-addresses", a.prefill_addresses, "Frontend: prefill workers, host:port,...")
      ->envname("BATON_PREFILL_ADDRESSES");
  c->add_option("--prefill-dns", a.prefill_dns, "Frontend: host:port resolving to every prefill worker")
      ->envname("BATON_PREFILL_DNS");
  c->add_option("--decode-addresses", a.decode_addresses, "Frontend: decode workers, host:port,...")
      ->envname("BATON_DECODE_ADDRESSES");
  c->add_option("--decode-dns", a.decode_dns, "Frontend: host:port resolving to every decode worker")
      ->envname("BATON_DECODE_DNS");
  c->add_option("--max-requests", a.max_requests, "Frontend: admitted requests bound")
      ->check(CLI::PositiveNumber)
      ->envname("BATON_MAX_REQUESTS");
  c->add_option("--max-queued-prompt-tokens", a.max_queued_prompt_tokens, "Frontend: queued prompt tokens bound")
      ->check(CLI::PositiveNumber)
      ->envname("BATON_MAX_QUEUED_PROMPT_TOKENS");
  c->add_option("--max-priority", a.max_priority,
                "Frontend: highest request priority a client may ask for (lower is always allowed)")
      ->check(CLI::Range(-kPriorityBound, kPriorityBound))
      ->envname("BATON_MAX_PRIORITY");
  c->add_option("--max-message-bytes", a.max_message_bytes,
                "Frontend: largest request message (gRPC; RESOURCE_EXHAUSTED above) or body (HTTP; 413 above) "
                "the public API accepts")
      ->check(CLI::Range(1024, 256 << 20))
      ->envname("BATON_MAX_MESSAGE_BYTES");
  c->add_option("--http-listen", a.http_listen,
                "Frontend: also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                "/v1/models, /health) on host:port (off unless set)")
      ->envname("BATON_HTTP_LISTEN");
  c->add_option("--http-threads", a.http_threads,
                "Frontend: HTTP requests served at once (a streamed response holds one for its whole life; idle and "
                "slow connections hold none)")
      ->check(CLI::Range(4, 65536))
      ->envname("BATON_HTTP_THREADS");
  c->add_option("--max-failovers", a.max_failovers,
                "Frontend: times a request is re-prefilled on other workers after a worker fails it")
      ->check(CLI::Range(0, 16))
      ->envname("BATON_MAX_FAILOVERS");
  c->add_option("--progress-grace-seconds", a.progress_grace_seconds,
                "Frontend: an attempt silent longer than this plus --progress-slack times what its workers report "
                "(their slowest recent step, their prefill rate and queue) fails over as a broken one does "
                "(0: no progress watchdog)")
      ->check(CLI::Range(0.0, 3600.0))
      ->envname("BATON_PROGRESS_GRACE_SECONDS");
  c->add_option("--progress-slack", a.progress_slack,
                "Frontend: how many times slower than its reports a worker may be before it counts as stuck")
      ->check(CLI::Range(1.0, 1000.0))
      ->envname("BATON_PROGRESS_SLACK");
  c->add_option("--progress-min-prefill-rate", a.progress_min_prefill_rate,
                "Frontend: prompt tokens per second assumed of a worker that has measured none yet")
      ->check(CLI::Range(0.001, 1e9))
      ->envname("BATON_PROGRESS_MIN_PREFILL_RATE");
  c->add_option("--worker-keepalive-seconds", a.worker_keepalive_seconds,
                "Frontend: HTTP/2 ping interval on worker connections; workers: on their callers' connections")
      ->check(CLI::Range(1.0, 86400.0))
      ->envname("BATON_WORKER_KEEPALIVE_SECONDS");
  c->add_option("--worker-keepalive-timeout-seconds", a.worker_keepalive_timeout_seconds,
                "Frontend: a worker connection whose ping is not answered within this is broken (its calls fail "
                "over); workers: a caller's connection likewise (its calls are cancelled and what they hold freed)")
      ->check(CLI::Range(0.1, 3600.0))
      ->envname("BATON_WORKER_KEEPALIVE_TIMEOUT_SECONDS");
  c->add_option("--no-worker-timeout", a.no_worker_timeout,
                "Frontend: seconds a queued request waits while no prefill or no decode worker is healthy, "
                "then fails UNAVAILABLE")
      ->check(CLI::Range(0.001, 86400.0))
      ->envname("BATON_NO_WORKER_TIMEOUT");
  c->add_option("--chat-template", a.chat_template,
                "NAME (chatml, llama2, llama3, mistral, zephyr) or a Jinja FILE (default: the model's template)")
      ->envname("BATON_CHAT_TEMPLATE");
  c->add_option("--prefill-token-budget", a.prefill_token_budget,
                "Prefill: most prompt tokens per step (default 512; a larger budget batches more prompts into one "
                "step and holds every first token in it until the step ends)")
      ->check(CLI::Range(1, 1 << 20))
      ->envname("BATON_PREFILL_TOKEN_BUDGET");
  c->add_option("--prefill-nice", a.prefill_nice,
                "Prefill: niceness of the engine's compute threads, so that the threads sharing its cores (gRPC, "
                "KV senders; in baton local the frontend relaying decode tokens) preempt it (0: none)")
      ->check(CLI::Range(0, 19))
      ->envname("BATON_PREFILL_NICE");
  c->add_option("--max-request-seconds", a.max_request_seconds,
                "Frontend and decode: longest a request may run (frontend, gRPC and HTTP) or hold KV blocks (decode), "
                "whatever deadline it asks for (DEADLINE_EXCEEDED after)")
      ->check(CLI::Range(1, 7 * 24 * 3600))
      ->envname("BATON_MAX_REQUEST_SECONDS");
  c->add_option("--max-batch", a.max_batch, "Decode: most sequences per step")
      ->check(CLI::Range(1, 4096))
      ->envname("BATON_MAX_BATCH");
  c->add_option("--local-prefill-max-tokens", a.local_prefill_max_tokens,
                "Frontend and decode: prompts of up to N tokens are prefilled by the decode worker itself, "
                "without a prefill worker or KV transfer (0: never; a large N with no prefill workers: colocated)")
      ->check(CLI::Range(0, 1 << 30))
      ->envname("BATON_LOCAL_PREFILL_MAX_TOKENS");
  c->add_option("--local-prefill-token-budget", a.local_prefill_token_budget,
                "Decode: most prompt tokens one decode step prefills (chunked prefill)")
      ->check(CLI::Range(1, 1 << 20))
      ->envname("BATON_LOCAL_PREFILL_TOKEN_BUDGET");
  c->add_option("--kv-stream", a.kv_stream,
                "Prefill: send each layer's KV while the prompt is prefilled (true), or after the first token (false)")
      ->envname("BATON_KV_STREAM");
  c->add_option("--prefix-cache-blocks", a.prefix_cache_blocks,
                "Prefill: most KV blocks the prefix cache keeps for later prompts sharing a prefix (-1: every block "
                "of the pool that work in flight does not need; 0: no prefix cache)")
      ->check(CLI::Range(-1, 1 << 30))
      ->envname("BATON_PREFIX_CACHE_BLOCKS");
  c->add_option("--prefill-queue-weight", a.prefill_queue_weight,
                "Frontend: prefill routing weighs W tokens of a worker's queue as one prompt token its prefix cache "
                "saves (1: the soonest first token; larger: shorter queues first; 0: the cache alone)")
      ->check(CLI::Range(0.0, 1e9))
      ->envname("BATON_PREFILL_QUEUE_WEIGHT");
  c->add_option("--ttft-slo", a.ttft_slo,
                "Frontend: time-to-first-token target in seconds: a request predicted to miss it on every placement "
                "is refused at once (RESOURCE_EXHAUSTED / HTTP 429 with Retry-After, naming the prefill queue or "
                "decode KV); requests may ask for a tighter one (0: none)")
      ->check(CLI::Range(0.0, 3600.0))
      ->envname("BATON_TTFT_SLO");
  c->add_option("--prefill-placement", a.prefill_placement,
                "Frontend: where prompts are prefilled: static (on the decode worker up to "
                "--local-prefill-max-tokens, else a prefill worker) or adaptive (per request, by predicted TTFT "
                "and the cost to the decode batch, up to the same bound)")
      ->check(CLI::IsMember({"static", "adaptive"}))
      ->envname("BATON_PREFILL_PLACEMENT");
  c->add_option("--slo-hold-fraction", a.slo_hold_fraction,
                "Frontend, with --ttft-slo: a worker is handed a new prompt only while the work it holds is "
                "predicted under this fraction of the target; the rest waits at the frontend in priority order")
      ->check(CLI::Range(0.01, 1.0))
      ->envname("BATON_SLO_HOLD_FRACTION");
  c->add_option("--local-prefill-itl-weight", a.local_prefill_itl_weight,
                "Frontend, adaptive placement without --ttft-slo: prefill on the decode worker when the TTFT saved "
                "exceeds W x the time added to its decode batch")
      ->check(CLI::Range(0.0, 1e6))
      ->envname("BATON_LOCAL_PREFILL_ITL_WEIGHT");
  c->add_option("--log-level", a.log_level, "trace|debug|info|warn|error")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}))
      ->envname("BATON_LOG_LEVEL");
  c->add_option("--log-format", a.log_format, "text | json (one JSON object per line, for log collectors)")
      ->check(CLI::IsMember({"text", "json"}))
      ->envname("BATON_LOG_FORMAT");
  c->add_option("--name", a.name, "This role's name in metrics (worker label) and logs (default: --listen)")
      ->envname("BATON_NAME");
  c->add_option("--drain-timeout", a.drain_timeout, "Seconds in-flight requests may take after SIGTERM")
      ->check(CLI::Range(0, 3600))
      ->envname("BATON_DRAIN_TIMEOUT");
  c->add_option("--stall-timeout", a.stall_timeout,
                "Workers: seconds a step loop that has work may make no progress before the worker reports "
                "NOT_SERVING (0: never)")
      ->check(CLI::Range(0, 86400))
      ->envname("BATON_STALL_TIMEOUT");
  c->add_option("--tls-cert", a.public_tls.cert, "Frontend: PEM certificate chain of the public API (TLS)")
      ->envname("BATON_TLS_CERT");
  c->add_option("--tls-key", a.public_tls.key, "Frontend: PEM private key of --tls-cert")->envname("BATON_TLS_KEY");
  c->add_option("--tls-client-ca", a.public_tls.ca,
                "Frontend: PEM CA bundle; clients must present a certificate it signed (mutual TLS)")
      ->envname("BATON_TLS_CLIENT_CA");
  c->add_option("--internal-tls-cert", a.internal_tls.cert,
                "Every role: PEM certificate for the internal plane (mutual TLS between frontend, prefill and decode)")
      ->envname("BATON_INTERNAL_TLS_CERT");
  c->add_option("--internal-tls-key", a.internal_tls.key, "Every role: PEM private key of --internal-tls-cert")
      ->envname("BATON_INTERNAL_TLS_KEY");
  c->add_option("--internal-tls-ca", a.internal_tls.ca,
                "Every role: PEM CA that signed every internal certificate; peers it did not sign are refused")
      ->envname("BATON_INTERNAL_TLS_CA");
  c->add_option("--tls-refresh-seconds", a.tls_refresh_seconds,
                "Seconds between looks at the certificate files (rotated files apply to new connections)")
      ->check(CLI::Range(1, 86400))
      ->envname("BATON_TLS_REFRESH_SECONDS");
  c->add_option("--api-key-file", a.api_key_file,
                "Frontend: file of API keys, one per line; clients send 'authorization: Bearer <key>' "
                "(re-read when it changes)")
      ->envname("BATON_API_KEY_FILE");
  c->add_option("--health-listen", a.health_listen,
                "Also serve grpc.health.v1 alone, in plaintext, on host:port (for probes that speak no TLS)")
      ->envname("BATON_HEALTH_LISTEN");
  c->add_flag("--insecure", a.insecure,
              "Allow listening beyond loopback without TLS / an authenticated internal plane")
      ->envname("BATON_INSECURE");
}

}  // namespace baton
