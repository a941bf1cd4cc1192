// baton.v1.Admin (admin.proto) on the frontend's public port: what a privileged operator may ask
// the frontend, today the deployment's workers for `batonctl doctor`. The topology is not for
// anonymous public clients: with --api-key-file only a key marked `admin` may call it; without API
// keys only callers on the frontend's own host (loopback, e.g. `kubectl exec` into its pod).
#pragma once

#include <grpcpp/grpcpp.h>

#include "baton/v1/admin.grpc.pb.h"
#include "common/api_keys.h"
#include "common/status.h"
#include "server/frontend.h"

namespace baton {

// OK when the caller may use the Admin service: with `keys`, one marked admin (UNAUTHENTICATED
// without a valid key, PERMISSION_DENIED for a key without `admin`); without, a loopback peer
// (PERMISSION_DENIED otherwise). The messages say how to get access.
Status authorize_admin(ApiKeys* keys, const grpc::ServerContextBase& context);

class AdminService final : public v1::Admin::CallbackService {
 public:
  // `frontend` must outlive the service and every call on it.
  explicit AdminService(Frontend& frontend) : frontend_(frontend) {}

  grpc::ServerUnaryReactor* ListWorkers(grpc::CallbackServerContext* context, const v1::ListWorkersRequest* request,
                                        v1::ListWorkersResponse* response) override;

 private:
  Frontend& frontend_;
};

}  // namespace baton
