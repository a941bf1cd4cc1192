// The Catch2 main of the unit and GPU test binaries, with the skip bookkeeping of test_skip.h.
// A binary that needs a check before any test runs (the GPU tests: is there a device?) defines
// BATON_TEST_PRECHECK to a function returning -1 to go on, or the exit code to stop with.
#define CATCH_CONFIG_RUNNER
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <vector>

#include "tests/common/test_skip.h"

namespace baton::testing {
namespace {

struct Skip {
  std::string test;
  std::string reason;
};

struct Book {
  std::mutex mu;
  std::vector<Skip> skips;
  std::set<std::string> started;  // test cases that began, by name
  std::string current;
};

Book& book() {
  static Book b;
  return b;
}

// Counts the test cases that run and knows the current one's name.
struct SkipListener : Catch::TestEventListenerBase {
  using TestEventListenerBase::TestEventListenerBase;
  void testCaseStarting(const Catch::TestCaseInfo& info) override {
    std::lock_guard<std::mutex> lock(book().mu);
    book().started.insert(info.name);
    book().current = info.name;
  }
};

}  // namespace

void skip_record(const std::string& reason) {
  std::lock_guard<std::mutex> lock(book().mu);
  for (const Skip& s : book().skips) {
    if (s.test == book().current) return;  // once per test case (sections and generators re-enter)
  }
  book().skips.push_back({book().current, reason});
  std::printf("SKIPPED: %s: %s\n", book().current.c_str(), reason.c_str());
  std::fflush(stdout);
}

int skip_summary(int rc) {
  std::lock_guard<std::mutex> lock(book().mu);
  const std::vector<Skip>& skips = book().skips;
  if (skips.empty()) return rc;
  std::printf("%zu test case(s) skipped, %zu ran:\n", skips.size(), book().started.size() - skips.size());
  for (const Skip& s : skips) std::printf("  SKIPPED: %s: %s\n", s.test.c_str(), s.reason.c_str());
  const char* strict = std::getenv("BATON_TEST_FAIL_ON_SKIP");
  if (strict != nullptr && std::string(strict) == "1") {
    std::printf("FAILED: BATON_TEST_FAIL_ON_SKIP=1 and %zu test case(s) did not run\n", skips.size());
    return rc != 0 ? rc : 1;
  }
  if (rc == 0 && skips.size() == book().started.size()) return 77;
  return rc;
}

}  // namespace baton::testing

using BatonSkipListener = baton::testing::SkipListener;
CATCH_REGISTER_LISTENER(BatonSkipListener)

#ifdef BATON_TEST_PRECHECK
int BATON_TEST_PRECHECK();
#endif

int main(int argc, char** argv) {
#ifdef BATON_TEST_PRECHECK
  if (const int stop = BATON_TEST_PRECHECK(); stop >= 0) return stop;
#endif
  const int rc = Catch::Session().run(argc, argv);
  return baton::testing::skip_summary(rc);
}
