#include "client/load_runner.h"

#include <algorithm>
#include <optional>
#include <random>

#include "client/final_fields.h"
#include "common/seconds.h"

namespace baton::ctl {
namespace {

using Clock = LoadRunner::Clock;

}  // namespace

// One Generate call, owned by itself: created by the runner, deleted in OnDone (only there).
class BenchCall final : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  BenchCall(LoadRunner* runner, v1::GenerateRequest request, RequestSample* sample, Clock::time_point run_start,
            double timeout, const Connection& connection)
      : runner_(runner), request_(std::move(request)), sample_(sample), run_start_(run_start) {
    set_timeout(context_, timeout);
    authorize(context_, connection);
  }

  void start(v1::Generation::Stub* stub) {
    stub->async()->Generate(&context_, &request_, this);
    StartRead(&response_);
    start_ = Clock::now();
    sample_->sent_at = seconds_between(run_start_, start_);
    StartCall();
  }

  // Thread-safe; the call still ends through OnDone.
  void cancel() { context_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream is over: OnDone follows with the status
    const Clock::time_point now = Clock::now();
    if (response_.token_ids_size() > 0) {
      if (sample_->ttft < 0) {
        sample_->ttft = seconds_between(start_, now);
      } else {
        sample_->itl.push_back(seconds_between(last_token_, now));
      }
      last_token_ = now;
      sample_->n_output += response_.token_ids_size();
      sample_->output_ids.insert(sample_->output_ids.end(), response_.token_ids().begin(), response_.token_ids().end());
    }
    if (response_.has_final()) {
      const v1::FinalInfo& f = response_.final();
      sample_->has_final = true;
      sample_->n_prompt = f.usage().prompt_tokens();
      sample_->server_queue = f.timing().queue_seconds();
      sample_->server_prefill = f.timing().prefill_seconds();
      sample_->server_kv_transfer = f.timing().kv_transfer_seconds();
      sample_->server_decode_queue = f.timing().decode_queue_seconds();
      sample_->server_ttft = f.timing().ttft_seconds();
      sample_->server_e2e = f.timing().e2e_seconds();
      sample_->cached_prompt_tokens = cached_prompt_tokens(f.timing());
      if (!sample_->cached_prompt_tokens) sample_->cached_prompt_tokens = cached_prompt_tokens(f.usage());
    }
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    const Clock::time_point now = Clock::now();
    RequestSample* s = sample_;
    s->e2e = seconds_between(start_, now);
    s->finished_at = seconds_between(run_start_, now);
    s->code = status_code_name(status.error_code());
    s->ok = status.ok();
    if (!status.ok()) {
      s->error = status.error_message();
    } else if (!s->has_final) {
      s->ok = false;
      s->code = "NO_FINAL_MESSAGE";
      s->error = "the stream ended without a final message";
    }
    LoadRunner* runner = runner_;
    runner->detach(this);
    delete this;
    runner->finished(s);
  }

 private:
  LoadRunner* runner_;
  v1::GenerateRequest request_;
  RequestSample* sample_;  // written only by this call's callbacks (and start(), before them)
  Clock::time_point run_start_;
  grpc::ClientContext context_;
  v1::GenerateResponse response_;
  Clock::time_point start_;
  Clock::time_point last_token_;
};

void LoadRunner::send(WorkloadTurn turn, Clock::time_point arrival, const RequestShape& shape,
                      std::unique_lock<std::mutex>& lock) {
  RequestSample& sample = samples_.emplace_back();
  sample.conversation = turn.conversation;
  sample.turn = turn.turn;
  sample.n_prompt_sent = static_cast<int>(turn.prompt_ids.size());
  sample.arrival_at = seconds_between(run_start_, arrival);
  v1::GenerateRequest request;
  request.set_model(shape.model);
  request.mutable_prompt_token_ids()->Assign(turn.prompt_ids.begin(), turn.prompt_ids.end());
  request.set_max_tokens(shape.max_tokens);
  request.set_ignore_eos(true);
  auto* call = new BenchCall(this, std::move(request), &sample, run_start_, timeout_, connection_);
  calls_.insert(call);
  ++n_in_flight_;
  if (samples_.size() == 1) first_sent_ = Clock::now();
  lock.unlock();
  call->start(stub_);
  lock.lock();
}

std::vector<RequestSample> LoadRunner::run(Workload& workload, const RequestShape& shape, const Load& load) {
  std::mt19937_64 rng(load.seed ^ 0x9e3779b97f4a7c15ULL);
  // Poisson arrivals: independent exponential gaps of mean 1/rate.
  std::exponential_distribution<double> gap(load.rate > 0 ? load.rate : 1.0);
  const bool open_loop = load.rate > 0;
  const int bound = open_loop ? load.max_in_flight : load.concurrency;

  std::unique_lock lock(mu_);
  samples_.clear();
  done_.clear();
  n_delayed_ = 0;
  run_start_ = Clock::now();
  const Clock::time_point end =
      load.duration > 0
          ? run_start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(load.duration))
          : Clock::time_point::max();
  Clock::time_point next_arrival = run_start_;
  std::deque<WorkloadTurn> ready;  // next turns of answered conversations, waiting for a slot
  bool may_start = true;           // conversations may still start
  int n_active = 0;                // conversations started and not over
  bool arrival_waits = false;      // open loop: the due arrival found no slot (counted once)
  while (!stopping_) {
    const Clock::time_point now = Clock::now();
    if (now >= end) may_start = false;
    while (!done_.empty()) {
      RequestSample* s = done_.front();
      done_.pop_front();
      // A failed turn ends its conversation: there is no answer to continue from.
      std::optional<WorkloadTurn> next = s->ok ? workload.next_turn(s->conversation, s->output_ids) : std::nullopt;
      s->output_ids = {};  // the workload has what it needs
      if (next) {
        ready.push_back(std::move(*next));
      } else {
        --n_active;
      }
    }
    const bool slot = n_in_flight_ < bound;
    if (slot && !ready.empty()) {
      WorkloadTurn t = std::move(ready.front());
      ready.pop_front();
      send(std::move(t), now, shape, lock);
      continue;
    }
    if (may_start && open_loop && now >= next_arrival) {
      if (slot) {
        std::optional<WorkloadTurn> t = workload.start_conversation();
        if (!t) {
          may_start = false;
          continue;
        }
        ++n_active;
        arrival_waits = false;
        const Clock::time_point due = next_arrival;
        next_arrival += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(rng)));
        send(std::move(*t), due, shape, lock);
        continue;
      }
      if (!arrival_waits) ++n_delayed_;
      arrival_waits = true;
    }
    if (may_start && !open_loop && n_active < load.concurrency) {
      std::optional<WorkloadTurn> t = workload.start_conversation();
      if (!t) {
        may_start = false;
        continue;
      }
      ++n_active;
      send(std::move(*t), now, shape, lock);
      continue;
    }
    if (!may_start && n_active == 0) break;
    // Until a request finishes, the next arrival is due or the duration ends.
    Clock::time_point wake = Clock::time_point::max();
    if (may_start) {
      wake = end;
      if (open_loop && now < next_arrival) wake = std::min(wake, next_arrival);
    }
    if (wake == Clock::time_point::max()) {
      cv_.wait(lock, [&] { return stopping_ || !done_.empty(); });
    } else {
      cv_.wait_until(lock, wake, [&] { return stopping_ || !done_.empty(); });
    }
  }
  cv_.wait(lock, [&] { return n_in_flight_ == 0; });
  done_.clear();
  wall_seconds_ = samples_.empty() ? 0 : seconds_between(first_sent_, last_done_);
  std::vector<RequestSample> out(std::make_move_iterator(samples_.begin()), std::make_move_iterator(samples_.end()));
  samples_.clear();
  return out;
}

void LoadRunner::cancel_all() {
  std::lock_guard lock(mu_);
  stopping_ = true;
  for (BenchCall* call : calls_) call->cancel();
  cv_.notify_all();
}

void LoadRunner::detach(BenchCall* call) {
  std::lock_guard lock(mu_);
  calls_.erase(call);
}

void LoadRunner::finished(RequestSample* sample) {
  std::lock_guard lock(mu_);
  --n_in_flight_;
  last_done_ = Clock::now();
  done_.push_back(sample);
  cv_.notify_all();  // under the lock: run() may return, and the runner go, right after
}

}  // namespace baton::ctl
