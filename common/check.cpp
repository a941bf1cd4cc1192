#include "common/check.h"

#include <cstdarg>

namespace baton::detail {

void check_failed(const char* file, int line, const char* cond, const char* fmt, ...) {
  std::fprintf(stderr, "baton: internal error at %s:%d: check `%s` failed: ", file, line, cond);
  va_list args;
  va_start(args, fmt);
  std::vfprintf(stderr, fmt, args);
  va_end(args);
  std::fputc('\n', stderr);
  std::abort();
}

}  // namespace baton::detail
