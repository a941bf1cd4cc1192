// spdlog set-up for the serving roles: human-readable lines, or one JSON object per line for
// log collectors (--log-format json). Lines about a request carry `req=<id>`.
#pragma once

#include <string>

#include "common/status.h"

namespace baton {

// level: trace|debug|info|warn|error; format: text|json. INVALID_ARGUMENT on anything else.
Status init_logging(const std::string& level, const std::string& format);

}  // namespace baton
