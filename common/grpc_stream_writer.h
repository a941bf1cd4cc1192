// The write side of one server-streaming gRPC call: messages queue, one write is in flight at a
// time, and Finish is called exactly once. The frontend's Generate call, the prefill worker's
// Prefill call and the decode worker's Stream call all write through it.
//
// The lifetime rule, the only one those reactors follow:
//   - The writer is held by shared_ptr: by the reactor, and by everything that produces messages
//     for the call (engine callbacks, the pipeline's sink). Producers never hold the reactor.
//   - The reactor pointer inside is valid until Finish is called on it. Only the thread that
//     claims the Finish (under the writer's lock) calls it, and after that nothing in the writer
//     touches the reactor; gRPC then calls OnDone, where the reactor deletes itself. While a write
//     is in flight no Finish is claimed, so StartWrite and OnWriteDone always find it alive.
//   - How the call ends is decided once (finish(), a broken stream, or a cancel): the first
//     decision wins, and writes after it are dropped.
//   - gRPC is never called with the lock held (its callbacks may run inline).
//
// The reactor forwards OnWriteDone and OnCancel here. A false from on_write_done, or a cancel,
// means the client is gone: the owner cancels its work (which may still call finish(); it is
// dropped).
#pragma once

#include <grpcpp/grpcpp.h>

#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

namespace baton {

// `Reactor` needs StartWrite(const Msg*) and Finish(grpc::Status); the unit test scripts one.
template <typename Msg, typename Reactor = grpc::ServerWriteReactor<Msg>>
class GrpcStreamWriter {
 public:
  // What finish() does with messages queued and not yet in flight.
  enum class Queued { kWrite, kDrop };

  explicit GrpcStreamWriter(Reactor* reactor) : reactor_(reactor) {}
  GrpcStreamWriter(const GrpcStreamWriter&) = delete;
  GrpcStreamWriter& operator=(const GrpcStreamWriter&) = delete;

  // Queues `msg` and starts writing it when nothing is in flight. A `mergeable` message replaces
  // the last queued one when that was mergeable too (a progress report: only the latest counts).
  // False, and dropped, once the call's end is decided.
  bool write(Msg msg, bool mergeable = false) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (end_) return false;
      if (mergeable && !queue_.empty() && queue_.back().second) {
        queue_.back().first = std::move(msg);
      } else {
        queue_.emplace_back(std::move(msg), mergeable);
      }
    }
    pump();
    return true;
  }

  // Decides the call's status: Finish follows once the queued messages are written (kWrite) or
  // at once after the write in flight (kDrop). False when the end was decided already.
  bool finish(grpc::Status status, Queued queued = Queued::kWrite) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (end_) return false;
      end_ = std::move(status);
      if (queued == Queued::kDrop) queue_.clear();
    }
    pump();
    return true;
  }

  // The reactor's OnWriteDone. False when the write failed: the stream is broken, what is queued
  // is dropped, and the call ends CANCELLED (unless its end was decided).
  bool on_write_done(bool ok) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      writing_ = false;
      if (!ok) break_locked("the client stream broke");
    }
    pump();
    return ok;
  }

  // The reactor's OnCancel: as a broken stream.
  void on_cancel() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      break_locked("the call was cancelled");
    }
    pump();
  }

  // The call's end is decided (finish, a broken stream or a cancel): further writes are dropped.
  bool ending() const {
    std::lock_guard<std::mutex> lock(mu_);
    return end_.has_value();
  }

 private:
  void break_locked(const char* why) {
    queue_.clear();
    if (!end_) end_ = grpc::Status(grpc::StatusCode::CANCELLED, why);
  }

  // Claims the next step under the lock (a write, or the Finish) and performs it without.
  void pump() {
    Reactor* r = nullptr;
    bool write = false;
    grpc::Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (reactor_ == nullptr || writing_) return;
      if (!queue_.empty()) {
        current_ = std::move(queue_.front().first);
        queue_.pop_front();
        writing_ = write = true;
        r = reactor_;
      } else if (end_) {
        r = std::exchange(reactor_, nullptr);
        status = *end_;
      } else {
        return;
      }
    }
    if (write) {
      r->StartWrite(&current_);  // current_ stays put until OnWriteDone
    } else {
      r->Finish(status);  // the reactor may be deleted from here on
    }
  }

  mutable std::mutex mu_;
  Reactor* reactor_;                         // null once Finish was claimed
  std::deque<std::pair<Msg, bool>> queue_;   // not yet written; .second: mergeable
  Msg current_;                              // the message in flight
  bool writing_ = false;
  std::optional<grpc::Status> end_;          // how the call ends, once decided
};

}  // namespace baton
