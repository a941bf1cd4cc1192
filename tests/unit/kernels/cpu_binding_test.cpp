// CPU sets and the CPU backend's thread binding: an engine's step thread and its OpenMP team run
// on the cores the backend was given, as many threads as asked, at the niceness asked.
#include <omp.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cerrno>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/cpu_set.h"
#include "kernels/backend.h"

namespace baton {
namespace {

std::vector<int> this_thread_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof(set), &set) == 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

int this_thread_nice() {
  errno = 0;
  const int n = getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
  REQUIRE(errno == 0);
  return n;
}

}  // namespace

TEST_CASE("cpu lists parse, format and refuse what is not a list", "[cpu_set]") {
  const std::vector<int> allowed = allowed_cpus();
  REQUIRE_FALSE(allowed.empty());
  CHECK(allowed == this_thread_cpus());
  // A random subset of the allowed CPUs round-trips through its text form.
  std::mt19937 rng(std::random_device{}());
  std::vector<int> subset;
  for (int c : allowed) {
    if (rng() % 2 == 0) subset.push_back(c);
  }
  if (subset.empty()) subset.push_back(allowed.front());
  const std::string text = format_cpu_list(subset);
  auto parsed = parse_cpu_list(text, "--cpus");
  REQUIRE(parsed.ok());
  CHECK(*parsed == subset);

  CHECK(format_cpu_list(std::vector<int>{0, 1, 2, 3, 6, 8, 9}) == "0-3,6,8-9");
  for (const char* bad : {"", "x", "1-", "-1", "3-1", "0,,1", "1.5", "99999"}) {
    auto r = parse_cpu_list(bad, "--cpus");
    INFO(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK(r.status().message().find("--cpus") != std::string::npos);
  }
  // A CPU this process may not run on is named.
  const int outside = allowed.back() + 1;
  auto r = parse_cpu_list(std::to_string(outside), "--decode-cpus");
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().message().find("CPU " + std::to_string(outside)) != std::string::npos);
}

TEST_CASE("cpu sets split in two, one core is shared", "[cpu_set]") {
  const std::vector<int> cpus = {2, 3, 5, 7, 11};
  for (size_t n = 0; n <= cpus.size() + 1; ++n) {
    const CpuSplit s = split_cpus(cpus, n);
    const size_t want = std::clamp<size_t>(n, 1, cpus.size() - 1);
    CHECK(s.first.size() == want);
    std::vector<int> joined = s.first;
    joined.insert(joined.end(), s.second.begin(), s.second.end());
    CHECK(joined == cpus);
  }
  const CpuSplit one = split_cpus(std::vector<int>{4}, 1);
  CHECK(one.first == std::vector<int>{4});
  CHECK(one.second == std::vector<int>{4});
}

TEST_CASE("the CPU backend binds a step thread and its team to its cores", "[cpu_set]") {
  const std::vector<int> allowed = allowed_cpus();
  const std::vector<int> mine = {allowed.back()};
  for (int n_threads : {0, 2}) {
    BackendOptions options;
    options.dtype = DType::kF32;
    options.n_threads = n_threads;
    options.cpus = mine;
    std::string error;
    auto backend = make_backend(options, &error);
    REQUIRE(backend != nullptr);
    std::set<std::vector<int>> team_sets;
    int team_size = 0, max_threads = 0;
    Status bound;
    std::thread engine([&] {
      bound = backend->bind_thread();
      max_threads = omp_get_max_threads();
#pragma omp parallel
      {
#pragma omp critical
        team_sets.insert(this_thread_cpus());
#pragma omp single
        team_size = omp_get_num_threads();
      }
    });
    engine.join();
    INFO("n_threads " << n_threads);
    REQUIRE(bound.ok());
    const int want = n_threads > 0 ? n_threads : 1;  // one per core given
    CHECK(max_threads == want);
    CHECK(team_size == want);
    CHECK(team_sets == std::set<std::vector<int>>{mine});
  }
  // Not pinned, no count: the thread keeps what it had.
  BackendOptions options;
  options.dtype = DType::kF32;
  std::string error;
  auto backend = make_backend(options, &error);
  REQUIRE(backend != nullptr);
  std::vector<int> after;
  std::thread t([&] {
    REQUIRE(backend->bind_thread().ok());
    after = this_thread_cpus();
  });
  t.join();
  CHECK(after == allowed);
}

TEST_CASE("a backend given a niceness runs its step thread and team at it, and no other thread", "[cpu_set]") {
  const int before = this_thread_nice();
  std::mt19937 rng(std::random_device{}());
  const int nice = std::min(19, before + 1 + static_cast<int>(rng() % 9));
  BackendOptions options;
  options.dtype = DType::kF32;
  options.n_threads = 2;
  options.nice = nice;
  std::string error;
  auto backend = make_backend(options, &error);
  REQUIRE(backend != nullptr);
  Status bound;
  int step_nice = -100;
  std::set<int> team_nice;
  std::thread engine([&] {
    bound = backend->bind_thread();
    step_nice = this_thread_nice();
#pragma omp parallel
    {
      const int n = this_thread_nice();
#pragma omp critical
      team_nice.insert(n);
    }
  });
  engine.join();
  REQUIRE(bound.ok());
  CHECK(step_nice == nice);
  CHECK(team_nice == std::set<int>{nice});
  // The calling thread and its own team are untouched.
  CHECK(this_thread_nice() == before);
  std::set<int> main_team;
#pragma omp parallel num_threads(2)
  {
    const int n = this_thread_nice();
#pragma omp critical
    main_team.insert(n);
  }
  CHECK(main_team == std::set<int>{before});
}

}  // namespace baton
