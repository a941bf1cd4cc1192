// What `batonctl bench` sends, as prompt token ids: conversations of one or more turns. No gRPC
// here; the load runner turns each turn into a Generate call and reports its answer back.
//   random  every request its own one-turn conversation: --prompt-tokens random ids.
//   chat    --conversations conversations of --turns turns. Every conversation starts with the
//           same system prompt (--system-prompt-tokens random ids, identical across
//           conversations); turn t sends the whole history: the system prompt, then for each
//           earlier turn its user message and the ids the server answered, then a new user
//           message of --prompt-tokens ids. The prompt of turn t (0-based) is therefore
//           S + (t + 1)·P + (the answers so far) ids long: S + (t + 1)·P + t·O with ignore_eos.
// Ids are drawn uniformly from [kMinPromptId, vocab_size), seeded: the same seed sends the same
// prompts (given the same answers).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <vector>

namespace baton::ctl {

// Low ids are where vocabularies keep their special and byte tokens, which would make some
// prompts unrepresentative.
constexpr int kMinPromptId = 100;

struct WorkloadTurn {
  int conversation = 0;  // 0-based, in the order conversations start
  int turn = 0;          // 0-based within its conversation
  std::vector<int32_t> prompt_ids;
};

// Called from one thread (the runner's); a conversation's turns are asked for in order, each
// after the previous one's answer is known.
class Workload {
 public:
  virtual ~Workload() = default;
  // The first turn of the next conversation; nullopt once every conversation has started.
  virtual std::optional<WorkloadTurn> start_conversation() = 0;
  // The turn after `conversation`'s latest one, which the server answered with `answer`; nullopt
  // when the conversation has no more turns.
  virtual std::optional<WorkloadTurn> next_turn(int conversation, const std::vector<int32_t>& answer) = 0;
};

struct RandomWorkloadConfig {
  int n_requests = 0;  // conversations (= requests); < 0: unbounded (the runner's --duration ends it)
  int prompt_tokens = 0;
  int vocab_size = 0;  // > kMinPromptId
  uint64_t seed = 0;
  // A mixed workload: each prompt is long_prompt_tokens long with probability long_fraction
  // (drawn from the same seeded stream), else prompt_tokens. 0: every prompt prompt_tokens.
  int long_prompt_tokens = 0;
  double long_fraction = 0;
};
std::unique_ptr<Workload> make_random_workload(const RandomWorkloadConfig& config);

struct ChatWorkloadConfig {
  int conversations = 0;         // > 0
  int turns = 0;                 // per conversation, > 0
  int system_prompt_tokens = 0;  // S, shared by every conversation; may be 0
  int prompt_tokens = 0;         // P, each user message
  int vocab_size = 0;            // > kMinPromptId
  uint64_t seed = 0;
};
std::unique_ptr<Workload> make_chat_workload(const ChatWorkloadConfig& config);

// The longest prompt a chat conversation sends when every answer is `output_tokens` long:
// S + turns·P + (turns − 1)·O.
int64_t chat_longest_prompt(const ChatWorkloadConfig& config, int output_tokens);

}  // namespace baton::ctl
