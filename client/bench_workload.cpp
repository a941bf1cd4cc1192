#include "client/bench_workload.h"

#include <random>

#include "common/check.h"

namespace baton::ctl {
namespace {

void append_random_ids(std::vector<int32_t>* ids, int n, int vocab_size, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> id(kMinPromptId, vocab_size - 1);
  for (int i = 0; i < n; ++i) ids->push_back(id(rng));
}

// Conversation `index`'s own stream of user messages.
std::mt19937_64 conversation_rng(uint64_t seed, int index) {
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), static_cast<uint32_t>(index)};
  return std::mt19937_64(seq);
}

class RandomWorkload final : public Workload {
 public:
  explicit RandomWorkload(const RandomWorkloadConfig& c) : c_(c), rng_(c.seed) {
    BATON_CHECK(c.vocab_size > kMinPromptId, "vocab %d", c.vocab_size);
  }

  std::optional<WorkloadTurn> start_conversation() override {
    if (c_.n_requests >= 0 && n_started_ >= c_.n_requests) return std::nullopt;
    WorkloadTurn t;
    t.conversation = n_started_++;
    int n = c_.prompt_tokens;
    if (c_.long_prompt_tokens > 0 && std::uniform_real_distribution<double>(0, 1)(rng_) < c_.long_fraction) {
      n = c_.long_prompt_tokens;
    }
    append_random_ids(&t.prompt_ids, n, c_.vocab_size, rng_);
    return t;
  }

  std::optional<WorkloadTurn> next_turn(int, const std::vector<int32_t>&) override { return std::nullopt; }

 private:
  RandomWorkloadConfig c_;
  std::mt19937_64 rng_;
  int n_started_ = 0;
};

class ChatWorkload final : public Workload {
 public:
  explicit ChatWorkload(const ChatWorkloadConfig& c) : c_(c) {
    BATON_CHECK(c.vocab_size > kMinPromptId && c.conversations > 0 && c.turns > 0, "vocab %d, %d x %d", c.vocab_size,
                c.conversations, c.turns);
    std::mt19937_64 rng(c.seed);
    append_random_ids(&system_prompt_, c.system_prompt_tokens, c.vocab_size, rng);
  }

  std::optional<WorkloadTurn> start_conversation() override {
    if (static_cast<int>(conversations_.size()) >= c_.conversations) return std::nullopt;
    const int index = static_cast<int>(conversations_.size());
    // Each conversation's user messages come from its own stream: what one conversation sends
    // does not depend on the order in which the others' turns finish.
    Conversation& c = conversations_.emplace_back(Conversation{system_prompt_, 0, conversation_rng(c_.seed, index)});
    append_random_ids(&c.history, c_.prompt_tokens, c_.vocab_size, c.rng);
    return WorkloadTurn{index, 0, c.history};
  }

  std::optional<WorkloadTurn> next_turn(int conversation, const std::vector<int32_t>& answer) override {
    BATON_CHECK(conversation >= 0 && conversation < static_cast<int>(conversations_.size()), "conversation %d",
                conversation);
    Conversation& c = conversations_[conversation];
    if (c.turn + 1 >= c_.turns) {
      c.history = {};  // done: release its memory
      return std::nullopt;
    }
    ++c.turn;
    c.history.insert(c.history.end(), answer.begin(), answer.end());
    append_random_ids(&c.history, c_.prompt_tokens, c_.vocab_size, c.rng);
    return WorkloadTurn{conversation, c.turn, c.history};
  }

 private:
  struct Conversation {
    std::vector<int32_t> history;  // what its latest turn sent
    int turn = 0;                  // its latest turn
    std::mt19937_64 rng;           // its user messages
  };
  ChatWorkloadConfig c_;
  std::vector<int32_t> system_prompt_;
  std::vector<Conversation> conversations_;  // in the order they started
};

}  // namespace

std::unique_ptr<Workload> make_random_workload(const RandomWorkloadConfig& config) {
  return std::make_unique<RandomWorkload>(config);
}

std::unique_ptr<Workload> make_chat_workload(const ChatWorkloadConfig& config) {
  return std::make_unique<ChatWorkload>(config);
}

int64_t chat_longest_prompt(const ChatWorkloadConfig& c, int output_tokens) {
  return static_cast<int64_t>(c.system_prompt_tokens) + static_cast<int64_t>(c.turns) * c.prompt_tokens +
         static_cast<int64_t>(c.turns - 1) * output_tokens;
}

}  // namespace baton::ctl
