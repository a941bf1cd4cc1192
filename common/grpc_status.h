// baton::Status <-> grpc::Status, the one place codes are mapped (serving code only).
#pragma once

#include <grpcpp/support/status.h>

#include "common/status.h"

namespace baton {

grpc::Status to_grpc(const Status& status);
Status from_grpc(const grpc::Status& status);

}  // namespace baton
