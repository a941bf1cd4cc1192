// Ctrl-C for a process whose work sits inside gRPC: SIGINT/SIGTERM are blocked in every thread
// and taken by one watcher thread with sigtimedwait, so the handler may do anything (cancel
// calls, take locks) — nothing runs in signal context. A second signal exits at once (130).
#pragma once

#include <atomic>
#include <functional>
#include <mutex>
#include <thread>

namespace baton::ctl {

class InterruptWatcher {
 public:
  // Blocks SIGINT and SIGTERM in the calling thread, so construct it before any other thread
  // starts (before the first gRPC channel): threads inherit the mask.
  InterruptWatcher();
  ~InterruptWatcher();
  InterruptWatcher(const InterruptWatcher&) = delete;
  InterruptWatcher& operator=(const InterruptWatcher&) = delete;

  // Runs `handler` on the watcher thread at the first signal (at once if one already came).
  // Replaces the previous handler; an empty one clears it.
  void on_interrupt(std::function<void()> handler);
  bool interrupted() const { return interrupted_.load(); }

 private:
  void watch();

  std::atomic<bool> interrupted_{false};
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::function<void()> handler_;  // guarded by mu_
  std::thread thread_;
};

}  // namespace baton::ctl
