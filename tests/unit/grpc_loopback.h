// A gRPC server on loopback for tests that talk to a service over real gRPC.
#pragma once

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <memory>
#include <string>

namespace baton::testing {

// Serves `service` (which must outlive it) on 127.0.0.1:`port`, 0 picking a free port; shuts
// down, giving in-flight calls two seconds, when destroyed.
struct GrpcLoopback {
  explicit GrpcLoopback(grpc::Service& service, int port = 0) {
    grpc::ServerBuilder builder;
    int bound = 0;
    builder.AddListeningPort("127.0.0.1:" + std::to_string(port), grpc::InsecureServerCredentials(), &bound);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    REQUIRE(server);
    REQUIRE(bound > 0);
    this->port = bound;
    address = "127.0.0.1:" + std::to_string(bound);
  }
  ~GrpcLoopback() { server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2)); }

  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::string address;  // "127.0.0.1:PORT"
};

}  // namespace baton::testing
