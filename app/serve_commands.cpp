#include "app/serve_commands.h"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "common/cpu_set.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "server/metrics_server.h"
#include "app/engine_commands.h"
#include "app/serve_flags.h"
#include "app/serve_roles.h"

namespace baton {
namespace {

int fail(const Status& s) { return exit_with_error(s); }

// Blocks until SIGINT or SIGTERM.
void wait_for_signal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int sig = 0;
  sigwait(&set, &sig);
  spdlog::info("signal {}: shutting down", sig);
}

// Signals are taken by wait_for_signal() only: block them before any thread starts.
void block_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

// Scripts and tests read the ports from these stdout lines (useful with --listen HOST:0): the
// HTTP API's first, when there is one, then the gRPC port, which says the role is up.
void print_listening(int port, const HttpApi* http = nullptr) {
  if (http != nullptr) std::printf("http listening on port %d\n", http->port());
  std::printf("listening on port %d\n", port);
  std::fflush(stdout);
}

// The /metrics endpoint, when --metrics-listen asks for one (else null). It outlives the roles.
Result<std::unique_ptr<MetricsServer>> start_metrics_server(const std::string& listen, Metrics& metrics) {
  if (listen.empty()) return std::unique_ptr<MetricsServer>();
  return MetricsServer::start(listen, metrics.registry());
}

// A worker role (DecodeRole, PrefillRole) that started: its stall watch and health, until a
// signal, then its drain. Returns the exit code: 0 after the drain, else the failed start's.
template <class WorkerRole>
int serve_worker(Result<std::unique_ptr<WorkerRole>> r, const ServeArgs& a, const char* what) {
  if (!r.ok()) return fail(r.status());
  watch_worker(**r, a.stall_timeout, what);
  spdlog::info("{} serving on port {}", what, (*r)->server->port());
  if (Status s = add_health(*(*r)->server, a); !s.ok()) return fail(s);
  print_listening((*r)->server->port());
  wait_for_signal();
  (*r)->drain(std::chrono::seconds(a.drain_timeout));
  spdlog::info("drained; exiting");
  return 0;
}

// Graceful drain on SIGTERM (all roles): health turns NOT_SERVING and the role reports
// `draining` in its load report (frontends route around it), new calls are refused with
// UNAVAILABLE, and in-flight calls get up to --drain-timeout seconds to finish before the server
// cancels them; then the engines stop and the process exits 0.
int run_serve(const ServeArgs& a) {
  block_signals();
  if (Status s = init_logging(a.log_level, a.log_format); !s.ok()) return fail(s);
  if (Status s = check_kv_transport(a.kv_transport); !s.ok()) return fail(s);
  if (a.role != "frontend" && !a.http_listen.empty()) {
    return fail(invalid_argument("--http-listen serves the public API: give it to the frontend (or baton local), not "
                                 "to a " + a.role + " worker"));
  }
  auto sec = make_security(a);
  if (!sec.ok()) return fail(sec.status());
  if (Status s = check_exposure(a, a.role, *sec); !s.ok()) return fail(s);
  Result<std::vector<int>> cpus = std::vector<int>{};
  if (!a.cpus.empty()) cpus = parse_cpu_list(a.cpus, "--cpus");
  if (!cpus.ok()) return fail(cpus.status());
  Metrics metrics;
  auto metrics_server = start_metrics_server(a.metrics_listen, metrics);
  if (!metrics_server.ok()) return fail(metrics_server.status());
  const std::string name = a.name.empty() ? a.listen : a.name;
  if (a.role == "decode") return serve_worker(start_decode(a, *sec, a.listen, name, *cpus, &metrics), a, "decode worker");
  if (a.role == "prefill") {
    return serve_worker(start_prefill(a, *sec, a.listen, name, *cpus, &metrics), a, "prefill worker");
  }
  auto r = start_frontend(a, *sec, a.listen, name, split_list(a.prefill_addresses), split_list(a.decode_addresses),
                          &metrics);
  if (!r.ok()) return fail(r.status());
  spdlog::info("frontend serving on port {}{}", (*r)->server->port(),
               (*r)->http ? ", HTTP API on port " + std::to_string((*r)->http->port()) : std::string());
  if (Status s = add_health(*(*r)->server, a); !s.ok()) return fail(s);
  print_listening((*r)->server->port(), (*r)->http.get());
  wait_for_signal();
  (*r)->drain(std::chrono::seconds(a.drain_timeout));
  spdlog::info("drained; exiting");
  return 0;
}

// Which cores each engine of `baton local` owns. Decode steps are memory-bound and prefill steps
// compute-bound: by default the decode engines get the first half of the allowed cores (at least
// one) and the prefill engines, with everything else, the rest. Engines of one kind split their
// part when it has a core for each, and share it otherwise. One core: everything shares it.
struct LocalCores {
  std::vector<int> decode_all, prefill_all;
  std::vector<std::vector<int>> decode, prefill;  // per engine
};

Result<LocalCores> local_cores(const ServeArgs& a) {
  const std::vector<int> allowed = allowed_cpus();
  // Colocated (no prefill workers): the decode engines get every core.
  const CpuSplit split = a.n_prefill_workers == 0 ? CpuSplit{allowed, allowed} : split_cpus(allowed, allowed.size() / 2);
  auto pick = [&](const std::string& flag, const std::string& value,
                  const std::vector<int>& automatic) -> Result<std::vector<int>> {
    if (value.empty()) return automatic;
    if (value == "all") return allowed;
    return parse_cpu_list(value, flag);
  };
  LocalCores c;
  BATON_ASSIGN_OR_RETURN(c.decode_all, pick("--decode-cpus", a.decode_cpus, split.first));
  BATON_ASSIGN_OR_RETURN(c.prefill_all, pick("--prefill-cpus", a.prefill_cpus, split.second));
  auto per_engine = [](const std::vector<int>& cpus, int n) {
    std::vector<std::vector<int>> out(static_cast<size_t>(n), cpus);
    if (static_cast<int>(cpus.size()) < n || n <= 1) return out;
    const size_t each = cpus.size() / static_cast<size_t>(n);
    for (int i = 0; i < n; ++i) {
      const auto begin = cpus.begin() + static_cast<std::ptrdiff_t>(i * each);
      out[static_cast<size_t>(i)].assign(begin, i + 1 == n ? cpus.end() : begin + static_cast<std::ptrdiff_t>(each));
    }
    return out;
  };
  c.decode = per_engine(c.decode_all, a.n_decode_workers);
  c.prefill = per_engine(c.prefill_all, a.n_prefill_workers);
  return c;
}

int run_local(const ServeArgs& a) {
  block_signals();
  if (a.n_prefill_workers == 0 && a.local_prefill_max_tokens == 0) {
    return fail(invalid_argument("baton local --prefill-workers 0 leaves no one to prefill: give "
                                 "--local-prefill-max-tokens N so the decode workers prefill prompts themselves"));
  }
  if (Status s = init_logging(a.log_level, a.log_format); !s.ok()) return fail(s);
  auto cores = local_cores(a);
  if (!cores.ok()) return fail(cores.status());
  // Everything but the engines' step loops (loading, the frontend, gRPC's threads, KV senders)
  // runs on the prefill cores: threads inherit the set of the thread that makes them, so this
  // comes before anything starts a thread (gRPC's among them).
  if (Status s = pin_current_thread(cores->prefill_all); !s.ok()) return fail(s);
  spdlog::info("baton local: decode engines on CPUs {}, prefill engines and the rest on CPUs {}",
               format_cpu_list(cores->decode_all), format_cpu_list(cores->prefill_all));
  if (Status s = check_kv_transport(a.kv_transport); !s.ok()) return fail(s);
  auto sec = make_security(a);
  if (!sec.ok()) return fail(sec.status());
  if (Status s = check_exposure(a, "local", *sec); !s.ok()) return fail(s);
  if (a.kv_transport != "tcp") {
    // A CUDA IPC handle cannot be opened by the process that made it, and NCCL refuses two ranks
    // on one device: the device transports connect separate prefill and decode processes.
    return fail(invalid_argument("baton local runs every role in one process: --kv-transport=" + a.kv_transport +
                                 " needs separate prefill and decode processes (baton serve --role=...); use tcp"));
  }
  const auto grace = std::chrono::seconds(a.drain_timeout);
  Metrics metrics;
  auto metrics_server = start_metrics_server(a.metrics_listen, metrics);
  if (!metrics_server.ok()) return fail(metrics_server.status());
  std::vector<std::unique_ptr<DecodeRole>> decoders;
  std::vector<std::unique_ptr<PrefillRole>> prefillers;
  std::vector<std::string> decode_addrs, prefill_addrs;
  for (int i = 0; i < a.n_decode_workers; ++i) {
    auto r = start_decode(a, *sec, "127.0.0.1:0", "decode-" + std::to_string(i), cores->decode[i], &metrics);
    if (!r.ok()) return fail(r.status());
    decode_addrs.push_back("127.0.0.1:" + std::to_string((*r)->server->port()));
    decoders.push_back(std::move(*r));
  }
  for (int i = 0; i < a.n_prefill_workers; ++i) {
    auto r = start_prefill(a, *sec, "127.0.0.1:0", "prefill-" + std::to_string(i), cores->prefill[i], &metrics);
    if (!r.ok()) return fail(r.status());
    prefill_addrs.push_back("127.0.0.1:" + std::to_string((*r)->server->port()));
    prefillers.push_back(std::move(*r));
  }
  auto fe = start_frontend(a, *sec, a.listen, a.name.empty() ? "frontend" : a.name, prefill_addrs, decode_addrs, &metrics);
  if (!fe.ok()) return fail(fe.status());
  spdlog::info("baton local: frontend on port {}{}, {} prefill and {} decode workers", (*fe)->server->port(),
               (*fe)->http ? ", HTTP API on port " + std::to_string((*fe)->http->port()) : std::string(),
               prefillers.size(), decoders.size());
  if (Status s = add_health(*(*fe)->server, a); !s.ok()) return fail(s);
  print_listening((*fe)->server->port(), (*fe)->http.get());
  wait_for_signal();
  // The frontend drains first (its in-flight requests still need the workers), then the workers.
  (*fe)->drain(grace);
  for (auto& p : prefillers) p->drain(std::chrono::seconds(5));
  for (auto& d : decoders) d->drain(std::chrono::seconds(5));
  spdlog::info("drained; exiting");
  return 0;
}

// The engines of `baton local` share the cores: with OpenMP's default spin-waiting, a thread of
// one engine's team burns the core another engine's team needs. libgomp reads its wait policy
// when the program starts, so `local` re-executes itself once with OMP_WAIT_POLICY=PASSIVE.
void ensure_passive_openmp(int argc, char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  std::vector<char*> args(argv, argv + argc);
  args.push_back(nullptr);
  execv("/proc/self/exe", args.data());
  // execv failed: carry on with spinning threads (slower, still correct).
}

}  // namespace

void add_serve_commands(CLI::App& app, std::function<int()>* run, int argc, char** argv) {
  auto serve = std::make_shared<ServeArgs>();
  CLI::App* s = app.add_subcommand("serve", "Run one role: frontend, prefill or decode worker");
  s->add_option("--role", serve->role, "frontend | prefill | decode")
      ->required()
      ->check(CLI::IsMember({"frontend", "prefill", "decode"}))
      ->envname("BATON_ROLE");
  add_serve_flags(s, *serve);
  s->add_option("--cpus", serve->cpus, "CPUs the engine's step threads own, e.g. 0-3 (default: any)")
      ->envname("BATON_CPUS");
  s->callback([serve, run] { *run = [serve] { return run_serve(*serve); }; });

  auto local = std::make_shared<ServeArgs>();
  local->listen = "127.0.0.1:50051";
  CLI::App* l = app.add_subcommand("local", "All roles in one process over loopback gRPC (one /metrics)");
  add_serve_flags(l, *local);
  l->add_option("--prefill-workers", local->n_prefill_workers,
                "Prefill workers (0: every prompt is prefilled by a decode worker: needs --local-prefill-max-tokens)")
      ->check(CLI::Range(0, 64));
  l->add_option("--decode-workers", local->n_decode_workers, "Decode workers")->check(CLI::Range(1, 64));
  l->add_option("--decode-cpus", local->decode_cpus,
                "CPUs of the decode engines, e.g. 0-1, or all (default: the first half of the allowed CPUs)")
      ->envname("BATON_DECODE_CPUS");
  l->add_option("--prefill-cpus", local->prefill_cpus,
                "CPUs of the prefill engines and everything else, or all (default: the CPUs decode does not own)")
      ->envname("BATON_PREFILL_CPUS");
  l->callback([local, run, argc, argv] {
    ensure_passive_openmp(argc, argv);
    *run = [local] { return run_local(*local); };
  });
}

}  // namespace baton
