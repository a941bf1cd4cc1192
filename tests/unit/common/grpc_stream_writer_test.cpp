// GrpcStreamWriter's contract (common/grpc_stream_writer.h) against a scripted reactor that
// checks gRPC's rules on every call: one write in flight, nothing after Finish, Finish once.
#include "common/grpc_stream_writer.h"

#include <catch2/catch.hpp>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace baton {
namespace {

struct ScriptedReactor {
  std::mutex mu;
  std::vector<std::string> written;  // in the order StartWrite was called
  int n_finish = 0;
  grpc::StatusCode finished_with = grpc::StatusCode::UNKNOWN;
  bool in_flight = false;
  int violations = 0;  // a write started while one was in flight, or anything after Finish
  // When set, StartWrite completes the write inline with this result (gRPC may run callbacks
  // inline), through the writer it is given.
  std::function<void()> on_start;

  void StartWrite(const std::string* msg) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (in_flight || n_finish > 0) ++violations;
      in_flight = true;
      written.push_back(*msg);
    }
    if (on_start) on_start();
  }
  int finishes() {
    std::lock_guard<std::mutex> lock(mu);
    return n_finish;
  }
  void Finish(grpc::Status status) {
    std::lock_guard<std::mutex> lock(mu);
    if (in_flight || n_finish > 0) ++violations;
    ++n_finish;
    finished_with = status.error_code();
  }
  // gRPC's OnWriteDone, as the reactor forwards it.
  template <typename W>
  bool complete(W& writer, bool ok) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!in_flight) ++violations;  // a completion without a write
      in_flight = false;
    }
    return writer.on_write_done(ok);
  }
};

using Writer = GrpcStreamWriter<std::string, ScriptedReactor>;

TEST_CASE("stream writer: one write in flight, in order, then Finish once", "[stream_writer]") {
  ScriptedReactor r;
  Writer w(&r);
  REQUIRE(w.write("a"));
  REQUIRE(w.write("b"));
  REQUIRE(w.write("c"));
  CHECK(r.written == std::vector<std::string>{"a"});
  REQUIRE(r.complete(w, true));
  CHECK(r.written == std::vector<std::string>{"a", "b"});
  REQUIRE(w.finish(grpc::Status::OK));  // finish while writes are queued: they go first
  CHECK(r.n_finish == 0);
  REQUIRE(r.complete(w, true));
  CHECK(r.n_finish == 0);
  REQUIRE(r.complete(w, true));
  CHECK(r.written == std::vector<std::string>{"a", "b", "c"});
  CHECK(r.n_finish == 1);
  CHECK(r.finished_with == grpc::StatusCode::OK);
  CHECK(r.violations == 0);
}

TEST_CASE("stream writer: finish with kDrop ends after the write in flight", "[stream_writer]") {
  ScriptedReactor r;
  Writer w(&r);
  w.write("a");
  w.write("b");
  w.write("c");
  REQUIRE(w.finish(grpc::Status(grpc::StatusCode::ABORTED, "x"), Writer::Queued::kDrop));
  CHECK(r.n_finish == 0);  // "a" is in flight: no Finish under it
  REQUIRE(r.complete(w, true));
  CHECK(r.written == std::vector<std::string>{"a"});
  CHECK(r.n_finish == 1);
  CHECK(r.finished_with == grpc::StatusCode::ABORTED);
  CHECK(r.violations == 0);
}

TEST_CASE("stream writer: a write or a finish after the end is decided is dropped", "[stream_writer]") {
  ScriptedReactor r;
  Writer w(&r);
  REQUIRE(w.finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "x")));
  CHECK(r.n_finish == 1);  // nothing queued: at once
  CHECK(w.ending());
  CHECK_FALSE(w.write("late"));
  CHECK_FALSE(w.finish(grpc::Status::OK));
  w.on_cancel();
  CHECK(r.written.empty());
  CHECK(r.n_finish == 1);
  CHECK(r.finished_with == grpc::StatusCode::NOT_FOUND);
  CHECK(r.violations == 0);
}

TEST_CASE("stream writer: cancel during a write finishes CANCELLED once the write returns", "[stream_writer]") {
  ScriptedReactor r;
  Writer w(&r);
  w.write("a");
  w.write("b");
  w.on_cancel();
  CHECK(w.ending());
  CHECK(r.n_finish == 0);  // "a" is still in flight
  CHECK_FALSE(w.write("c"));
  CHECK_FALSE(w.finish(grpc::Status::OK));  // the owner's end, after it cancelled its work
  CHECK_FALSE(r.complete(w, false));         // gRPC fails the write of a cancelled call
  CHECK(r.written == std::vector<std::string>{"a"});
  CHECK(r.n_finish == 1);
  CHECK(r.finished_with == grpc::StatusCode::CANCELLED);
  CHECK(r.violations == 0);
}

TEST_CASE("stream writer: a failed write drops the queue and ends CANCELLED", "[stream_writer]") {
  ScriptedReactor r;
  Writer w(&r);
  w.write("a");
  w.write("b");
  CHECK_FALSE(r.complete(w, false));
  CHECK(r.written == std::vector<std::string>{"a"});
  CHECK(r.n_finish == 1);
  CHECK(r.finished_with == grpc::StatusCode::CANCELLED);

  // A decided end is kept: the status the owner chose, not CANCELLED.
  ScriptedReactor r2;
  Writer w2(&r2);
  w2.write("a");
  w2.finish(grpc::Status(grpc::StatusCode::INTERNAL, "x"));
  CHECK_FALSE(r2.complete(w2, false));
  CHECK(r2.n_finish == 1);
  CHECK(r2.finished_with == grpc::StatusCode::INTERNAL);
  CHECK(r.violations + r2.violations == 0);
}

TEST_CASE("stream writer: a mergeable message replaces the mergeable one queued last", "[stream_writer]") {
  ScriptedReactor r;
  Writer w(&r);
  w.write("a");
  w.write("p1", true);
  w.write("p2", true);  // replaces p1 (not yet written)
  w.write("q");
  w.write("p3", true);  // q is last: appended
  w.finish(grpc::Status::OK);
  while (r.n_finish == 0) r.complete(w, true);
  CHECK(r.written == std::vector<std::string>{"a", "p2", "q", "p3"});
  CHECK(r.violations == 0);
}

TEST_CASE("stream writer: writes completed inline (re-entrant) keep the order", "[stream_writer]") {
  ScriptedReactor r;
  Writer w(&r);
  r.on_start = [&] { r.complete(w, true); };
  for (int i = 0; i < 100; ++i) w.write(std::to_string(i));
  w.finish(grpc::Status::OK);
  REQUIRE(r.written.size() == 100);
  for (int i = 0; i < 100; ++i) CHECK(r.written[static_cast<size_t>(i)] == std::to_string(i));
  CHECK(r.n_finish == 1);
  CHECK(r.violations == 0);
}

// Producers on several threads, gRPC completing writes on its own, and a cancel at a random
// moment: Finish exactly once, never under a write, and each producer's messages in its order.
TEST_CASE("stream writer: concurrent producers, completions and a cancel", "[stream_writer]") {
  std::mt19937 rng(std::random_device{}());
  for (int round = 0; round < 20; ++round) {
    ScriptedReactor r;
    Writer w(&r);
    std::mutex mu;
    std::condition_variable cv;
    int pending = 0;  // writes started, not yet completed
    r.on_start = [&] {
      std::lock_guard<std::mutex> lock(mu);
      ++pending;
      cv.notify_one();
    };
    std::atomic<bool> stop{false};
    const int cancel_after = static_cast<int>(rng() % 400);
    std::thread grpc_thread([&] {
      int n_done = 0;
      for (;;) {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait_for(lock, std::chrono::milliseconds(5), [&] { return pending > 0 || stop.load(); });
        if (pending == 0) {
          if (stop) return;
          continue;
        }
        --pending;
        lock.unlock();
        const bool ok = n_done++ < cancel_after;
        if (!ok && n_done == cancel_after + 1) w.on_cancel();
        r.complete(w, ok);
      }
    });
    std::vector<std::thread> producers;
    for (int p = 0; p < 4; ++p) {
      producers.emplace_back([&w, p] {
        for (int i = 0; i < 200; ++i) w.write(std::to_string(p) + ":" + std::to_string(i), i % 7 == 3);
      });
    }
    for (auto& t : producers) t.join();
    w.finish(grpc::Status::OK);
    for (int spin = 0; spin < 2000 && r.finishes() == 0; ++spin) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    stop = true;
    grpc_thread.join();
    CHECK(r.n_finish == 1);
    CHECK(r.violations == 0);
    std::map<std::string, int> last;  // producer → the last index written
    for (const std::string& m : r.written) {
      const std::string p = m.substr(0, m.find(':'));
      const int i = std::stoi(m.substr(m.find(':') + 1));
      auto it = last.find(p);
      if (it != last.end()) CHECK(i > it->second);
      last[p] = i;
    }
  }
}

}  // namespace
}  // namespace baton
