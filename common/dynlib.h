// A shared library loaded on first use (dlopen) instead of linked: for the CUDA libraries that
// only some roles need (kernels/cuda/cublaslt_api.h and kv/nccl/nccl_api.h say why each is).
//
//   struct FooApi { decltype(&::fooInit) fooInit = nullptr; ... };
//   LazyLibrary<FooApi> g_foo({"libfoo.so.3", "libfoo.so"}, "Foo, from the libfoo3 package",
//                             [](const DynSymbols& lib, FooApi* api) { return lib.get("fooInit", &api->fooInit); });
//   const FooApi* api = g_foo.load(&error);  // once, thread-safe; nullptr + message on failure
#pragma once

#include <mutex>
#include <string>
#include <vector>

#include "common/check.h"

namespace baton {

// Symbol lookup in an opened library; a failed get() records which symbol was missing.
class DynSymbols {
 public:
  DynSymbols(void* handle, std::string soname) : handle_(handle), soname_(std::move(soname)) {}
  template <class F>
  bool get(const char* name, F* fn) const {
    *fn = reinterpret_cast<F>(lookup(name));
    return *fn != nullptr;
  }
  const std::string& missing() const { return missing_; }
  const std::string& soname() const { return soname_; }

 private:
  void* lookup(const char* name) const;
  void* handle_;
  std::string soname_;
  mutable std::string missing_;
};

// Opens the first of `sonames` that loads (never closed). nullptr, and a message naming the
// first soname, `hint` (where the library comes from) and the loader's reason otherwise.
void* dynlib_open(const std::vector<std::string>& sonames, const std::string& hint, std::string* error,
                  std::string* opened);

template <class Api>
class LazyLibrary {
 public:
  using Resolve = bool (*)(const DynSymbols& lib, Api* api);
  LazyLibrary(std::vector<std::string> sonames, std::string hint, Resolve resolve)
      : sonames_(std::move(sonames)), hint_(std::move(hint)), resolve_(resolve) {}

  const Api* load(std::string* error) {
    std::call_once(once_, [this] {
      std::string opened;
      void* handle = dynlib_open(sonames_, hint_, &error_, &opened);
      if (handle == nullptr) return;
      DynSymbols lib(handle, opened);
      if (!resolve_(lib, &api_)) {
        error_ = opened + " has no " + lib.missing() + " (older than the headers this build used?)";
        return;
      }
      loaded_ = true;
    });
    if (!loaded_) {
      *error = error_;
      return nullptr;
    }
    return &api_;
  }
  const Api& get() const {
    BATON_CHECK(loaded_, "%s used before it was loaded", sonames_.front().c_str());
    return api_;
  }

 private:
  std::vector<std::string> sonames_;
  std::string hint_;
  Resolve resolve_;
  std::once_flag once_;
  Api api_;
  bool loaded_ = false;
  std::string error_;
};

}  // namespace baton
