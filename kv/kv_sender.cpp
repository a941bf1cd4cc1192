#include "kv/kv_sender.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "common/metrics.h"
#include "common/seconds.h"
#include "common/thread_name.h"

namespace baton {

// ---- KvOutbox ----------------------------------------------------------------------------------

KvOutbox::KvOutbox(KvTransferHeader header, int32_t n_cached, int64_t chunk_bytes, Export export_kv)
    : header_(std::move(header)),
      n_cached_(n_cached),
      export_(std::move(export_kv)),
      row_bytes_(kv_chunk_bytes(header_, 1)),
      layer_(header_.n_layers) {
  tokens_per_chunk_ = static_cast<int32_t>(std::clamp<int64_t>(chunk_bytes / (2 * row_bytes_), 1, header_.n_tokens));
  done_ = step_end_ = n_cached;  // the cached part is in the cache already
}

void KvOutbox::step_begins(int32_t step_end) {
  std::lock_guard<std::mutex> lock(mu_);
  step_end_ = step_end;
  layers_ = 0;
}

void KvOutbox::layer_written(int32_t n_layers) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    layers_ = n_layers;
  }
  cv_.notify_all();
}

void KvOutbox::step_done() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = step_end_;
    layers_ = header_.n_layers;
  }
  cv_.notify_all();
}

void KvOutbox::prefilled(int32_t first_token, Clock::time_point at) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    first_token_ = first_token;
    prefilled_at_ = at;
  }
  cv_.notify_all();
}

void KvOutbox::abandon() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    abandoned_ = true;
  }
  cv_.notify_all();
}

bool KvOutbox::abandoned() const {
  std::lock_guard<std::mutex> lock(mu_);
  return abandoned_;
}

std::optional<KvOutbox::Clock::time_point> KvOutbox::prefilled_at() const {
  std::lock_guard<std::mutex> lock(mu_);
  return prefilled_at_;
}

bool KvOutbox::next(KvChunk* c) {
  const int32_t n_tokens = header_.n_tokens;
  {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (abandoned_) return false;  // the receiver refuses what it got
      if (layer_ == header_.n_layers) {  // the stretch is out: the next one, when there is one
        if (stretch_end_ == n_tokens) {
          if (first_token_) return false;
        } else if (step_end_ > stretch_end_ || done_ > stretch_end_) {
          stretch_start_ = start_ = stretch_end_;
          // The cached part first, on its own: it is complete now, whatever the step in flight.
          stretch_end_ = stretch_end_ < n_cached_ ? n_cached_ : std::max(done_, step_end_);
          layer_ = 0;
          continue;
        }
      } else if (stretch_end_ <= done_ || layer_ < layers_) {
        break;  // this layer of the stretch is in the cache
      }
      cv_.wait(lock);
    }
  }
  const int32_t n = std::min(tokens_per_chunk_, stretch_end_ - start_);
  c->layer = layer_;
  c->token_start = start_;
  c->token_count = n;
  c->k.resize(static_cast<size_t>(n * row_bytes_));
  c->v.resize(static_cast<size_t>(n * row_bytes_));
  export_(layer_, start_, n, c->k.data(), c->v.data());
  c->checksum = kv_checksum(c->k, c->v);
  start_ += n;
  if (start_ == stretch_end_) {
    start_ = stretch_start_;
    ++layer_;
  }
  return true;
}

std::optional<int32_t> KvOutbox::first_token() {
  std::lock_guard<std::mutex> lock(mu_);
  if (abandoned_) return std::nullopt;
  return first_token_;
}

// ---- KvSender ----------------------------------------------------------------------------------

KvSender::KvSender(KvTransport& transport, KvSenderConfig config, Metrics* metrics)
    : transport_(transport), config_(std::move(config)), transport_name_(transport.name()), metrics_(metrics) {
  for (int i = 0; i < config_.n_threads; ++i) {
    threads_.emplace_back([this] {
      set_thread_name("prefill-kv-send");
      loop();
    });
  }
}

KvSender::~KvSender() {
  stop();
}

void KvSender::send(std::shared_ptr<KvOutbox> outbox, std::string address, Done done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({std::move(outbox), std::move(address), std::move(done)});
  }
  cv_.notify_one();
}

void KvSender::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
}

void KvSender::loop() {
  for (;;) {
    Transfer t;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and every queued transfer is done
      t = std::move(queue_.front());
      queue_.pop_front();
    }
    run(t);
  }
}

void KvSender::run(Transfer& t) {
  using Clock = KvOutbox::Clock;
  const Clock::time_point t0 = Clock::now();
  const std::string& id = t.outbox->header().request_id;
  Status status;
  int64_t bytes = 0;
  if (t.outbox->abandoned()) {
    status = cancelled("request " + id + " ended before its KV transfer");
  } else {
    // Chunks are exported lazily, one at a time, as the transport asks for them: at most one
    // chunk of this job's KV is in host memory here.
    status = transport_.send(t.address, t.outbox->header(), *t.outbox, &bytes);
  }
  const Clock::time_point t1 = Clock::now();
  const std::optional<Clock::time_point> prefilled_at = t.outbox->prefilled_at();
  const double seconds = seconds_between(prefilled_at ? std::max(t0, *prefilled_at) : t0, t1);
  // A transfer that failed because its job was abandoned is not the link's fault.
  const bool link_error = !status.ok() && status.code() != StatusCode::kCancelled && !t.outbox->abandoned();
  if (metrics_) {
    // Per link: this prefill worker, the decode worker, the transport.
    prometheus::Labels labels = Metrics::role_labels("prefill", config_.name);
    labels["src"] = config_.name;
    labels["dst"] = t.address;
    labels["transport"] = transport_name_;
    if (status.ok()) {
      metrics_->histogram(metrics_->kv_transfer_seconds, labels).Observe(seconds);
      metrics_->kv_transfer_bytes_total.Add(labels).Increment(static_cast<double>(bytes));
    } else if (link_error) {
      metrics_->kv_transfer_errors_total.Add(labels).Increment();
    }
  }
  if (status.ok()) {
    spdlog::debug("req={} KV sent to {}: {} bytes, {:.3f}s after the first token", id, t.address, bytes, seconds);
  } else if (link_error) {
    spdlog::warn("req={} KV transfer failed: {}", id, status.to_string());
  }
  t.done(status, seconds, bytes);
}

}  // namespace baton
