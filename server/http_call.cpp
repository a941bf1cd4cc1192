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

#include "model/tool_calls.h"

namespace baton {
namespace {

class HttpCall;

// One choice of a request: a PublicCall of its own (its pipeline, text stream and metrics) whose
// output goes to the HttpCall that serves the response, tagged with its index.
class ChoiceCall final : public PublicCall {
 public:
  ChoiceCall(FrontendContext& fc, std::weak_ptr<HttpCall> parent, int index)
      : PublicCall(fc), parent_(std::move(parent)), index_(index) {}
  void run(ValidRequest request) { start(std::move(request), CallDeadline::max()); }
  using PublicCall::cancel;

 private:
  void emit_tokens(std::span<const int32_t> ids, std::span<const TokenLogprobs> logprobs,
                   const std::string& text) override;
  void emit_end(const Status& status, const PipelineOutcome& outcome, const std::string& tail) override;

  const std::weak_ptr<HttpCall> parent_;
  const int index_;
};

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

  // A choice's output (ChoiceCall), on its pipeline's thread.
  void choice_tokens(int index, std::span<const int32_t> ids, std::span<const TokenLogprobs> logprobs,
                     const std::string& text);
  void choice_end(int index, const Status& status, const PipelineOutcome& outcome, const std::string& tail);

 private:
  // Only refusals before any choice starts (the body did not parse, the key) come here.
  void emit_tokens(std::span<const int32_t>, std::span<const TokenLogprobs>, const std::string&) override {}
  void emit_end(const Status& status, const PipelineOutcome& outcome, const std::string& tail) override;

  // Waits (mu_ held through `lock`) until `ready()`; meanwhile a client that has gone, a server
  // that stops or a choice that failed ends every choice, whose ends then make it ready.
  template <class Ready>
  void wait_locked(std::unique_lock<std::mutex>& lock, Ready ready);
  // Why the request should end now, if it should.
  std::optional<Status> abandoned() const;
  // Ends every choice still running with `why` (mu_ not held: their ends take it).
  void cancel_choices(const Status& why);
  // Streaming: writes what has arrived (waiting for something first); false when the client is gone.
  bool write_events(httplib::DataSink& sink);
  // The server is done with the stream: if it ended before the request did (the client went, the
  // server stopped), nothing more can reach the client and the request must not run on.
  void on_stream_released();
  void send_whole(httplib::Response& res);
  bool ended_locked() const { return refused_ || n_ended_ == choices_.size(); }
  // The choices' usage summed (a prompt counted once for its n choices), the first's timing.
  PipelineOutcome usage_locked() const;

  const HttpCallEnv env_;
  ResponseHeader header_;  // id set once the request is admitted
  bool stream_ = false;
  bool include_usage_ = false;
  bool logprobs_ = false;  // the request asked for log-probabilities
  // Chat with tools: the syntax calls are read in (the text becomes content and calls at the end;
  // streamed, what may be a call waits).
  std::optional<ToolCallSyntax> tool_syntax_;
  int n_ = 1;              // choices per prompt

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<ChoiceCall>> calls_;  // set before any starts, then read-only
  // Guarded by mu_: what the choices produced and the surface has not written yet.
  struct Choice {
    std::string text;       // whole: all the text
    LogprobsOut logprobs;   // whole: every token's; stream: those not yet in a piece
    int64_t text_offset = 0;  // stream, completions: characters of the tokens already in pieces
    bool role_sent = false;   // stream: its first chunk (chat: with the role) is out
    bool ended = false;
    PipelineOutcome outcome;
    size_t n_sent = 0;            // stream with tools: bytes of `text` already sent as content
    std::vector<ToolCall> calls;  // with tools, once ended: the calls read from the output
  };
  std::vector<Choice> choices_;
  // Stream: text not yet written, a piece per event that completed some, with the log-probabilities
  // of its tokens (and of tokens before it that completed none); `last` ends its choice.
  struct Piece {
    int index = 0;
    std::string text;
    LogprobsOut logprobs;
    bool last = false;
    std::vector<ToolCall> tool_calls = {};  // on the last piece: the calls the choice made
  };
  std::vector<Piece> pieces_;
  size_t n_ended_ = 0;
  bool refused_ = false;     // refused before any choice started
  bool got_tokens_ = false;  // a first token arrived
  bool cancelling_ = false;  // the choices were told to end; their ends follow
  bool opened_ = false;      // stream: the first write is out
  Status status_;            // the first failure (OK while none)

  // With tools, at a choice's end: its text becomes the content beside the calls it made (each
  // named with a fresh id), and finish_reason "tool_calls" when it made any and was not cut short.
  void read_calls_locked(Choice& c) {
    ToolOutput parsed = parse_tool_calls(*tool_syntax_, c.text);
    if (parsed.calls.empty()) return;
    for (ToolCall& call : parsed.calls) call.id = tool_call_id(*tool_syntax_);
    c.text = std::move(parsed.content);
    c.calls = std::move(parsed.calls);
    if (c.outcome.finish_reason == "stop") c.outcome.finish_reason = "tool_calls";  // "length" stays
  }

  // Stream: choice `index`'s log-probabilities gathered since its last piece, for the next one.
  LogprobsOut take_logprobs_locked(int index) {
    Choice& c = choices_[static_cast<size_t>(index)];
    LogprobsOut out;
    out.tokenizer = c.logprobs.tokenizer;
    out.text_offset = c.text_offset;
    out.ids.swap(c.logprobs.ids);
    out.logprobs.swap(c.logprobs.logprobs);
    if (out.tokenizer != nullptr) {
      for (int32_t id : out.ids) c.text_offset += token_text_chars(*out.tokenizer, id);
    }
    return out;
  }
};

void ChoiceCall::emit_tokens(std::span<const int32_t> ids, std::span<const TokenLogprobs> logprobs,
                             const std::string& text) {
  if (auto p = parent_.lock()) p->choice_tokens(index_, ids, logprobs, text);
}

void ChoiceCall::emit_end(const Status& status, const PipelineOutcome& outcome, const std::string& tail) {
  if (auto p = parent_.lock()) p->choice_end(index_, status, outcome, tail);
}

void HttpCall::choice_tokens(int index, std::span<const int32_t> ids, std::span<const TokenLogprobs> logprobs,
                             const std::string& text) {
  std::lock_guard<std::mutex> lock(mu_);
  Choice& c = choices_[static_cast<size_t>(index)];
  if (logprobs_) {
    c.logprobs.ids.insert(c.logprobs.ids.end(), ids.begin(), ids.end());
    c.logprobs.logprobs.insert(c.logprobs.logprobs.end(), logprobs.begin(), logprobs.end());
  }
  if (!stream_) {
    c.text += text;
  } else if (tool_syntax_) {
    // Text that may turn out to be a call waits; what cannot goes out as content.
    c.text += text;
    const size_t free = tool_call_free_prefix(*tool_syntax_, c.text);
    if (free > c.n_sent) {
      pieces_.push_back({index, c.text.substr(c.n_sent, free - c.n_sent), take_logprobs_locked(index), false});
      c.n_sent = free;
    }
  } else if (!text.empty()) {
    pieces_.push_back({index, text, take_logprobs_locked(index), false});
  }
  got_tokens_ = got_tokens_ || !ids.empty();
  cv_.notify_all();
}

void HttpCall::choice_end(int index, const Status& status, const PipelineOutcome& outcome, const std::string& tail) {
  std::lock_guard<std::mutex> lock(mu_);
  Choice& c = choices_[static_cast<size_t>(index)];
  if (c.ended) return;
  c.ended = true;
  c.outcome = outcome;
  ++n_ended_;
  if (!status.ok()) {
    if (status_.ok()) status_ = status;  // the first failure is the request's
  } else if (!stream_) {
    c.text += tail;
    if (tool_syntax_) read_calls_locked(c);
  } else if (tool_syntax_) {
    c.text += tail;
    const size_t sent = c.n_sent;
    read_calls_locked(c);
    // What was sent is content before any call; the rest of the content, then the calls.
    Piece last{index, c.text.substr(std::min(sent, c.text.size())), take_logprobs_locked(index), true, {}};
    last.tool_calls = c.calls;
    pieces_.push_back(std::move(last));
  } else {
    pieces_.push_back({index, tail, take_logprobs_locked(index), true});
  }
  cv_.notify_all();
}

void HttpCall::emit_end(const Status& status, const PipelineOutcome&, const std::string&) {
  std::lock_guard<std::mutex> lock(mu_);
  refused_ = true;
  status_ = status;
  cv_.notify_all();
}

std::optional<Status> HttpCall::abandoned() const {
  if (env_.stopping != nullptr && env_.stopping->load()) {
    return unavailable("this frontend shut down before the request finished; retry on another replica");
  }
  if (env_.client_gone && env_.client_gone()) return cancelled("the client closed the connection");
  return std::nullopt;
}

void HttpCall::cancel_choices(const Status& why) {
  for (const auto& call : calls_) call->cancel(why);
}

template <class Ready>
void HttpCall::wait_locked(std::unique_lock<std::mutex>& lock, Ready ready) {
  while (!cv_.wait_for(lock, kPollInterval, ready)) {
    if (cancelling_) continue;
    // A failed choice fails the request: the others end too (from here, not from the failed
    // one's callback, which holds its pipeline's mutex).
    std::optional<Status> why = status_.ok() ? abandoned() : std::optional<Status>(status_);
    if (!why) continue;
    cancelling_ = true;
    lock.unlock();  // the choices' ends come back through choice_end, which takes mu_
    cancel_choices(*why);
    lock.lock();
  }
}

PipelineOutcome HttpCall::usage_locked() const {
  PipelineOutcome total = choices_.empty() ? PipelineOutcome{} : choices_[0].outcome;
  total.n_prompt_tokens = total.n_generated = 0;
  for (size_t i = 0; i < choices_.size(); ++i) {
    if (i % static_cast<size_t>(n_) == 0) total.n_prompt_tokens += choices_[i].outcome.n_prompt_tokens;
    total.n_generated += choices_[i].outcome.n_generated;
  }
  return total;
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
  std::string label;
  if (parsed.ok()) {
    stream_ = parsed->stream;
    include_usage_ = parsed->include_usage;
    n_ = parsed->n;
    label = parsed->label;
    logprobs_ = parsed->choices.front().pipeline.sampling.top_logprobs >= 0;
    if (parsed->tool_calls) tool_syntax_ = parsed->tool_syntax;
    choices_.resize(parsed->choices.size());
    for (Choice& c : choices_) c.logprobs.tokenizer = frontend().model->tokenizer;
    auto self = std::static_pointer_cast<HttpCall>(shared_from_this());
    for (size_t i = 0; i < parsed->choices.size(); ++i) {
      calls_.push_back(std::make_shared<ChoiceCall>(frontend(), self, static_cast<int>(i)));
    }
    for (size_t i = 0; i < calls_.size(); ++i) calls_[i]->run(std::move(parsed->choices[i]));
  } else {
    start(parsed.status(), CallDeadline::max());  // refused, after the drain's refusal
  }

  std::unique_lock<std::mutex> lock(mu_);
  wait_locked(lock, [this] { return ended_locked() || (stream_ && got_tokens_ && status_.ok()); });
  if (ended_locked() && !status_.ok()) {
    set_error_response(res, status_);
    return;
  }
  header_.id = response_id(header_.endpoint, label);
  res.set_header("X-Request-Id", label);
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
  const PipelineOutcome usage = usage_locked();
  for (const auto& [name, value] : timing_headers(choices_[0].outcome)) res.set_header(name, value);
  std::vector<ChoiceOut> out;
  for (const Choice& c : choices_) out.push_back({c.text, c.outcome, logprobs_ ? &c.logprobs : nullptr, &c.calls});
  res.set_content(completion_body(header_, out, usage), "application/json");
}

bool HttpCall::write_events(httplib::DataSink& sink) {
  // One chunk per piece of text, as OpenAI streams them (clients and benchmarks count chunks as
  // tokens), all that have arrived in one write; a choice's last piece carries its finish_reason.
  std::string out;
  bool done = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    wait_locked(lock, [this] { return ended_locked() || !pieces_.empty() || !opened_; });
    std::vector<Piece> pieces = std::move(pieces_);
    pieces_.clear();
    const bool ended = ended_locked();
    const bool failed = !status_.ok();
    if (!failed) {
      if (pieces.empty() && !opened_ && !ended) pieces.push_back({});  // the opening chunk (chat: the role)
      for (const Piece& p : pieces) {
        Choice& c = choices_[static_cast<size_t>(p.index)];
        const LogprobsOut* lp = logprobs_ && !p.logprobs.ids.empty() ? &p.logprobs : nullptr;
        out += sse_event(chunk_body(header_, p.index, p.text, !c.role_sent, p.last ? &c.outcome : nullptr,
                                    include_usage_, lp, &p.tool_calls));
        c.role_sent = true;
      }
    }
    opened_ = true;
    if (ended && !failed) {
      if (include_usage_) out += sse_event(usage_chunk_body(header_, usage_locked()));
      out += kSseDone;
      done = true;
    } else if (ended) {
      out += sse_event(error_body(http_status_of(status_.code()), status_));
      done = true;
    }
  }
  if (!sink.write(out.data(), out.size())) {
    cancel_choices(cancelled("the client closed the connection"));
    return false;
  }
  if (done) sink.done();
  return true;
}

void HttpCall::on_stream_released() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_locked()) return;
  }
  cancel_choices(abandoned().value_or(cancelled("the response stream ended early")));
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
