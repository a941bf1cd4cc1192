// Ids nobody can guess: requests' attempt ids and the ids made up for clients that name none.
#pragma once

#include <string>

namespace baton {

// 32 hex digits from the operating system's random source (128 bits).
std::string random_request_id();

}  // namespace baton
