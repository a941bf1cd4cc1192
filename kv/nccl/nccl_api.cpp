#include "kv/nccl/nccl_api.h"

#include "common/dynlib.h"

namespace baton {
namespace {

// The soname of the major version these headers describe first, then any.
LazyLibrary<NcclApi> g_lib({"libnccl.so." + std::to_string(NCCL_MAJOR), "libnccl.so"},
                           "NCCL, from the libnccl2 package or the nvidia-nccl wheel",
                           [](const DynSymbols& lib, NcclApi* api) {
#define BATON_NCCL_RESOLVE(name) lib.get(#name, &api->name) &&
                             return BATON_NCCL_FUNCTIONS(BATON_NCCL_RESOLVE) true;
#undef BATON_NCCL_RESOLVE
                           });

}  // namespace

const NcclApi* nccl_load(std::string* error) { return g_lib.load(error); }

const NcclApi& nccl() { return g_lib.get(); }

}  // namespace baton
