// Skipped tests that say so. Catch2 v2 (Debian 12) has no SKIP(): a test that returns early would
// count as passed. BATON_SKIP(reason) records the running test case's name and the reason, prints
// "SKIPPED: <test>: <reason>", and returns from the test. The test binaries' mains
// (tests/common/test_main.cpp) end with skip_summary(): the list of skipped tests, by name and
// reason; exit code 77 (ctest's "Skipped", SKIP_RETURN_CODE) when every test case that ran was
// skipped; and a failure when BATON_TEST_FAIL_ON_SKIP=1 (tests/gpu/run.sh sets it: a test it was
// meant to run must not pass by skipping).
#pragma once

#include <catch2/catch.hpp>
#include <sstream>
#include <string>

namespace baton::testing {

// Records that the current test case is skipped, and why. Use through BATON_SKIP.
void skip_record(const std::string& reason);

// The summary at the end of a run. `rc` is what Catch::Session::run returned; the result is the
// binary's exit code.
int skip_summary(int rc);

}  // namespace baton::testing

#define BATON_SKIP(reason_stream)                              \
  do {                                                         \
    std::ostringstream baton_skip_reason_;                     \
    baton_skip_reason_ << reason_stream;                       \
    ::baton::testing::skip_record(baton_skip_reason_.str());   \
    return;                                                    \
  } while (false)
