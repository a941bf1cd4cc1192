#include "client/health_command.h"

#include <cstdio>
#include <memory>
#include <string>

#include "client/channel.h"
#include "client/health_check.h"

namespace baton::ctl {
namespace {

struct HealthArgs {
  Connection connection;
  std::string service;  // "": the whole server (readiness)
  double timeout = 2;   // seconds
};

int run_health(const HealthArgs& a, InterruptWatcher& interrupts) {
  std::string error;
  auto channel = make_channel(a.connection, &error);
  if (!channel) return fail(kExitUsage, error);
  grpc::ClientContext context;
  set_timeout(context, a.timeout);
  interrupts.on_interrupt([&context] { context.TryCancel(); });
  std::string status;
  const grpc::Status s = health_check(channel, context, a.service, &status);
  interrupts.on_interrupt(nullptr);
  if (interrupts.interrupted()) return fail(kExitInterrupted, "interrupted");
  const std::string what = a.connection.address + (a.service.empty() ? "" : " service '" + a.service + "'");
  if (!s.ok()) {
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
      return fail(kExitFailure, what + ": the server does not report this service (" + status_to_string(s) + ")");
    }
    return fail(kExitFailure, what + ": health check failed: " + status_to_string(s));
  }
  std::printf("%s\n", status.c_str());
  std::fflush(stdout);
  if (status != "SERVING") return fail(kExitFailure, what + " is " + status);
  return kExitOk;
}

}  // namespace

void add_health_command(CLI::App& app, std::function<int(InterruptWatcher&)>* run) {
  auto a = std::make_shared<HealthArgs>();
  CLI::App* h = app.add_subcommand(
      "health", "Check one role's grpc.health.v1 status (a probe command): exit 0 when SERVING, 1 otherwise");
  add_connection_flags(h, a->connection);
  h->add_option("--service", a->service,
                "Service to check: \"\" (the whole server: readiness) or \"liveness\" (the process works)")
      ->capture_default_str();
  h->add_option("--timeout", a->timeout, "Seconds the check may take")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 3600.0));
  h->callback([a, run] { *run = [a](InterruptWatcher& interrupts) { return run_health(*a, interrupts); }; });
}

}  // namespace baton::ctl
