// Invariant checks: a failed BATON_CHECK is a bug in baton, not bad input. It prints file:line and
// the formatted message, then aborts. Recoverable errors use baton::Status (common/status.h).
#pragma once

#include <cstdio>
#include <cstdlib>

namespace baton::detail {
[[noreturn]] void check_failed(const char* file, int line, const char* cond, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));
}  // namespace baton::detail

#define BATON_CHECK(cond, ...)                                                      \
  do {                                                                              \
    if (!(cond)) [[unlikely]]                                                       \
      ::baton::detail::check_failed(__FILE__, __LINE__, #cond, __VA_ARGS__);        \
  } while (0)
