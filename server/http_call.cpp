#include "server/http_call.h"

#include <httplib.h>

#include <algorithm>
#include <condition_variable>
#include <ctime>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace baton {
namespace {

class HttpCall final : public PublicCall {
 public:
  HttpCall(FrontendContext& fc, OpenAiEndpoint endpoint, HttpCallEnv env) : PublicCall(fc), env_(std::move(env)) {
    header_.endpoint = endpoint;
    header_.created = std::time(nullptr);
    header_.model = fc.model->name;
    if (env_.live != nullptr) env_.live->fetch_add(1);
  }
  ~HttpCall() override {
    if (env_.live != nullptr) env_.live->fetch_sub(1);
  }

  // The whole exchange, on the calling thread (a pool thread of the HTTP server).
  void serve(const httplib::Request& req, const std::string& body, httplib::Response& res);

 private:
  void emit_tokens(std::span<const int32_t> ids, std::span<const TokenLogprobs> logprobs,
                   const std::string& text) override;
  void emit_end(const Status& status, const PipelineOutcome& outcome, const std::string& tail) override;

  // Waits (mu_ held through `lock`) until `ready()`; meanwhile a client that has gone or a server
  // that stops ends the request, whose end then makes it ready.
  template <class Ready>
  void wait_locked(std::unique_lock<std::mutex>& lock, Ready ready);
  // Why the request should end now, if it should.
  std::optional<Status> abandoned() const;
  // Streaming: writes what has arrived (waiting for something first); false when the client is gone.
  bool write_events(httplib::DataSink& sink);
  // The server is done with the stream: if it ended before the request did (the client went, the
  // server stopped), nothing more can reach the client and the request must not run on.
  void on_stream_released();
  void send_whole(httplib::Response& res);

  // Stream: the log-probabilities gathered since the last piece, for the next one.
  LogprobsOut take_logprobs_locked() {
    LogprobsOut out;
    out.tokenizer = logprobs_out_.tokenizer;
    out.text_offset = text_offset_;
    out.ids.swap(logprobs_out_.ids);
    out.logprobs.swap(logprobs_out_.logprobs);
    if (out.tokenizer != nullptr) {
      for (int32_t id : out.ids) text_offset_ += token_text_chars(*out.tokenizer, id);
    }
    return out;
  }

  const HttpCallEnv env_;
  ResponseHeader header_;  // id set once the request is admitted
  bool stream_ = false;
  bool include_usage_ = false;
  bool logprobs_ = false;  // the request asked for log-probabilities

  std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_: what the pipeline produced and the surface has not written yet.
  std::string text_;                 // whole: all the text
  // Stream: text not yet written, a piece per pipeline event that completed some, with the
  // log-probabilities of its tokens (and of tokens before it that completed none).
  struct Piece {
    std::string text;
    LogprobsOut logprobs;
  };
  std::vector<Piece> pieces_;
  LogprobsOut logprobs_out_;  // whole: every token's; stream: those not yet in a piece
  int64_t text_offset_ = 0;   // stream, completions: characters of the tokens already in pieces
  bool got_tokens_ = false;          // the first token arrived
  bool ended_ = false;
  bool cancelling_ = false;  // cancel() called; its end follows
  bool role_sent_ = false;   // stream: the first chunk (chat: with the role) is out
  Status status_;
  PipelineOutcome outcome_;
};

void HttpCall::emit_tokens(std::span<const int32_t> ids, std::span<const TokenLogprobs> logprobs,
                           const std::string& text) {
  std::lock_guard<std::mutex> lock(mu_);
  if (logprobs_) {
    logprobs_out_.ids.insert(logprobs_out_.ids.end(), ids.begin(), ids.end());
    logprobs_out_.logprobs.insert(logprobs_out_.logprobs.end(), logprobs.begin(), logprobs.end());
  }
  if (!stream_) {
    text_ += text;
  } else if (!text.empty()) {
    pieces_.push_back({text, take_logprobs_locked()});
  }
  got_tokens_ = got_tokens_ || !ids.empty();
  cv_.notify_all();
}

void HttpCall::emit_end(const Status& status, const PipelineOutcome& outcome, const std::string& tail) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!stream_) {
    text_ += tail;
  } else if (!tail.empty() || !logprobs_out_.ids.empty()) {
    pieces_.push_back({tail, take_logprobs_locked()});
  }
  ended_ = true;
  status_ = status;
  outcome_ = outcome;
  cv_.notify_all();
}

std::optional<Status> HttpCall::abandoned() const {
  if (env_.stopping != nullptr && env_.stopping->load()) {
    return unavailable("this frontend shut down before the request finished; retry on another replica");
  }
  if (env_.client_gone && env_.client_gone()) return cancelled("the client closed the connection");
  return std::nullopt;
}

template <class Ready>
void HttpCall::wait_locked(std::unique_lock<std::mutex>& lock, Ready ready) {
  while (!cv_.wait_for(lock, kPollInterval, ready)) {
    if (cancelling_) continue;
    std::optional<Status> why = abandoned();
    if (!why) continue;
    cancelling_ = true;
    lock.unlock();  // the pipeline's end comes back through emit_end, which takes mu_
    cancel(*why);
    lock.lock();
  }
}

void HttpCall::serve(const httplib::Request& req, const std::string& body, httplib::Response& res) {
  if (Status st = authorize(req.get_header_value("Authorization")); !st.ok()) {
    refuse(st);
    set_error_response(res, st);
    return;
  }
  auto parse = [&]() -> Result<OpenAiRequest> {
    RequestBuilder builder = request_builder();
    if (req.has_header("X-Request-Id")) BATON_RETURN_IF_ERROR(builder.request_id(req.get_header_value("X-Request-Id")));
    return parse_openai_request(header_.endpoint, body, *frontend().model, std::move(builder));
  };
  Result<OpenAiRequest> parsed = parse();
  if (parsed.ok()) {
    stream_ = parsed->stream;
    include_usage_ = parsed->include_usage;
    logprobs_ = parsed->request.pipeline.sampling.top_logprobs >= 0;
    logprobs_out_.tokenizer = frontend().model->tokenizer;
    start(std::move(parsed->request), CallDeadline::max());
  } else {
    start(parsed.status(), CallDeadline::max());  // refused, after the drain's refusal
  }

  std::unique_lock<std::mutex> lock(mu_);
  wait_locked(lock, [this] { return ended_ || (stream_ && got_tokens_); });
  if (ended_ && !status_.ok()) {
    set_error_response(res, status_);
    return;
  }
  header_.id = response_id(header_.endpoint, request_id());
  res.set_header("X-Request-Id", request_id());
  if (!stream_) {
    send_whole(res);
    return;
  }
  lock.unlock();
  res.set_header("Cache-Control", "no-cache");
  std::shared_ptr<HttpCall> self = std::static_pointer_cast<HttpCall>(shared_from_this());
  res.set_chunked_content_provider(
      "text/event-stream", [self](size_t, httplib::DataSink& sink) { return self->write_events(sink); },
      [self](bool) { self->on_stream_released(); });
}

void HttpCall::send_whole(httplib::Response& res) {
  for (const auto& [name, value] : timing_headers(outcome_)) res.set_header(name, value);
  res.set_content(completion_body(header_, text_, outcome_, logprobs_ ? &logprobs_out_ : nullptr), "application/json");
}

bool HttpCall::write_events(httplib::DataSink& sink) {
  // One chunk per piece of text, as OpenAI streams them (clients and benchmarks count chunks as
  // tokens), all that have arrived in one write; the last piece rides in the final chunk.
  std::string out;
  bool done = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    wait_locked(lock, [this] { return ended_ || !pieces_.empty() || !role_sent_; });
    bool first = !role_sent_;
    role_sent_ = true;
    std::vector<Piece> pieces = std::move(pieces_);
    pieces_.clear();
    const bool finished = ended_ && status_.ok();
    Piece last;
    if (finished && !pieces.empty()) {
      last = std::move(pieces.back());
      pieces.pop_back();
    }
    auto logprobs = [this](const Piece& p) { return logprobs_ && !p.logprobs.ids.empty() ? &p.logprobs : nullptr; };
    if (!ended_ || finished) {
      if (pieces.empty() && first && !finished) pieces.emplace_back();  // the opening chunk (chat: the role)
      for (const Piece& piece : pieces) {
        out += sse_event(chunk_body(header_, piece.text, first, nullptr, include_usage_, logprobs(piece)));
        first = false;
      }
    }
    if (finished) {
      out += sse_event(chunk_body(header_, last.text, first, &outcome_, include_usage_, logprobs(last)));
      if (include_usage_) out += sse_event(usage_chunk_body(header_, outcome_));
      out += kSseDone;
      done = true;
    } else if (ended_) {
      out += sse_event(error_body(http_status_of(status_.code()), status_));
      done = true;
    }
  }
  if (!sink.write(out.data(), out.size())) {
    cancel(cancelled("the client closed the connection"));
    return false;
  }
  if (done) sink.done();
  return true;
}

void HttpCall::on_stream_released() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_) return;
  }
  cancel(abandoned().value_or(cancelled("the response stream ended early")));
}

}  // namespace

void serve_completion(FrontendContext& fc, OpenAiEndpoint endpoint, const httplib::Request& request,
                      const std::string& body, httplib::Response& response, HttpCallEnv env) {
  auto call = std::make_shared<HttpCall>(fc, endpoint, std::move(env));
  call->serve(request, body, response);
}

void set_error_response(httplib::Response& res, const Status& status, int http_status) {
  const int code = http_status != 0 ? http_status : http_status_of(status.code());
  res.status = code;
  if (code == 429 || code == 503) {
    res.set_header("Retry-After", std::to_string(std::max(1, status.retry_after_seconds())));
  }
  res.set_content(error_body(code, status), "application/json");
}

}  // namespace baton
