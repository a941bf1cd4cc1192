#include "grammar/token_constraint.h"

#include <algorithm>
#include <map>
#include <utility>

#include "common/check.h"

namespace baton::grammar {

std::shared_ptr<const TokenVocabulary> TokenVocabulary::create(std::vector<std::string> bytes,
                                                               std::vector<int32_t> stop_ids) {
  auto v = std::shared_ptr<TokenVocabulary>(new TokenVocabulary());
  v->bytes_ = std::move(bytes);
  std::sort(stop_ids.begin(), stop_ids.end());
  stop_ids.erase(std::unique(stop_ids.begin(), stop_ids.end()), stop_ids.end());
  for (int32_t id : stop_ids) BATON_CHECK(id >= 0 && id < v->n_tokens(), "stop id %d of %d tokens", id, v->n_tokens());
  v->stop_ids_ = std::move(stop_ids);
  // A trie built from the tokens in byte order: each node's children are the next distinct bytes
  // of a contiguous run of the sorted tokens, so a depth-first pass lays it out in one go.
  std::vector<int32_t> order;
  for (int32_t id = 0; id < v->n_tokens(); ++id) {
    if (!v->bytes_[static_cast<size_t>(id)].empty()) order.push_back(id);
  }
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return v->bytes_[static_cast<size_t>(a)] < v->bytes_[static_cast<size_t>(b)] || (v->bytes_[static_cast<size_t>(a)] == v->bytes_[static_cast<size_t>(b)] && a < b);
  });
  struct Pending {
    int32_t node;
    size_t depth, begin, end;  // order[begin, end) share the node's prefix of `depth` bytes
  };
  v->nodes_.emplace_back();
  std::vector<Pending> todo{{0, 0, 0, order.size()}};
  while (!todo.empty()) {
    const Pending p = todo.back();
    todo.pop_back();
    size_t i = p.begin;
    TokenVocabulary::Node& n = v->nodes_[static_cast<size_t>(p.node)];
    n.first_token = static_cast<int32_t>(v->token_ids_.size());
    while (i < p.end && v->bytes_[static_cast<size_t>(order[i])].size() == p.depth) v->token_ids_.push_back(order[i++]);
    n.n_tokens = static_cast<int32_t>(v->token_ids_.size()) - n.first_token;
    n.first_edge = static_cast<int32_t>(v->edges_.size());
    std::vector<Pending> children;
    while (i < p.end) {
      const auto b = static_cast<uint8_t>(v->bytes_[static_cast<size_t>(order[i])][p.depth]);
      size_t j = i;
      while (j < p.end && static_cast<uint8_t>(v->bytes_[static_cast<size_t>(order[j])][p.depth]) == b) ++j;
      const auto child = static_cast<int32_t>(v->nodes_.size() + children.size());
      v->edges_.push_back({b, child});
      children.push_back({child, p.depth + 1, i, j});
      i = j;
    }
    // (n may dangle once nodes_ grows: write through the index.)
    v->nodes_[static_cast<size_t>(p.node)].n_edges = static_cast<int32_t>(children.size());
    v->nodes_.resize(v->nodes_.size() + children.size());
    todo.insert(todo.end(), children.rbegin(), children.rend());
  }
  return v;
}

bool TokenVocabulary::is_stop(int32_t id) const { return std::binary_search(stop_ids_.begin(), stop_ids_.end(), id); }

size_t TokenConstraint::StateKey::operator()(const std::pair<std::vector<int32_t>, bool>& k) const {
  uint64_t h = k.second ? 0x9e3779b97f4a7c15ULL : 0;
  for (int32_t x : k.first) h = (h ^ static_cast<uint32_t>(x)) * 0x100000001b3ULL + (h >> 29);
  return static_cast<size_t>(h);
}

TokenConstraint::TokenConstraint(Grammar grammar, std::shared_ptr<const TokenVocabulary> vocabulary)
    : grammar_(std::move(grammar)), vocabulary_(std::move(vocabulary)) {
  BATON_CHECK(vocabulary_ != nullptr, "a constraint needs a vocabulary");
  std::lock_guard lock(mu_);
  bytes_ = grammar_.elements.size() * sizeof(Element) + grammar_.byte_sets.size() * sizeof(ByteSet) +
           grammar_.rule_starts.size() * (sizeof(std::vector<int32_t>) + 32);
  intern({}, false);  // kDead
  std::vector<int32_t> ready;
  bool complete = false;
  ++expansion_;
  bool whole = true;
  for (int32_t s : grammar_.rule_starts[static_cast<size_t>(grammar_.root)]) whole = whole && expand(s, -1, &ready, &complete);
  start_ = whole ? intern(std::move(ready), complete) : kDead;
}

int32_t TokenConstraint::node(int32_t pos, int32_t parent) {
  const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(pos)) << 32) | static_cast<uint32_t>(parent + 1);
  if (const auto it = node_ids_.find(key); it != node_ids_.end()) return it->second;
  if (bytes_ + kNodeBytes > kMaxBytes) {
    exhausted_ = true;
    return -2;
  }
  bytes_ += kNodeBytes;
  const auto id = static_cast<int32_t>(nodes_.size());
  node_ids_.emplace(key, id);
  nodes_.emplace_back(pos, parent);
  visited_.push_back(0);
  return id;
}

bool TokenConstraint::expand(int32_t pos, int32_t parent, std::vector<int32_t>* ready, bool* complete) {
  // Depth-first by an explicit stack: how deep references nest without a byte read follows the
  // schema (a chain of 4,500 $refs, thousands of optional properties passed over), so recursion
  // here overflowed or had to abort. A left-recursive grammar makes new stack nodes without end;
  // the memory budget stops it, and the expansion is then dead.
  std::vector<std::pair<int32_t, int32_t>> todo{{pos, parent}};
  while (!todo.empty()) {
    const auto [p, par] = todo.back();
    todo.pop_back();
    const int32_t at = node(p, par);
    if (at < 0) return false;
    if (visited_[static_cast<size_t>(at)] == expansion_) continue;
    visited_[static_cast<size_t>(at)] = expansion_;
    const Element& e = grammar_.elements[static_cast<size_t>(p)];
    switch (e.kind) {
      case Element::Kind::kBytes: ready->push_back(at); break;
      case Element::Kind::kEnd:
        if (par < 0) {
          *complete = true;
        } else {
          todo.push_back(nodes_[static_cast<size_t>(par)]);
        }
        break;
      case Element::Kind::kRule: {
        // A reference that ends its alternative returns straight to the parent (a tail call), so
        // a right-recursive repetition keeps one stack depth however many times it repeats.
        const bool tail = grammar_.elements[static_cast<size_t>(p) + 1].kind == Element::Kind::kEnd;
        const int32_t ret = tail ? par : node(p + 1, par);
        if (ret < -1) return false;
        for (int32_t start : grammar_.rule_starts[static_cast<size_t>(e.arg)]) todo.emplace_back(start, ret);
        break;
      }
    }
  }
  return true;
}

TokenConstraint::State TokenConstraint::intern(std::vector<int32_t> stacks, bool complete) {
  std::sort(stacks.begin(), stacks.end());
  stacks.erase(std::unique(stacks.begin(), stacks.end()), stacks.end());
  if (stacks.empty() && !complete && !states_.empty()) return kDead;
  auto key = std::make_pair(std::move(stacks), complete);
  auto it = state_ids_.find(key);
  if (it != state_ids_.end()) return it->second;
  const size_t cost = sizeof(StateInfo) + 2 * key.first.size() * sizeof(int32_t) + 64;
  if (static_cast<int32_t>(states_.size()) >= kMaxStates || bytes_ + cost > kMaxBytes) {
    exhausted_ = true;
    return kDead;
  }
  bytes_ += cost;
  const auto id = static_cast<State>(states_.size());
  StateInfo info;
  info.stacks = key.first;
  info.complete = complete;
  states_.push_back(std::move(info));
  state_ids_.emplace(std::move(key), id);
  return id;
}

TokenConstraint::State TokenConstraint::step(State state, uint8_t byte) {
  if (state == kDead) return kDead;
  StateInfo* info = &states_[static_cast<size_t>(state)];
  if (!info->next) {
    if (bytes_ + sizeof(std::array<State, 256>) > kMaxBytes) {
      exhausted_ = true;
      return kDead;
    }
    bytes_ += sizeof(std::array<State, 256>);
    info->next = std::make_unique<std::array<State, 256>>();
    info->next->fill(-1);
  }
  State& cached = (*info->next)[byte];
  if (cached >= 0) return cached;
  std::vector<int32_t> ready;
  bool complete = false, whole = true;
  ++expansion_;
  for (int32_t n : info->stacks) {
    const auto [pos, parent] = nodes_[static_cast<size_t>(n)];
    const Element& e = grammar_.elements[static_cast<size_t>(pos)];
    if (grammar_.byte_sets[static_cast<size_t>(e.arg)].test(byte) && !expand(pos + 1, parent, &ready, &complete)) {
      whole = false;
      break;
    }
  }
  // An expansion the memory budget cut short is dead (the budget only fills, so it stays dead).
  const State next = whole ? intern(std::move(ready), complete) : kDead;
  // intern may have grown states_: the row is reached through the index again.
  (*states_[static_cast<size_t>(state)].next)[byte] = next;
  return next;
}

TokenConstraint::State TokenConstraint::advance_bytes(State state, std::string_view bytes) {
  std::lock_guard lock(mu_);
  for (char c : bytes) {
    state = step(state, static_cast<uint8_t>(c));
    if (state == kDead) break;
  }
  return state;
}

TokenConstraint::State TokenConstraint::advance(State state, int32_t token) {
  if (token < 0 || token >= vocabulary_->n_tokens()) return kDead;
  if (vocabulary_->is_stop(token)) return complete(state) ? state : kDead;
  const std::string& b = vocabulary_->bytes(token);
  if (b.empty()) return kDead;
  return advance_bytes(state, b);
}

bool TokenConstraint::complete(State state) {
  std::lock_guard lock(mu_);
  return states_[static_cast<size_t>(state)].complete;
}

void TokenConstraint::compute_mask(State state) {
  const TokenVocabulary& v = *vocabulary_;
  std::vector<uint32_t> mask(static_cast<size_t>(v.n_words()), 0u);
  auto allow = [&mask](int32_t id) { mask[static_cast<size_t>(id) / 32] |= 1u << (id % 32); };
  if (state == kDead || states_[static_cast<size_t>(state)].complete) {
    for (int32_t id : v.stop_ids()) allow(id);
  }
  // Depth-first over the trie, carrying the grammar state each prefix leads to.
  std::vector<std::pair<int32_t, State>> todo;
  if (state != kDead) todo.emplace_back(0, state);
  const auto& nodes = v.nodes();
  const auto& edges = v.edges();
  const auto& ids = v.token_ids();
  while (!todo.empty()) {
    const auto [n, s] = todo.back();
    todo.pop_back();
    const TokenVocabulary::Node& tn = nodes[static_cast<size_t>(n)];
    for (int32_t e = tn.first_edge; e < tn.first_edge + tn.n_edges; ++e) {
      const State next = step(s, edges[static_cast<size_t>(e)].byte);
      if (next == kDead) continue;
      const int32_t child = edges[static_cast<size_t>(e)].child;
      const TokenVocabulary::Node& cn = nodes[static_cast<size_t>(child)];
      for (int32_t t = cn.first_token; t < cn.first_token + cn.n_tokens; ++t) {
        if (!v.is_stop(ids[static_cast<size_t>(t)])) allow(ids[static_cast<size_t>(t)]);
      }
      if (cn.n_edges > 0) todo.emplace_back(child, next);
    }
  }
  bytes_ += mask.size() * sizeof(uint32_t);
  states_[static_cast<size_t>(state)].mask = std::move(mask);
  ++n_masks_;
}

const uint32_t* TokenConstraint::mask(State state) {
  std::lock_guard lock(mu_);
  BATON_CHECK(state >= 0 && state < static_cast<State>(states_.size()), "state %d of %zu", state, states_.size());
  if (states_[static_cast<size_t>(state)].mask.empty()) compute_mask(state);
  return states_[static_cast<size_t>(state)].mask.data();
}

int32_t TokenConstraint::n_states() {
  std::lock_guard lock(mu_);
  return static_cast<int32_t>(states_.size());
}

int32_t TokenConstraint::n_masks() {
  std::lock_guard lock(mu_);
  return n_masks_;
}

bool TokenConstraint::exhausted() {
  std::lock_guard lock(mu_);
  return exhausted_;
}

size_t TokenConstraint::bytes() {
  std::lock_guard lock(mu_);
  return bytes_;
}

}  // namespace baton::grammar
