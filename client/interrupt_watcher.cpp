#include "client/interrupt_watcher.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>

namespace baton::ctl {
namespace {

sigset_t interrupt_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

}  // namespace

InterruptWatcher::InterruptWatcher() {
  sigset_t set = interrupt_signals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  thread_ = std::thread([this] { watch(); });
}

InterruptWatcher::~InterruptWatcher() {
  stopping_ = true;
  thread_.join();
}

void InterruptWatcher::on_interrupt(std::function<void()> handler) {
  std::lock_guard lock(mu_);
  handler_ = std::move(handler);
  if (interrupted_ && handler_) handler_();
}

void InterruptWatcher::watch() {
  const sigset_t set = interrupt_signals();
  // Polls so that the destructor needs no signal of its own to stop the thread.
  const timespec tick{0, 100 * 1000 * 1000};
  while (!stopping_) {
    const int sig = sigtimedwait(&set, nullptr, &tick);
    if (sig < 0) continue;                        // EAGAIN (tick) or EINTR
    if (interrupted_.exchange(true)) _exit(130);  // the second Ctrl-C: the user means it
    std::lock_guard lock(mu_);
    if (handler_) handler_();
  }
}

}  // namespace baton::ctl
