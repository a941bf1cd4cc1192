// How `batonctl doctor` learns about a deployment: over the public plane from the frontend
// (grpc.health.v1, Admin.ListWorkers), over the internal plane from each worker (grpc.health.v1,
// GetLoad), and per prefill → decode link from the prefill worker (PrefillWorker.ProbeKv to the
// decode worker, over the prefill worker's own KV transport). Calls run one after another: the
// probes especially, so that two links never share the bandwidth they measure. Every failure
// becomes a finding in the report (doctor_checks.h judges them); nothing here fails.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "client/channel.h"
#include "client/doctor_checks.h"
#include "client/interrupt_watcher.h"

namespace baton::ctl {

struct DoctorTargets {
  Connection frontend;                  // address "" without --frontend; its TLS flags and API key
  std::vector<std::string> prefill;     // --prefill-addresses (without --frontend)
  std::vector<std::string> decode;      // --decode-addresses (without --frontend)
  // The internal plane's channel credentials (mutual TLS with --internal-tls-*, else plaintext),
  // and whether they are mutual TLS.
  std::shared_ptr<grpc::ChannelCredentials> internal;
  bool internal_tls = false;
  double timeout_seconds = 10;          // each health, GetLoad and ListWorkers call
  double probe_timeout_seconds = 300;   // each link's ProbeKv
  int64_t kv_bytes = 16 << 20;          // K and V bytes of each large probe transfer
  int32_t rounds = 3;
};

// Fills the report. `progress` (may be empty) gets a line before each slow step (a probe).
// After an interrupt the remaining calls are not made (their rows say "interrupted").
DoctorReport doctor_gather(const DoctorTargets& targets, InterruptWatcher& interrupts,
                           const std::function<void(const std::string&)>& progress);

}  // namespace baton::ctl
