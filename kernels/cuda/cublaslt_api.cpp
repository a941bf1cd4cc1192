#include "kernels/cuda/cublaslt_api.h"

#include <dlfcn.h>

#include <mutex>

#include "common/check.h"

namespace baton::cuda {
namespace {

std::once_flag g_once;
CublasLtApi g_api;
bool g_loaded = false;
std::string g_error;

void load() {
  // The toolkit's soname first (matching the headers this was built with), then any.
  const std::string versioned = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  void* lib = dlopen(versioned.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) lib = dlopen("libcublasLt.so", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    g_error = "cannot load " + versioned + " (cuBLASLt, from the CUDA toolkit or the nvidia-cublas wheel; put its folder "
              "on LD_LIBRARY_PATH): " + (why ? why : "not found");
    return;
  }
#define BATON_CUBLASLT_RESOLVE(name)                                                         \
  g_api.name = reinterpret_cast<decltype(g_api.name)>(dlsym(lib, #name));                    \
  if (g_api.name == nullptr) {                                                               \
    g_error = "libcublasLt has no " #name " (a cuBLASLt older than this build's headers?)"; \
    return;                                                                                  \
  }
  BATON_CUBLASLT_FUNCTIONS(BATON_CUBLASLT_RESOLVE)
#undef BATON_CUBLASLT_RESOLVE
  g_loaded = true;  // the handle stays open for the process's lifetime
}

}  // namespace

const CublasLtApi* cublaslt_load(std::string* error) {
  std::call_once(g_once, load);
  if (!g_loaded) {
    *error = g_error;
    return nullptr;
  }
  return &g_api;
}

const CublasLtApi& cublaslt() {
  BATON_CHECK(g_loaded, "cuBLASLt used before it was loaded");
  return g_api;
}

}  // namespace baton::cuda
