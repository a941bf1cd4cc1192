#include "prefill_worker/kv_prober.h"

#include <spdlog/spdlog.h>

#include "common/metrics.h"

namespace baton {

KvProber::KvProber(KvTransport& transport, KvProbeShape shape, int64_t chunk_bytes, const std::string& name,
                   Metrics* metrics)
    : transport_(transport), shape_(std::move(shape)), chunk_bytes_(chunk_bytes) {
  if (metrics != nullptr) {
    auto labels = Metrics::role_labels("prefill", name);
    bytes_ = &metrics->kv_probe_bytes_total.Add(labels);
    labels["result"] = "ok";
    ok_ = &metrics->kv_probes_total.Add(labels);
    labels["result"] = "failed";
    failed_ = &metrics->kv_probes_total.Add(labels);
  }
  thread_ = std::thread([this] { loop(); });
}

KvProber::~KvProber() { stop(); }

Status KvProber::start(const void* caller, const std::string& decode_address, int64_t bytes, int32_t rounds,
                       Done done) {
  BATON_RETURN_IF_ERROR(validate_kv_probe(decode_address, bytes, rounds));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return unavailable("this prefill worker is shutting down");
    if (job_) {
      return resource_exhausted("this prefill worker runs another KV probe (one at a time): probe again when it is "
                                "done");
    }
    cancel_ = false;
    job_ = Job{caller, decode_address, bytes, rounds, std::move(done)};
  }
  cv_.notify_all();
  return {};
}

void KvProber::cancel(const void* caller) {
  std::lock_guard<std::mutex> lock(mu_);
  if (job_ && job_->caller == caller) cancel_ = true;
}

void KvProber::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cancel_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void KvProber::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stopping_ || job_; });
    if (!job_) return;  // stopping, nothing left to answer
    const Job& job = *job_;
    lock.unlock();
    // A job queued just before stop() still runs: cancel_ is set, so it ends CANCELLED at once.
    Result<KvProbeResult> r =
        run_kv_probe(transport_, job.decode_address, shape_, job.bytes, job.rounds, chunk_bytes_, cancel_);
    if (r.ok()) {
      if (ok_) ok_->Increment();
      if (bytes_) bytes_->Increment(static_cast<double>(job.rounds) * static_cast<double>(r->bytes + r->latency_bytes));
    } else {
      if (failed_) failed_->Increment();
      spdlog::info("KV probe to {} failed: {}", job.decode_address, r.status().to_string());
    }
    lock.lock();
    Done done = std::move(job_->done);
    job_.reset();  // before `done`: its caller may start the next probe at once
    lock.unlock();
    done(std::move(r));
    lock.lock();
  }
}

}  // namespace baton
