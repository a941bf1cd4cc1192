// What a client reads of a worker's or gRPC's message about its request (DESIGN.md "Security"):
// the request named by its label instead of the attempts' ids, which are never shown, and workers'
// addresses and IP literals as "<address>". The frontend's log keeps the originals.
#pragma once

#include <span>
#include <string>

namespace baton {

// `text` with each of `attempt_ids` replaced by `label` ("(this request)" when empty), and each of
// `addresses`, and any IP literal (10.0.0.7:50051, ipv4:…, ipv6:[::1]:41234), by "<address>". A
// match counts only where it stands alone: "d:1" is not replaced inside "d:10".
std::string redact_for_client(std::string text, const std::string& label, std::span<const std::string> attempt_ids,
                              std::span<const std::string> addresses);

}  // namespace baton
