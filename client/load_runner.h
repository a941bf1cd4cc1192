// The load generator of `batonctl bench`: sends a workload's turns as Generate calls, closed
// loop (--concurrency C: at most C conversations in progress, each with one request in flight)
// or open loop (--rate R: conversations start at Poisson arrivals, exponential gaps of mean 1/R
// drawn from --seed, at most --max-in-flight requests in flight; an arrival that finds them all
// busy waits and is counted). A conversation's next turn is sent as soon as its previous one is
// answered, before any new conversation starts. Every call is timestamped on the gRPC callback
// thread that delivers its messages.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "baton/v1/generate.grpc.pb.h"
#include "client/bench_report.h"
#include "client/bench_workload.h"
#include "client/channel.h"

namespace baton::ctl {

class BenchCall;

struct Load {
  int concurrency = 0;    // > 0: closed loop, conversations in progress
  double rate = 0;        // > 0: open loop, conversation arrivals per second
  int max_in_flight = 0;  // open loop's bound on requests in flight
  uint64_t seed = 0;      // arrival times
  double duration = 0;    // > 0: no conversation starts later than this many seconds into the run
};

// What every request asks for besides its prompt.
struct RequestShape {
  std::string model;
  int max_tokens = 0;  // with ignore_eos
};

class LoadRunner {
 public:
  using Clock = std::chrono::steady_clock;

  // `stub` and `connection` (its API key) must outlive the runner.
  LoadRunner(v1::Generation::Stub* stub, double timeout, const Connection& connection)
      : stub_(stub), timeout_(timeout), connection_(connection) {}

  // Runs `workload` to its end (or the duration's, or cancel_all()) and returns a sample for
  // every request sent, in the order they were sent. Returns when every sent request has
  // finished: no call is alive then.
  std::vector<RequestSample> run(Workload& workload, const RequestShape& shape, const Load& load);

  // Stops issuing and cancels the calls in flight (from the interrupt watcher's thread).
  void cancel_all();

  // First request sent → last one finished, of the latest run().
  double wall_seconds() const { return wall_seconds_; }
  // Open loop: arrivals that found --max-in-flight requests running and were sent late.
  int n_delayed() const { return n_delayed_; }

  // A call's OnDone reports in two steps around deleting itself: detach() before (so that
  // cancel_all() no longer reaches it), finished() after (so that when run() returns no reactor
  // or ClientContext is still alive, and the process may tear gRPC down).
  void detach(BenchCall* call);
  void finished(RequestSample* sample);

 private:
  // Starts one call for `turn`, due at `arrival`. Called with `lock` held; releases it meanwhile.
  void send(WorkloadTurn turn, Clock::time_point arrival, const RequestShape& shape,
            std::unique_lock<std::mutex>& lock);

  v1::Generation::Stub* stub_;
  double timeout_;
  const Connection& connection_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::set<BenchCall*> calls_;         // in flight; guarded by mu_
  std::deque<RequestSample> samples_;  // one per sent request (stable addresses); appended under mu_
  std::deque<RequestSample*> done_;    // finished, their conversation not yet advanced; guarded by mu_
  int n_in_flight_ = 0;                // guarded by mu_
  bool stopping_ = false;              // guarded by mu_
  int n_delayed_ = 0;                  // guarded by mu_
  Clock::time_point run_start_;        // the first request's scheduled send
  Clock::time_point first_sent_;
  Clock::time_point last_done_;  // guarded by mu_
  double wall_seconds_ = 0;
};

}  // namespace baton::ctl
