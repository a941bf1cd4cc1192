#include "common/version.h"

namespace baton {

const char* baton_version() { return BATON_VERSION; }

}  // namespace baton
