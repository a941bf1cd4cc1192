#include "common/progress.h"

#include <unistd.h>

#include <cstdio>
#include <memory>

namespace baton {

std::function<void(int, int)> load_progress_reporter(const std::string& what,
                                                     std::function<void(const std::string&)> log) {
  const bool tty = isatty(STDERR_FILENO) == 1;
  auto last_quarter = std::make_shared<int>(-1);
  return [what, log, tty, last_quarter](int done, int total) {
    if (total <= 0) return;
    if (tty) {
      constexpr int kWidth = 30;
      const int filled = done * kWidth / total;
      std::fprintf(stderr, "\rloading %s [%s%s] %d/%d layers", what.c_str(), std::string(filled, '#').c_str(),
                   std::string(kWidth - filled, '.').c_str(), done, total);
      if (done == total) std::fputc('\n', stderr);
      std::fflush(stderr);
      return;
    }
    const int quarter = done * 4 / total;
    if (quarter == *last_quarter) return;
    *last_quarter = quarter;
    const std::string line = "loading " + what + ": " + std::to_string(done) + "/" + std::to_string(total) + " layers";
    if (log) {
      log(line);
    } else {
      std::fprintf(stderr, "baton: %s\n", line.c_str());
    }
  };
}

}  // namespace baton
