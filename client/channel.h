// What both batonctl commands need to talk to a frontend: the channel, gRPC status codes by
// name, deadlines, and the process exit codes.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

namespace baton::ctl {

// Exit codes: 0 ok, 1 the server or the RPC failed, 2 bad flags, 130 interrupted (Ctrl-C).
constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
constexpr int kExitInterrupted = 130;

// An insecure channel to host:port (the frontend is plain gRPC, like every baton endpoint).
std::shared_ptr<grpc::Channel> make_channel(const std::string& address);

// "UNAVAILABLE", "DEADLINE_EXCEEDED", ...: the canonical names, as grpcurl and the docs spell them.
const char* status_code_name(grpc::StatusCode code);

// "<CODE>: <message>", the message trimmed to one line.
std::string status_to_string(const grpc::Status& status);

// Sets the call's deadline `seconds` from now; <= 0: no deadline.
void set_timeout(grpc::ClientContext& context, double seconds);

// Prints "batonctl: error: <message>" on stderr and returns `exit_code`.
int fail(int exit_code, const std::string& message);

}  // namespace baton::ctl
