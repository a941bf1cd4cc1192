#include "client/doctor_gather.h"

#include <chrono>
#include <map>

#include "baton/v1/admin.grpc.pb.h"
#include "baton/v1/worker.grpc.pb.h"
#include "client/health_check.h"

namespace baton::ctl {
namespace {

using SteadyClock = std::chrono::steady_clock;

double unix_seconds_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string one_line(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return s.empty() ? "(no message)" : s;
}

NodeReport node(const std::string& role, const std::string& address) {
  NodeReport n;
  n.role = role;
  n.address = address;
  return n;
}

void record_failure(NodeReport& n, const char* call, const grpc::Status& s) {
  n.failed_call = call;
  n.error_code = status_code_name(s.error_code());
  n.error = one_line(s.error_message());
}

// One call with a deadline, cancelled by Ctrl-C. `rpc(context)` makes the call.
template <class Rpc>
grpc::Status call(InterruptWatcher& interrupts, double timeout_seconds, Rpc rpc,
                  const Connection* authorize_with = nullptr) {
  if (interrupts.interrupted()) return grpc::Status(grpc::StatusCode::CANCELLED, "interrupted");
  grpc::ClientContext context;
  set_timeout(context, timeout_seconds);
  if (authorize_with != nullptr) authorize(context, *authorize_with);
  interrupts.on_interrupt([&context] { context.TryCancel(); });
  grpc::Status s = rpc(context);
  interrupts.on_interrupt(nullptr);
  return s;
}

// Calls `rpc` and notes the node's clock against ours, from the wall time it reports.
template <class Rpc>
grpc::Status timed_call(InterruptWatcher& interrupts, double timeout, NodeReport& n, Rpc rpc,
                        const Connection* authorize_with = nullptr) {
  const double sent_unix = unix_seconds_now();
  const auto sent = SteadyClock::now();
  int64_t node_nanos = 0;
  grpc::Status s = call(interrupts, timeout, [&](grpc::ClientContext& c) { return rpc(c, &node_nanos); },
                        authorize_with);
  const double rtt = std::chrono::duration<double>(SteadyClock::now() - sent).count();
  if (s.ok() && node_nanos > 0) {
    n.has_clock = true;
    n.rtt_seconds = rtt;
    n.clock_offset_seconds = static_cast<double>(node_nanos) * 1e-9 - (sent_unix + rtt / 2);
  }
  return s;
}

void fill_from_load(NodeReport& n, const v1::LoadReport& r) {
  n.has_report = true;
  n.model_name = r.model().name();
  n.model_fingerprint = r.model_fingerprint();
  n.kv_dtype = r.kv_dtype();
  n.block_size = r.block_size();
  n.kv_transport = r.kv_transport();
  n.kv_transports.assign(r.kv_transports().begin(), r.kv_transports().end());
  n.version = r.version();
  n.draining = r.draining();
}

NodeReport check_worker(const DoctorTargets& t, const std::string& role, const std::string& address,
                        InterruptWatcher& interrupts) {
  NodeReport n = node(role, address);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel(address, t.internal, args);
  grpc::Status s = call(interrupts, t.timeout_seconds,
                        [&](grpc::ClientContext& c) { return health_check(channel, c, "", &n.health); });
  if (!s.ok()) {
    record_failure(n, "health", s);
    return n;
  }
  n.reachable = true;
  v1::LoadReport load;
  s = timed_call(interrupts, t.timeout_seconds, n, [&](grpc::ClientContext& c, int64_t* nanos) {
    grpc::Status st = role == "prefill" ? v1::PrefillWorker::NewStub(channel)->GetLoad(&c, v1::LoadRequest(), &load)
                                        : v1::DecodeWorker::NewStub(channel)->GetLoad(&c, v1::LoadRequest(), &load);
    *nanos = load.wall_time_unix_nanos();
    return st;
  });
  if (!s.ok()) {
    record_failure(n, "GetLoad", s);
    return n;
  }
  fill_from_load(n, load);
  return n;
}

// The frontend's own checks and its worker lists.
void check_frontend(const DoctorTargets& t, DoctorReport& r, InterruptWatcher& interrupts,
                    std::map<std::string, bool>* healthy) {
  NodeReport n = node("frontend", t.frontend.address);
  std::string error;
  auto channel = make_channel(t.frontend, &error);  // the files were checked with the flags
  grpc::Status s = call(interrupts, t.timeout_seconds,
                        [&](grpc::ClientContext& c) { return health_check(channel, c, "", &n.health); });
  if (!s.ok()) {
    record_failure(n, "health", s);
    r.frontend = n;
    return;
  }
  n.reachable = true;
  v1::ListWorkersResponse workers;
  s = timed_call(
      interrupts, t.timeout_seconds, n,
      [&](grpc::ClientContext& c, int64_t* nanos) {
        grpc::Status st = v1::Admin::NewStub(channel)->ListWorkers(&c, v1::ListWorkersRequest(), &workers);
        *nanos = workers.wall_time_unix_nanos();
        return st;
      },
      &t.frontend);
  if (!s.ok()) {
    record_failure(n, "ListWorkers", s);
    r.frontend = n;
    return;
  }
  n.has_report = true;
  n.model_name = workers.model().name();
  n.model_fingerprint = workers.model().fingerprint();
  n.version = workers.version();
  r.frontend = n;
  r.local_prefill_max_tokens = workers.local_prefill_max_tokens();
  for (const v1::WorkerEntry& w : workers.prefill()) {
    r.prefill.push_back(node("prefill", w.address()));
    (*healthy)["prefill " + w.address()] = w.healthy();
  }
  for (const v1::WorkerEntry& w : workers.decode()) {
    r.decode.push_back(node("decode", w.address()));
    (*healthy)["decode " + w.address()] = w.healthy();
  }
}

LinkReport probe_link(const DoctorTargets& t, const NodeReport& p, const NodeReport& d, InterruptWatcher& interrupts) {
  LinkReport l;
  l.prefill = p.address;
  l.decode = d.address;
  l.transport = p.kv_transport;
  if (!p.has_report || !d.has_report) {
    l.skipped = std::string(!p.has_report ? "prefill" : "decode") + " worker not checked";
    return l;
  }
  if (interrupts.interrupted()) {
    l.skipped = "interrupted";
    return l;
  }
  auto channel = grpc::CreateChannel(p.address, t.internal);
  v1::KvProbeRequest request;
  request.set_decode_address(d.address);
  request.set_bytes(t.kv_bytes);
  request.set_rounds(t.rounds);
  v1::KvProbeResponse response;
  const grpc::Status s = call(interrupts, t.probe_timeout_seconds, [&](grpc::ClientContext& c) {
    return v1::PrefillWorker::NewStub(channel)->ProbeKv(&c, request, &response);
  });
  if (!s.ok()) {
    l.error_code = status_code_name(s.error_code());
    l.error = one_line(s.error_message());
    return l;
  }
  l.transport = response.transport();
  l.bytes = response.bytes();
  l.seconds.assign(response.seconds().begin(), response.seconds().end());
  l.latency_bytes = response.latency_bytes();
  l.latency_seconds.assign(response.latency_seconds().begin(), response.latency_seconds().end());
  return l;
}

}  // namespace

DoctorReport doctor_gather(const DoctorTargets& t, InterruptWatcher& interrupts,
                           const std::function<void(const std::string&)>& progress) {
  DoctorReport r;
  r.internal_tls = t.internal_tls;
  r.kv_bytes = t.kv_bytes;
  r.rounds = t.rounds;
  std::map<std::string, bool> healthy;  // "role address" → as the frontend sees it
  if (!t.frontend.address.empty()) {
    check_frontend(t, r, interrupts, &healthy);
  } else {
    for (const std::string& a : t.prefill) r.prefill.push_back(node("prefill", a));
    for (const std::string& a : t.decode) r.decode.push_back(node("decode", a));
  }
  for (auto* list : {&r.prefill, &r.decode}) {
    for (NodeReport& n : *list) {
      n = check_worker(t, n.role, n.address, interrupts);
      if (auto it = healthy.find(n.role + " " + n.address); it != healthy.end()) n.frontend_healthy = it->second;
    }
  }
  for (const NodeReport& p : r.prefill) {
    for (const NodeReport& d : r.decode) {
      if (progress && p.has_report && d.has_report && !interrupts.interrupted()) {
        progress("probing KV " + p.address + " -> " + d.address + " (" + std::to_string(t.rounds) + " x " +
                 std::to_string(t.kv_bytes) + " bytes)");
      }
      r.links.push_back(probe_link(t, p, d, interrupts));
    }
  }
  return r;
}

}  // namespace baton::ctl
