#include "client/doctor_checks.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

namespace baton::ctl {
namespace {

std::string fmt_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f s", s);
  return buf;
}

std::string node_subject(const NodeReport& n) {
  return n.role == "frontend" ? "frontend " + n.address : n.role + " worker " + n.address;
}

std::string short_fingerprint(const std::string& f) { return f.size() > 16 ? f.substr(0, 16) + "..." : f; }

// The value workers should have, and who has it, for the messages ("the frontend", "prefill
// worker A", "3 other workers").
struct Reference {
  std::string value;
  std::string holder;
  bool plural = false;  // "3 workers use", "the frontend uses"
  std::string verb(const std::string& singular) const { return plural ? singular.substr(0, singular.size() - 1) : singular; }
};

// The most common value of `field` among the workers with a report (ties: the first one's, in
// prefill-then-decode order); nullopt when none has one.
template <class Field>
std::optional<Reference> majority(const std::vector<const NodeReport*>& workers, Field field) {
  std::map<std::string, int> count;
  std::vector<std::string> order;
  for (const NodeReport* w : workers) {
    const std::string v = field(*w);
    if (count[v]++ == 0) order.push_back(v);
  }
  if (order.empty()) return std::nullopt;
  std::string best = order.front();
  for (const std::string& v : order) {
    if (count[v] > count[best]) best = v;
  }
  if (count[best] == 1) {
    for (const NodeReport* w : workers) {
      if (field(*w) == best) return Reference{best, node_subject(*w), false};
    }
  }
  return Reference{best, std::to_string(count[best]) + " workers", true};
}

// Unreachable, refused or unhealthy: the fix depends on which call failed and how.
void check_reachability(const NodeReport& n, bool internal_tls, std::vector<Problem>* out) {
  if (n.failed_call.empty()) return;
  Problem p{n.role, n.address, "", ""};
  const std::string status = n.error_code + ": " + n.error;
  if (n.role == "frontend") {
    if (n.failed_call == "health") {
      p.what = "unreachable (" + status + ")";
      p.fix = "check --frontend's address, that the frontend runs, and the public TLS flags (--tls-ca, "
              "--tls-cert/--tls-key for a frontend with --tls-client-ca, --tls-server-name)";
    } else {
      p.what = n.failed_call + " refused (" + status + ")";
      if (n.error_code == "UNAUTHENTICATED") {
        p.fix = "give --api-key (or BATONCTL_API_KEY) a key from the frontend's --api-key-file whose line ends "
                "with 'admin'";
      } else if (n.error_code == "PERMISSION_DENIED") {
        p.fix = "add 'admin' to the key's line in the frontend's --api-key-file, or, for a frontend without API keys, "
                "run batonctl doctor on the frontend's host";
      } else if (n.error_code == "UNIMPLEMENTED") {
        p.fix = "the frontend's baton predates the Admin service: upgrade it, or give --prefill-addresses and "
                "--decode-addresses instead of --frontend";
      } else {
        p.fix = "see the frontend's log; or give --prefill-addresses and --decode-addresses instead of --frontend";
      }
    }
    out->push_back(p);
    return;
  }
  if (n.failed_call == "health") {
    p.what = "unreachable (" + status + ")";
    p.fix = "check the address (the frontend's --" + n.role + "-addresses or --" + n.role +
            "-dns), that the worker runs, and the NetworkPolicy; ";
    p.fix += internal_tls ? "check that the worker's certificate and --internal-tls-* come from the same internal CA"
                          : "if the deployment uses internal mutual TLS, give doctor the deployment's certificate "
                            "(--internal-tls-ca, --internal-tls-cert, --internal-tls-key)";
  } else if (n.error_code == "UNIMPLEMENTED") {
    p.what = "answers, but not as a " + n.role + " worker (" + n.failed_call + ": " + status + ")";
    p.fix = "this address serves another role (or an older baton): check the prefill and decode address lists";
  } else {
    p.what = n.failed_call + " failed (" + status + ")";
    p.fix = "see the worker's log";
  }
  out->push_back(p);
}

void check_state(const NodeReport& n, std::vector<Problem>* out) {
  if (!n.failed_call.empty()) return;
  if (n.health != "SERVING") {
    out->push_back({n.role, n.address, "health is " + (n.health.empty() ? std::string("unknown") : n.health),
                    n.role == "frontend"
                        ? "it has no healthy prefill or decode worker, or it is draining: see the workers here and its "
                          "log"
                        : "its step loop is stalled (--stall-timeout) or it is draining: see its log, restart it"});
  } else if (n.draining) {
    out->push_back({n.role, n.address, "reports draining (shutting down, or its step loop stalled)",
                    "it takes no new work: wait for its replacement, or see its log"});
  }
  if (n.frontend_healthy == false) {
    out->push_back({n.role, n.address, "the frontend sees it unhealthy (its load polls fail or are refused)",
                    "check the NetworkPolicy and certificates between the frontend and this worker, and that it serves "
                    "the frontend's model (the frontend's log names the reason)"});
  }
}

void check_clock(const NodeReport& n, const DoctorLimits& limits, std::vector<Problem>* out) {
  if (!n.has_clock) return;
  const double off = std::fabs(n.clock_offset_seconds) - n.rtt_seconds / 2;
  if (off <= limits.max_clock_skew_seconds) return;
  out->push_back({n.role, n.address,
                  "its clock is " + fmt_seconds(std::fabs(n.clock_offset_seconds)) +
                      (n.clock_offset_seconds > 0 ? " ahead of" : " behind") + " this machine's (round trip " +
                      fmt_seconds(n.rtt_seconds) + ", bound " + fmt_seconds(limits.max_clock_skew_seconds) + ")",
                  "run NTP (chrony, systemd-timesyncd) on every node: request timing and deadlines cross processes "
                  "(when every node is flagged alike, this machine's clock is the one to fix)"});
}

// Model fingerprint, KV dtype and block size against the reference.
void check_agreement(const DoctorReport& r, std::vector<Problem>* out) {
  std::vector<const NodeReport*> workers;
  for (const auto* list : {&r.prefill, &r.decode}) {
    for (const NodeReport& w : *list) {
      if (w.has_report) workers.push_back(&w);
    }
  }
  std::optional<Reference> model = majority(workers, [](const NodeReport& w) { return w.model_fingerprint; });
  if (r.frontend && r.frontend->has_report) model = Reference{r.frontend->model_fingerprint, "the frontend", false};
  const auto dtype = majority(workers, [](const NodeReport& w) { return w.kv_dtype; });
  const auto block = majority(workers, [](const NodeReport& w) { return std::to_string(w.block_size); });
  for (const NodeReport* w : workers) {
    if (model && w->model_fingerprint != model->value) {
      out->push_back({w->role, w->address,
                      "serves model " + w->model_name + " (fingerprint " + short_fingerprint(w->model_fingerprint) +
                          ") but " + model->holder + " " + model->verb("serves") + " fingerprint " +
                          short_fingerprint(model->value),
                      "deploy the same model file on every role (the fingerprint covers the weights' shapes and the KV "
                      "layout)"});
    }
    if (dtype && w->kv_dtype != dtype->value) {
      out->push_back({w->role, w->address,
                      "KV dtype differs: it uses " + w->kv_dtype + " but " + dtype->holder + " " +
                          dtype->verb("uses") + " " + dtype->value,
                      "set the same --kv-dtype on every worker (KV crosses from prefill to decode in that type)"});
    }
    if (block && std::to_string(w->block_size) != block->value) {
      out->push_back({w->role, w->address,
                      "KV block size differs: " + std::to_string(w->block_size) + " tokens but " + block->holder +
                          " " + block->verb("uses") + " " + block->value,
                      "set the same --block-size on every worker (capacity and prefix caching are planned per "
                      "block)"});
    }
  }
}

// The fix for a failed probe, by its code and what the receiver said.
std::string probe_fix(const LinkReport& l) {
  const auto says = [&](const char* s) { return l.error.find(s) != std::string::npos; };
  if (l.error_code == "FAILED_PRECONDITION") {
    if (says("fingerprint")) return "deploy the same model file on every role";
    if (says("--kv-dtype")) return "set the same --kv-dtype on both workers";
    if (says("takes no KV probes")) return "upgrade the decode worker to this batonctl's version";
    return "make the two workers' model and KV flags agree (see the message)";
  }
  if (l.error_code == "UNAVAILABLE" || l.error_code == "DEADLINE_EXCEEDED") {
    std::string fix = "the prefill worker cannot reach the decode worker at " + l.decode + " over " +
                      (l.transport.empty() ? std::string("its transport") : l.transport) +
                      ": check that this address is one the prefill worker can reach, the NetworkPolicy (prefill -> "
                      "decode), and that both workers' internal certificates come from the same CA";
    if (l.transport == "nccl") fix += "; for nccl also NCCL's own ports and libnccl on both nodes";
    if (l.transport == "cuda_ipc") fix += "; cuda_ipc works only between processes on one node";
    return fix;
  }
  if (l.error_code == "UNIMPLEMENTED") {
    return "run one baton version everywhere, built with the transport (the prefill worker's baton may predate "
           "ProbeKv, or the decode worker's build lacks the device transports)";
  }
  if (l.error_code == "RESOURCE_EXHAUSTED") return "another KV probe is running (a second batonctl doctor?): run again";
  if (l.error_code == "DATA_LOSS") {
    return "a checksum failed in transit: the path corrupts data (NIC, GPU fabric, a proxy): investigate before "
           "serving";
  }
  return "see both workers' logs";
}

void check_links(const DoctorReport& r, std::vector<Problem>* out) {
  std::map<std::string, const NodeReport*> decode;
  for (const NodeReport& d : r.decode) decode[d.address] = &d;
  std::map<std::string, const NodeReport*> prefill;
  for (const NodeReport& p : r.prefill) prefill[p.address] = &p;
  for (const LinkReport& l : r.links) {
    const NodeReport* p = prefill.count(l.prefill) ? prefill[l.prefill] : nullptr;
    const NodeReport* d = decode.count(l.decode) ? decode[l.decode] : nullptr;
    if (p && d && p->has_report && d->has_report && !p->kv_transport.empty() && !d->kv_transports.empty() &&
        std::find(d->kv_transports.begin(), d->kv_transports.end(), p->kv_transport) == d->kv_transports.end()) {
      out->push_back({"link", link_name(l),
                      "the prefill worker sends KV over " + p->kv_transport + ", which the decode worker does not "
                      "receive",
                      "give every prefill worker a --kv-transport its decode workers' build has (tcp works "
                      "everywhere)"});
    }
    if (!l.skipped.empty()) continue;  // a worker's own problem says why
    if (!l.error_code.empty()) {
      out->push_back({"link", link_name(l), "KV probe failed (" + l.error_code + ": " + l.error + ")", probe_fix(l)});
    } else if (l.seconds.empty() || l.bandwidth_bytes_per_second() <= 0) {
      out->push_back({"link", link_name(l), "the KV probe measured nothing", "see the prefill worker's log"});
    }
  }
}

}  // namespace

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[(v.size() - 1) / 2];
}

double LinkReport::bandwidth_bytes_per_second() const {
  const double s = median(seconds);
  return measured() && s > 0 ? static_cast<double>(bytes) / s : 0;
}

double LinkReport::latency_median_seconds() const { return measured() ? median(latency_seconds) : 0; }

std::string link_name(const LinkReport& link) { return link.prefill + " -> " + link.decode; }

std::string problem_subject(const Problem& p) {
  if (p.kind == "frontend") return "frontend " + p.address;
  if (p.kind == "link") return "link " + p.address;
  if (p.kind == "deployment") return "deployment";
  return p.kind + " worker " + p.address;
}

bool has_problem(const std::vector<Problem>& problems, const std::string& kind, const std::string& address) {
  return std::any_of(problems.begin(), problems.end(),
                     [&](const Problem& p) { return p.kind == kind && p.address == address; });
}

std::vector<Problem> doctor_problems(const DoctorReport& r, const DoctorLimits& limits) {
  std::vector<Problem> out;
  std::vector<const NodeReport*> nodes;
  if (r.frontend) nodes.push_back(&*r.frontend);
  for (const auto* list : {&r.prefill, &r.decode}) {
    for (const NodeReport& n : *list) nodes.push_back(&n);
  }
  // Each node's own problems first, then agreement, in table order.
  std::vector<Problem> agreement;
  check_agreement(r, &agreement);
  for (const NodeReport* n : nodes) {
    check_reachability(*n, r.internal_tls, &out);
    check_state(*n, &out);
    check_clock(*n, limits, &out);
    for (const Problem& p : agreement) {
      if (p.kind == n->role && p.address == n->address) out.push_back(p);
    }
  }
  check_links(r, &out);
  const bool frontend_known = !r.frontend || r.frontend->has_report;  // else the lists are unknown
  if (frontend_known && r.decode.empty()) {
    out.push_back({"deployment", "", "there are no decode workers",
                   r.frontend ? "give the frontend --decode-addresses or --decode-dns"
                              : "give doctor --decode-addresses (or --frontend)"});
  }
  if (frontend_known && r.frontend && r.prefill.empty() && r.local_prefill_max_tokens == 0) {
    out.push_back({"deployment", "", "there are no prefill workers and the decode workers prefill no prompts",
                   "give the frontend --prefill-addresses or --prefill-dns (or --local-prefill-max-tokens)"});
  }
  return out;
}

}  // namespace baton::ctl
