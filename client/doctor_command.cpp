#include "client/doctor_command.h"

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "client/channel.h"
#include "client/doctor_checks.h"
#include "client/doctor_gather.h"
#include "client/doctor_report.h"
#include "common/tls.h"
#include "kv/kv_probe.h"

namespace baton::ctl {
namespace {

struct DoctorArgs {
  Connection frontend;  // address "": not given
  std::string prefill_addresses;
  std::string decode_addresses;
  TlsFiles internal_tls;
  int64_t kv_bytes = 16 << 20;
  int32_t rounds = 3;
  double timeout = 10;
  double probe_timeout = 300;
  double max_clock_skew = 1.0;
  std::string json_path;
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const size_t first = item.find_first_not_of(" \t");
    if (first == std::string::npos) continue;
    out.push_back(item.substr(first, item.find_last_not_of(" \t") - first + 1));
  }
  return out;
}

int run_doctor(const DoctorArgs& a, InterruptWatcher& interrupts) {
  DoctorTargets t;
  t.frontend = a.frontend;
  t.prefill = split_list(a.prefill_addresses);
  t.decode = split_list(a.decode_addresses);
  if (t.frontend.address.empty() == (t.prefill.empty() && t.decode.empty())) {
    return fail(kExitUsage, "give either --frontend HOST:PORT or the worker lists (--prefill-addresses and "
                            "--decode-addresses), not both");
  }
  if (!t.frontend.address.empty()) {
    std::string error;
    if (!make_channel(t.frontend, &error)) return fail(kExitUsage, error);
  }
  t.internal = grpc::InsecureChannelCredentials();
  if (a.internal_tls.any()) {
    if (Status s = check_tls_files(a.internal_tls, kInternalTlsFlags, /*need_ca=*/true); !s.ok()) {
      return fail(kExitUsage, s.message());
    }
    t.internal = internal_mtls_plane(a.internal_tls, std::chrono::seconds(60)).channel;
    t.internal_tls = true;
  }
  t.timeout_seconds = a.timeout;
  t.probe_timeout_seconds = a.probe_timeout;
  t.kv_bytes = a.kv_bytes;
  t.rounds = a.rounds;

  const DoctorReport report = doctor_gather(t, interrupts, [](const std::string& line) {
    std::fprintf(stderr, "%s\n", line.c_str());
  });
  if (interrupts.interrupted()) return fail(kExitInterrupted, "interrupted");
  const std::vector<Problem> problems = doctor_problems(report, DoctorLimits{a.max_clock_skew});
  std::fputs(doctor_text(report, problems).c_str(), stdout);
  std::fflush(stdout);
  if (!a.json_path.empty()) {
    std::ofstream out(a.json_path);
    out << doctor_json(report, problems).dump(2) << "\n";
    out.close();
    if (!out) return fail(kExitFailure, "--json: cannot write '" + a.json_path + "'");
  }
  return problems.empty() ? kExitOk : kExitFailure;
}

}  // namespace

void add_doctor_command(CLI::App& app, std::function<int(InterruptWatcher&)>* run) {
  auto a = std::make_shared<DoctorArgs>();
  a->frontend.address.clear();
  CLI::App* d = app.add_subcommand(
      "doctor", "Check a deployment: every role (reachable, health, model, KV dtype, clock) and every prefill -> "
                "decode link (KV bandwidth and latency over its transport); exit 1 on any problem");
  auto* frontend = d->add_option("--frontend", a->frontend.address,
                                 "Frontend host:port: its workers are listed by Admin.ListWorkers (an API key marked "
                                 "admin, or loopback when the frontend has no API keys)");
  auto* prefill = d->add_option("--prefill-addresses", a->prefill_addresses, "Prefill workers host:port,... (without --frontend)");
  auto* decode = d->add_option("--decode-addresses", a->decode_addresses, "Decode workers host:port,... (without --frontend)");
  frontend->excludes(prefill)->excludes(decode);
  add_connection_flags(d, a->frontend, /*with_address=*/false);
  d->add_option("--internal-tls-ca", a->internal_tls.ca,
                "PEM CA of the internal plane: talk mutual TLS to the workers (the roles' env vars apply)")
      ->envname("BATON_INTERNAL_TLS_CA");
  d->add_option("--internal-tls-cert", a->internal_tls.cert, "PEM certificate the internal CA signed")
      ->envname("BATON_INTERNAL_TLS_CERT");
  d->add_option("--internal-tls-key", a->internal_tls.key, "PEM private key of --internal-tls-cert")
      ->envname("BATON_INTERNAL_TLS_KEY");
  d->add_option("--kv-bytes", a->kv_bytes,
                "K and V bytes of each synthetic KV transfer (e.g. 16MiB; at most 256MiB; rounded down to whole "
                "tokens)")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(true))
      ->check(CLI::Range(int64_t{1}, kMaxKvProbeBytes));
  d->add_option("--rounds", a->rounds, "Transfers per link (each after a minimal one, for latency)")
      ->capture_default_str()
      ->check(CLI::Range(1, kMaxKvProbeRounds));
  d->add_option("--timeout", a->timeout, "Seconds for each health, load and ListWorkers call")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  d->add_option("--probe-timeout", a->probe_timeout, "Seconds for each link's probe (all its rounds)")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 86400.0));
  d->add_option("--max-clock-skew", a->max_clock_skew,
                "Seconds a node's clock may differ from this machine's (beyond half the round trip)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 86400.0));
  d->add_option("--json", a->json_path, "Also write the findings as JSON to this file");
  d->callback([a, run] { *run = [a](InterruptWatcher& interrupts) { return run_doctor(*a, interrupts); }; });
}

}  // namespace baton::ctl
