// One POST /v1/completions or /v1/chat/completions: the HTTP edge of a PublicCall
// (server/public_call.h admits it and runs its pipeline; server/openai_json.h converts the JSON).
//
// The request is served on the cpp-httplib pool thread that read it, for its whole life: the
// thread waits for the pipeline's events, polling every kPollInterval whether the client has
// gone or the server is stopping, and ends the pipeline (which frees the KV blocks it holds on
// both workers) as soon as either happens, whether a token is being written or not.
//
//   stream false  the response is sent once the request has ended: its status is the request's
//                 (200, or the error's code), the timing breakdown in X-Baton-* headers too.
//   stream true   the status waits for the first token (so a refusal — 429, 503, a bad field —
//                 still gets its own code); then 200 and Server-Sent Events: a chunk per
//                 text piece, the last with finish_reason (and usage, with include_usage),
//                 `data: [DONE]`. An error after the first token is one `data: {"error": …}`.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <string>

#include "common/status.h"
#include "server/openai_json.h"
#include "server/public_call.h"

namespace httplib {
struct Request;
struct Response;
}  // namespace httplib

namespace baton {

inline constexpr std::chrono::milliseconds kPollInterval{50};

// What a call knows about the connection and the server it is served by.
struct HttpCallEnv {
  std::function<bool()> client_gone;          // polled: true once the client closed the connection
  const std::atomic<bool>* stopping = nullptr;  // true: the server is stopping (end with UNAVAILABLE)
  std::atomic<int>* live = nullptr;             // calls of this server alive (its stop() waits for them)
};

// Serves one completion request whose body has been read (and bounded) already.
void serve_completion(FrontendContext& fc, OpenAiEndpoint endpoint, const httplib::Request& request,
                      const std::string& body, httplib::Response& response, HttpCallEnv env);

// `status` as an OpenAI error response (`http_status` 0: http_status_of(status.code())), with
// Retry-After on 429 and 503: the refusals a client may retry.
void set_error_response(httplib::Response& response, const Status& status, int http_status = 0);

}  // namespace baton
