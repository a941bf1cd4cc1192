#include "common/grpc_status.h"

namespace baton {

grpc::Status to_grpc(const Status& s) {
  grpc::StatusCode code = grpc::StatusCode::UNKNOWN;
  switch (s.code()) {
    case StatusCode::kOk: return grpc::Status::OK;
    case StatusCode::kInvalidArgument: code = grpc::StatusCode::INVALID_ARGUMENT; break;
    case StatusCode::kNotFound: code = grpc::StatusCode::NOT_FOUND; break;
    case StatusCode::kUnimplemented: code = grpc::StatusCode::UNIMPLEMENTED; break;
    case StatusCode::kResourceExhausted: code = grpc::StatusCode::RESOURCE_EXHAUSTED; break;
    case StatusCode::kDataLoss: code = grpc::StatusCode::DATA_LOSS; break;
    case StatusCode::kInternal: code = grpc::StatusCode::INTERNAL; break;
    case StatusCode::kCancelled: code = grpc::StatusCode::CANCELLED; break;
    case StatusCode::kDeadlineExceeded: code = grpc::StatusCode::DEADLINE_EXCEEDED; break;
    case StatusCode::kUnavailable: code = grpc::StatusCode::UNAVAILABLE; break;
    case StatusCode::kFailedPrecondition: code = grpc::StatusCode::FAILED_PRECONDITION; break;
    case StatusCode::kPermissionDenied: code = grpc::StatusCode::PERMISSION_DENIED; break;
    case StatusCode::kUnauthenticated: code = grpc::StatusCode::UNAUTHENTICATED; break;
  }
  return grpc::Status(code, s.message());
}

Status from_grpc(const grpc::Status& s) {
  switch (s.error_code()) {
    case grpc::StatusCode::OK: return {};
    case grpc::StatusCode::INVALID_ARGUMENT: return {StatusCode::kInvalidArgument, s.error_message()};
    case grpc::StatusCode::NOT_FOUND: return {StatusCode::kNotFound, s.error_message()};
    case grpc::StatusCode::UNIMPLEMENTED: return {StatusCode::kUnimplemented, s.error_message()};
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return {StatusCode::kResourceExhausted, s.error_message()};
    case grpc::StatusCode::DATA_LOSS: return {StatusCode::kDataLoss, s.error_message()};
    case grpc::StatusCode::CANCELLED: return {StatusCode::kCancelled, s.error_message()};
    case grpc::StatusCode::DEADLINE_EXCEEDED: return {StatusCode::kDeadlineExceeded, s.error_message()};
    case grpc::StatusCode::UNAVAILABLE: return {StatusCode::kUnavailable, s.error_message()};
    case grpc::StatusCode::FAILED_PRECONDITION: return {StatusCode::kFailedPrecondition, s.error_message()};
    case grpc::StatusCode::PERMISSION_DENIED: return {StatusCode::kPermissionDenied, s.error_message()};
    case grpc::StatusCode::UNAUTHENTICATED: return {StatusCode::kUnauthenticated, s.error_message()};
    default: return {StatusCode::kInternal, s.error_message()};
  }
}

}  // namespace baton
