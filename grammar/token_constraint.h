// Token masks from a grammar: which tokens of the vocabulary may come next so that the output
// stays a prefix of a sentence of the grammar, and whether it is a whole one (then the stop
// tokens are allowed too).
//
// The matcher is a pushdown automaton over bytes, made deterministic lazily: a state is the set
// of stacks the grammar can be in after the bytes so far (each stack a chain of grammar
// positions, hash-consed so that equal stacks are one node), and a state's transition by a byte
// is computed the first time it is needed and kept. A token's mask is found by walking the
// vocabulary's byte trie from the state, pruning every subtree whose prefix no state accepts;
// it is kept per state, so a state met again (inside a string, between array items, in another
// request with the same schema) costs a lookup.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "grammar/grammar.h"

namespace baton::grammar {

// The vocabulary as a byte trie. Built once per model and shared by every constraint.
class TokenVocabulary {
 public:
  // bytes[id]: what token id spells; an empty string (a control token, an unused id) is never
  // allowed by a grammar. `stop_ids` are allowed exactly when the output is complete.
  static std::shared_ptr<const TokenVocabulary> create(std::vector<std::string> bytes, std::vector<int32_t> stop_ids);

  int32_t n_tokens() const { return static_cast<int32_t>(bytes_.size()); }
  // 32-bit words of a mask over the vocabulary.
  int32_t n_words() const { return (n_tokens() + 31) / 32; }
  const std::string& bytes(int32_t id) const { return bytes_[static_cast<size_t>(id)]; }
  const std::vector<int32_t>& stop_ids() const { return stop_ids_; }
  bool is_stop(int32_t id) const;

  struct Edge {
    uint8_t byte;
    int32_t child;
  };
  struct Node {
    int32_t first_edge = 0, n_edges = 0;    // into edges(), sorted by byte
    int32_t first_token = 0, n_tokens = 0;  // into token_ids(): the tokens spelling exactly this prefix
  };
  // Node 0 is the root (the empty prefix).
  const std::vector<Node>& nodes() const { return nodes_; }
  const std::vector<Edge>& edges() const { return edges_; }
  const std::vector<int32_t>& token_ids() const { return token_ids_; }

 private:
  std::vector<std::string> bytes_;
  std::vector<int32_t> stop_ids_;
  std::vector<Node> nodes_;
  std::vector<Edge> edges_;
  std::vector<int32_t> token_ids_;
};

// One grammar over one vocabulary; shared by every sequence decoding under it. Thread-safe.
class TokenConstraint {
 public:
  using State = int32_t;
  static constexpr State kDead = 0;  // no continuation: the bytes so far leave the grammar
  // Distinct states kept at most (each holds a 1 KiB transition row, and a mask once asked for),
  // and the memory all of the automaton may take (states, their stacks, rows and masks, stack
  // nodes). Past either, new states are dead: an output that needs one ends there. A real schema
  // comes nowhere near (bench/RESULTS.md, "Schema budget"); a schema with tens of thousands of
  // optional properties, or output nested thousands of levels deep, does.
  static constexpr int32_t kMaxStates = 1 << 16;
  static constexpr size_t kMaxBytes = size_t{256} << 20;

  TokenConstraint(Grammar grammar, std::shared_ptr<const TokenVocabulary> vocabulary);
  TokenConstraint(const TokenConstraint&) = delete;
  TokenConstraint& operator=(const TokenConstraint&) = delete;

  State start() const { return start_; }
  // The state after `token` (after a stop token: the same state when it is complete, else kDead).
  State advance(State state, int32_t token);
  State advance_bytes(State state, std::string_view bytes);
  // Whether the bytes so far are a whole sentence of the grammar.
  bool complete(State state);
  // The tokens allowed after `state` (vocabulary().n_words() words, bit t % 32 of word t / 32):
  // those whose bytes keep the output a prefix, and the stop tokens when it is complete. Kept for
  // the constraint's lifetime. A dead state allows the stop tokens alone.
  const uint32_t* mask(State state);

  const Grammar& grammar() const { return grammar_; }
  const TokenVocabulary& vocabulary() const { return *vocabulary_; }
  int32_t n_states();
  int32_t n_masks();
  // Whether the memory bound (or kMaxStates) has been reached: some transition was made dead for
  // want of room. The start state of a grammar too large to begin with is dead.
  bool exhausted();
  // The memory the automaton holds (estimated as the budget counts it), the grammar included.
  size_t bytes();

 private:
  struct StateInfo {
    std::vector<int32_t> stacks;  // sorted node ids, each a stack whose top is a byte set
    bool complete = false;
    std::unique_ptr<std::array<State, 256>> next;  // -1: not yet computed
    std::vector<uint32_t> mask;                     // empty until asked for
  };
  struct StateKey {
    size_t operator()(const std::pair<std::vector<int32_t>, bool>& k) const;
  };

  // The stack node for (pos, parent), made when new; -2 when the memory budget is spent.
  int32_t node(int32_t pos, int32_t parent);
  // Adds to `ready` the stacks reached from (pos, parent) before the next byte; false when the
  // memory budget ran out on the way (the caller then treats the whole step as dead).
  bool expand(int32_t pos, int32_t parent, std::vector<int32_t>* ready, bool* complete);
  State intern(std::vector<int32_t> stacks, bool complete);
  State step(State state, uint8_t byte);  // mu_ held
  void compute_mask(State state);         // mu_ held

  const Grammar grammar_;
  const std::shared_ptr<const TokenVocabulary> vocabulary_;
  std::mutex mu_;
  // Stack nodes: (grammar position, parent node or -1), hash-consed.
  std::vector<std::pair<int32_t, int32_t>> nodes_;
  std::unordered_map<uint64_t, int32_t> node_ids_;
  std::vector<uint32_t> visited_;  // per node: the expansion that last visited it
  uint32_t expansion_ = 0;
  std::vector<StateInfo> states_;
  std::unordered_map<std::pair<std::vector<int32_t>, bool>, State, StateKey> state_ids_;
  State start_ = kDead;
  int32_t n_masks_ = 0;
  // Memory held (estimated), and whether the budget has cut anything short.
  static constexpr size_t kNodeBytes = 64;
  size_t bytes_ = 0;
  bool exhausted_ = false;
};

}  // namespace baton::grammar
