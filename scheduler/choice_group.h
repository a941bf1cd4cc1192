// The n choices of one prompt (OpenAI's n), as the frontend runs them: one RequestPipeline each,
// and the prompt prefilled once. Choice 0 (the leader) is an ordinary request whose first Admit
// announces n - 1 forks; once its KV is on its decode worker (the prefill worker's kv_sent, or the
// decode worker's first token when it prefilled the prompt itself) it publishes where. The other
// choices (followers) wait for that: each then admits a fork of the leader's attempt on the same
// decode worker (AdmitCall::fork_of), which shares the prompt's blocks and samples the fork's own
// first token. When the leader's first attempt ends without its KV on a decode worker (it failed
// over, was refused, or ended first), it publishes nothing and every follower runs as an ordinary
// request; so does a follower whose fork is refused. Failovers after that are each choice's own.
//
// Threading: publish() runs the followers' callbacks on its own thread, after its lock is
// released; follow() after publish() runs the callback at once, on the caller's thread. Callers
// must hold no pipeline lock (RequestPipeline calls both from its Guard's after-list).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace baton {

class ChoiceGroup {
 public:
  // Where the leader's prompt KV is held for forks.
  struct Source {
    std::string decode_address;
    std::string request_id;  // the leader attempt's worker-facing id
    int32_t n_prompt_tokens = 0;
  };
  using Ready = std::function<void(const std::optional<Source>&)>;

  explicit ChoiceGroup(int32_t n_choices) : n_choices_(n_choices) {}

  int32_t n_choices() const { return n_choices_; }
  // Leader, once: its KV is held at `source`, or (nullopt) it will not be.
  void publish(std::optional<Source> source);
  // Follower: `ready` runs once with the leader's source, or nullopt.
  void follow(Ready ready);

 private:
  const int32_t n_choices_;
  std::mutex mu_;
  bool published_ = false;
  std::optional<Source> source_;  // guarded by mu_
  std::vector<Ready> waiting_;    // guarded by mu_
};

}  // namespace baton
