// Names the calling thread, as `top -H`, `ps -L`, gdb and /proc/PID/task/TID/comm show it: an
// operator (or a test) can then find the step loop among a role's threads. Linux keeps 15 bytes.
#pragma once

#include <pthread.h>

#include <string>

namespace baton {

inline void set_thread_name(const std::string& name) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
}

}  // namespace baton
