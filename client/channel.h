// What every batonctl command needs to talk to a frontend: the connection flags and channel
// (TLS, API key), gRPC status codes by name, deadlines, and the process exit codes.
#pragma once

#include <CLI/CLI.hpp>
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "common/cli_main.h"
#include "common/tls.h"

namespace baton::ctl {

// Exit codes: 0 ok, 1 the server or the RPC failed, 2 bad flags (both as every baton binary's,
// common/cli_main.h), 130 interrupted (Ctrl-C).
constexpr int kExitOk = 0;
using baton::kExitFailure;
using baton::kExitUsage;
constexpr int kExitInterrupted = 130;

// Where the frontend is and how to prove who we are.
struct Connection {
  std::string address = "127.0.0.1:50051";
  TlsFiles tls;             // --tls-ca (TLS: the CA that signed the frontend's certificate), --tls-cert/--tls-key
  std::string server_name;  // --tls-server-name: the name the frontend's certificate must carry (default: the host)
  std::string api_key;      // sent as 'authorization: Bearer <key>'
};

// --address, --tls-ca, --tls-cert, --tls-key, --tls-server-name, --api-key (and their env vars);
// without `with_address` all but --address (a command that names the frontend its own way).
void add_connection_flags(CLI::App* command, Connection& c, bool with_address = true);

// A channel to the frontend: TLS when a --tls-* file is given, plaintext otherwise. nullptr and
// `*error` (naming the flag) when a file cannot be used.
std::shared_ptr<grpc::Channel> make_channel(const Connection& c, std::string* error);

// Adds the API key (when given) to a call's metadata.
void authorize(grpc::ClientContext& context, const Connection& c);

// "UNAVAILABLE", "DEADLINE_EXCEEDED", ...: the canonical names, as grpcurl and the docs spell them.
const char* status_code_name(grpc::StatusCode code);

// "<CODE>: <message>", the message trimmed to one line.
std::string status_to_string(const grpc::Status& status);

// Sets the call's deadline `seconds` from now; <= 0: no deadline.
void set_timeout(grpc::ClientContext& context, double seconds);

// Prints "batonctl: error: <message>" on stderr and returns `exit_code`.
int fail(int exit_code, const std::string& message);

}  // namespace baton::ctl
