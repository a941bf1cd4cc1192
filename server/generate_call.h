// One Generate request through the disaggregated pipeline, on the frontend:
//
//   validate → Scheduler::submit (admission; waits for a decode worker with room)
//   → D.Admit (reserve KV blocks) → D.Stream (tokens 2..N, once the KV has arrived)
//                                 → P.Prefill (first token at once, then the KV hand-off to D)
//   → tokens stream to the client as they come; the last message carries usage and timing.
//
// Ownership: GenerateReactor (the server-side gRPC reactor) and the two client-side reactors
// each hold a shared_ptr to the GenerateCall; every reactor deletes itself in OnDone and only
// there. The call touches the server reactor only before it has called Finish on it, and the
// client contexts only while their reactors have not reported OnDone (both under mu_).
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "baton/v1/generate.pb.h"
#include "baton/v1/worker.grpc.pb.h"
#include "common/metrics.h"
#include "scheduler/scheduler.h"
#include "server/request_spec.h"
#include "server/text_stream.h"
#include "server/worker_pool.h"

namespace baton {

// What every call of one frontend shares.
struct FrontendContext {
  const ServedModel* model = nullptr;
  Scheduler* scheduler = nullptr;
  WorkerRegistry* registry = nullptr;
  WorkerPool* pool = nullptr;
  Metrics* metrics = nullptr;  // may be null
  std::string name;            // this frontend's listen address (metric label)
  std::string instance;  // random per frontend process: makes request ids unique across frontends
  std::atomic<uint64_t>* next_id = nullptr;
  std::atomic<int64_t>* live_calls = nullptr;  // GenerateCalls alive (stop() waits for zero)
  std::atomic<bool>* draining = nullptr;  // true: refuse new requests with UNAVAILABLE
};

class GenerateCall;

// Creates the reactor for one Generate RPC (Frontend::Generate returns it). The request arrives
// as bytes and the responses leave as bytes (the raw callback method): the frontend parses the
// request itself, so a malformed one (bad wire format, a string field that is not UTF-8) gets
// INVALID_ARGUMENT with a message instead of gRPC's bare UNIMPLEMENTED.
grpc::ServerWriteReactor<grpc::ByteBuffer>* start_generate_call(FrontendContext& fc, grpc::CallbackServerContext* context,
                                                                const grpc::ByteBuffer* request);

}  // namespace baton
