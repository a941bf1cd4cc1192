// The client side of grpc.health.v1.Health/Check, which every baton role serves: `batonctl
// health` (the probe command of deployments whose runtime has no native gRPC probes) and
// `batonctl doctor` call it. The two health messages are written by hand: grpc++ installs no
// generated code for them.
//
// The services a role reports (app/serve_roles.h):
//   ""          readiness: the role takes new work (model loaded, not draining, not stalled; a
//               frontend also needs a healthy prefill and decode worker)
//   "liveness"  the process works: NOT_SERVING only while a worker's step loop is stalled
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

namespace baton::ctl {

// Checks `service` ("" = the whole server) on `channel` within `context`'s deadline. On an OK
// call `*status` is "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNKNOWN"; a service the server
// does not know is the call's NOT_FOUND.
grpc::Status health_check(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext& context,
                          const std::string& service, std::string* status);

// The serialized grpc.health.v1.HealthCheckRequest for `service` ({string service = 1}).
std::string health_request_bytes(const std::string& service);

// The `status` of a serialized grpc.health.v1.HealthCheckResponse ({ServingStatus status = 1}):
// "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNKNOWN" (also for bytes that do not parse).
std::string health_status_name(const std::string& response_bytes);

}  // namespace baton::ctl
