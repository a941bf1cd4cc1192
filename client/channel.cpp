#include "client/channel.h"

#include <chrono>
#include <cstdio>

namespace baton::ctl {

void add_connection_flags(CLI::App* command, Connection& c, bool with_address) {
  if (with_address) {
    command->add_option("--address", c.address, "Frontend host:port")->capture_default_str()->envname("BATONCTL_ADDRESS");
  }
  command->add_option("--tls-ca", c.tls.ca, "PEM CA that signed the frontend's certificate (connect over TLS)")
      ->envname("BATONCTL_TLS_CA");
  command->add_option("--tls-cert", c.tls.cert, "PEM client certificate, for a frontend that asks for one (mTLS)")
      ->envname("BATONCTL_TLS_CERT");
  command->add_option("--tls-key", c.tls.key, "PEM private key of --tls-cert")->envname("BATONCTL_TLS_KEY");
  command->add_option("--tls-server-name", c.server_name,
                      "Name the frontend's certificate must carry (default: the host of --address)")
      ->envname("BATONCTL_TLS_SERVER_NAME");
  command->add_option("--api-key", c.api_key, "API key of the frontend's --api-key-file (prefer the env var)")
      ->envname("BATONCTL_API_KEY");
}

std::shared_ptr<grpc::Channel> make_channel(const Connection& c, std::string* error) {
  auto credentials = client_channel_credentials(c.tls);
  if (!credentials.ok()) {
    *error = credentials.status().message();
    return nullptr;
  }
  grpc::ChannelArguments args;
  // Token streams are small messages; the default 4 MiB limit is plenty, but a long prompt's
  // final message must not be refused on the way back either.
  args.SetMaxReceiveMessageSize(64 << 20);
  if (!c.server_name.empty()) args.SetSslTargetNameOverride(c.server_name);
  return grpc::CreateCustomChannel(c.address, *credentials, args);
}

void authorize(grpc::ClientContext& context, const Connection& c) {
  if (!c.api_key.empty()) context.AddMetadata("authorization", "Bearer " + c.api_key);
}

const char* status_code_name(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

std::string status_to_string(const grpc::Status& status) {
  std::string message = status.error_message();
  for (char& c : message) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  if (message.empty()) message = "(no message)";
  return std::string(status_code_name(status.error_code())) + ": " + message;
}

void set_timeout(grpc::ClientContext& context, double seconds) {
  if (seconds <= 0) return;
  context.set_deadline(
      std::chrono::system_clock::now() +
      std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::duration<double>(seconds)));
}

int fail(int exit_code, const std::string& message) {
  std::fflush(stdout);
  std::fprintf(stderr, "batonctl: error: %s\n", message.c_str());
  return exit_code;
}

}  // namespace baton::ctl
