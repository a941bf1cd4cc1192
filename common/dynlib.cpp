#include "common/dynlib.h"

#include <dlfcn.h>

namespace baton {

void* DynSymbols::lookup(const char* name) const {
  void* p = dlsym(handle_, name);
  if (p == nullptr) missing_ = name;
  return p;
}

void* dynlib_open(const std::vector<std::string>& sonames, const std::string& hint, std::string* error,
                  std::string* opened) {
  std::string why;
  for (const std::string& name : sonames) {
    if (void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      *opened = name;
      return h;
    }
    if (why.empty()) {
      const char* e = dlerror();
      why = e != nullptr ? e : "not found";
    }
  }
  *error = "cannot load " + sonames.front() + " (" + hint + "; put its folder on LD_LIBRARY_PATH): " + why;
  return nullptr;
}

}  // namespace baton
