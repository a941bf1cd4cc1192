// One Generate RPC on the frontend: the gRPC edge of a RequestPipeline (scheduler/
// request_pipeline.h, which owns the request's path through the workers, failovers included).
// This file parses and validates the request, turns the pipeline's tokens into text (stop
// strings) and response messages, writes them one at a time, and turns client cancellation and
// deadlines into pipeline.cancel().
//
// Ownership: GenerateReactor (the server-side gRPC reactor) holds the GenerateCall, which holds
// the pipeline; the pipeline holds the call as its sink until it has ended. The reactor deletes
// itself in OnDone and only there; the call touches it only before it has called Finish on it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "baton/v1/generate.pb.h"
#include "common/api_keys.h"
#include "common/metrics.h"
#include "scheduler/request_pipeline.h"
#include "server/request_spec.h"

namespace baton {

// What every call of one frontend shares.
struct FrontendContext {
  const ServedModel* model = nullptr;
  PipelineDeps pipeline;       // scheduler, registry, worker client, clock, failover bound
  Metrics* metrics = nullptr;  // may be null
  std::string name;            // this frontend's listen address (metric label)
  std::atomic<int64_t>* live_calls = nullptr;  // GenerateCalls alive (stop() waits for zero)
  std::atomic<bool>* draining = nullptr;  // true: refuse new requests with UNAVAILABLE
  ApiKeys* api_keys = nullptr;            // null: no key needed; else UNAUTHENTICATED without one
};

class GenerateCall;

// Creates the reactor for one Generate RPC (Frontend::Generate returns it). The request arrives
// as bytes and the responses leave as bytes (the raw callback method): the frontend parses the
// request itself, so a malformed one (bad wire format, a string field that is not UTF-8) gets
// INVALID_ARGUMENT with a message instead of gRPC's bare UNIMPLEMENTED.
grpc::ServerWriteReactor<grpc::ByteBuffer>* start_generate_call(FrontendContext& fc, grpc::CallbackServerContext* context,
                                                                const grpc::ByteBuffer* request);

}  // namespace baton
