#include "kernels/cuda/cublaslt_api.h"

#include "common/dynlib.h"

namespace baton::cuda {
namespace {

// The toolkit's soname first (matching the headers this was built with), then any.
LazyLibrary<CublasLtApi> g_lib({"libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR), "libcublasLt.so"},
                               "cuBLASLt, from the CUDA toolkit or the nvidia-cublas wheel",
                               [](const DynSymbols& lib, CublasLtApi* api) {
#define BATON_CUBLASLT_RESOLVE(name) lib.get(#name, &api->name) &&
                                 return BATON_CUBLASLT_FUNCTIONS(BATON_CUBLASLT_RESOLVE) true;
#undef BATON_CUBLASLT_RESOLVE
                               });

}  // namespace

const CublasLtApi* cublaslt_load(std::string* error) { return g_lib.load(error); }

const CublasLtApi& cublaslt() { return g_lib.get(); }

}  // namespace baton::cuda
