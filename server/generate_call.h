// One Generate RPC on the frontend: the gRPC edge of a PublicCall (server/public_call.h, which
// admits the request, runs its pipeline and turns its tokens into text). This file parses the
// request's bytes, turns text and the end into response messages, writes them one at a time, and
// turns client cancellation and deadlines into cancel().
//
// Ownership: GenerateReactor (the server-side gRPC reactor) holds the GenerateCall; the pipeline
// holds the call as its sink until it has ended. The call writes through a GrpcStreamWriter
// (common/grpc_stream_writer.h, whose lifetime rule it follows); the reactor deletes itself in
// OnDone and only there.
#pragma once

#include <grpcpp/grpcpp.h>

#include "server/public_call.h"

namespace baton {

// Creates the reactor for one Generate RPC (Frontend::Generate returns it). The request arrives
// as bytes and the responses leave as bytes (the raw callback method): the frontend parses the
// request itself, so a malformed one (bad wire format, a string field that is not UTF-8) gets
// INVALID_ARGUMENT with a message instead of gRPC's bare UNIMPLEMENTED.
grpc::ServerWriteReactor<grpc::ByteBuffer>* start_generate_call(FrontendContext& fc, grpc::CallbackServerContext* context,
                                                                const grpc::ByteBuffer* request);

}  // namespace baton
