#include "common/random_id.h"

#include <cstdio>
#include <random>

namespace baton {

std::string random_request_id() {
  std::random_device rd;
  char buf[33];
  std::snprintf(buf, sizeof buf, "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return buf;
}

}  // namespace baton
