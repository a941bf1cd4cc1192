#include "server/admin_service.h"

#include <spdlog/spdlog.h>

#include "common/grpc_status.h"
#include "common/tls.h"
#include "common/version.h"
#include "proto/convert.h"

namespace baton {
namespace {

void add_workers(const std::vector<WorkerSnapshot>& workers,
                 google::protobuf::RepeatedPtrField<v1::WorkerEntry>* out) {
  for (const WorkerSnapshot& w : workers) {
    v1::WorkerEntry* e = out->Add();
    e->set_address(w.address);
    e->set_healthy(w.healthy);
    e->set_draining(w.load.draining);
  }
}

}  // namespace

Status authorize_admin(ApiKeys* keys, const grpc::ServerContextBase& context) {
  if (keys != nullptr) {
    bool admin = false;
    BATON_RETURN_IF_ERROR(keys->check(context, nullptr, &admin));
    if (!admin) {
      return permission_denied("this API key may not list the deployment: give a key whose line in the frontend's "
                               "--api-key-file ends with 'admin'");
    }
    return {};
  }
  if (!is_loopback_peer(context.peer())) {
    return permission_denied("a frontend without --api-key-file lists its workers only to callers on its own host: "
                             "run batonctl doctor there (e.g. kubectl exec), or give the frontend an API key file "
                             "with a key marked 'admin'");
  }
  return {};
}

grpc::ServerUnaryReactor* AdminService::ListWorkers(grpc::CallbackServerContext* context,
                                                    const v1::ListWorkersRequest*, v1::ListWorkersResponse* response) {
  auto* reactor = context->DefaultReactor();
  if (Status s = authorize_admin(frontend_.api_keys(), *context); !s.ok()) {
    spdlog::info("Admin.ListWorkers refused to {}: {}", context->peer(), s.message());
    reactor->Finish(to_grpc(s));
    return reactor;
  }
  add_workers(frontend_.workers(WorkerRole::kPrefill), response->mutable_prefill());
  add_workers(frontend_.workers(WorkerRole::kDecode), response->mutable_decode());
  *response->mutable_model() = model_info(frontend_.served_model());
  response->set_wall_time_unix_nanos(wall_time_unix_nanos());
  response->set_version(baton_version());
  response->set_local_prefill_max_tokens(static_cast<int32_t>(frontend_.local_prefill_max_tokens()));
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace baton
