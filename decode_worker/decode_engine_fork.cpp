// DecodeEngine's forks: the n choices of one prompt holding its KV blocks once (the contract is
// in decode_engine.h; admission and the step loop in decode_engine.cpp). A request that announced
// forks leaves its prompt blocks in a hold once its KV is complete; each fork shares the hold's
// full blocks, copies the positions of its last partial one on its first step, and computes the
// prompt's last position itself.
#include <spdlog/spdlog.h>

#include <span>

#include "decode_worker/decode_engine.h"
#include "decode_worker/decode_sequence.h"

namespace baton {

Status DecodeEngine::admit_fork_locked(const DecodeAdmit& r, int64_t* reserved_blocks) {
  auto it = fork_holds_.find(r.fork_of);
  if (it == fork_holds_.end()) {
    return failed_precondition("request " + r.request_id + " forks request " + r.fork_of +
                               ", whose prompt KV decode worker " + config_.name +
                               " does not hold for forks (not admitted with n_forks, its KV not complete "
                               "yet, every fork it announced taken, or " +
                               n_str(config_.fork_hold.count()) + " ms passed): admit it with its own KV instead");
  }
  ForkHold& hold = it->second;
  if (!hold.owner.empty() && r.owner != hold.owner) {
    return permission_denied("request " + r.fork_of +
                             " was admitted by another peer; a fork of it is honoured only from "
                             "the peer that admitted it");
  }
  const int32_t n_prompt = r.n_prompt_tokens;
  if (n_prompt != static_cast<int32_t>(hold.tokens.size())) {
    return invalid_argument("request " + r.request_id + " forks a prompt of " + n_str(n_prompt) +
                            " tokens but request " + r.fork_of + "'s has " +
                            n_str(static_cast<int64_t>(hold.tokens.size())));
  }
  // Positions [0, n_prompt - 1) come from the hold: its full blocks shared, the rest copied into the
  // fork's first own block; the prompt's last position is computed again, for the fork's own first token.
  const int bs = pool_.block_size();
  const int n_shared = (n_prompt - 1) / bs;
  const int32_t n_copy = (n_prompt - 1) % bs;
  const int64_t n_positions = int64_t{n_prompt} + r.max_tokens;
  const int n_own = pool_.blocks_for(n_positions) - n_shared;
  if (!pool_.can_allocate(n_own)) {
    return resource_exhausted("request " + r.request_id + " (a fork of " + r.fork_of + ") needs " + n_str(n_own) +
                              " KV blocks of its own but decode worker " + config_.name + " has " +
                              n_str(pool_.n_free()) + " of " + n_str(pool_.n_total()) +
                              " free: retry later or elsewhere");
  }
  auto seq = std::make_shared<Sequence>(r);
  seq->table.assign(hold.blocks.begin(), hold.blocks.begin() + n_shared);
  pool_.share(seq->table);
  BATON_CHECK(pool_.grow_to(seq->table, n_positions), "blocks counted free for fork %s", r.request_id.c_str());
  if (n_copy > 0) {
    seq->copy_from = hold.blocks[static_cast<size_t>(n_shared)];
    pool_.share(std::span(&seq->copy_from, 1));  // kept until copied, whatever the hold does
    seq->n_copy = n_copy;
  }
  seq->n_forked = n_prompt - 1;
  seq->n_prefilled = n_prompt - 1;
  seq->admit.prefill_tokens = hold.tokens;
  seq->set_sampler_history(hold.tokens);
  seq->state = SeqState::kPrefilling;
  seqs_.emplace(r.request_id, seq);
  prefilling_.push_back(seq);
  ++n_waiting_;
  spdlog::info(
      "decode req={} admitted as a fork of {}: {} prompt tokens ({} blocks shared, {} positions copied), "
      "max_tokens {}, {} blocks reserved, {} free",
      r.request_id, r.fork_of, n_prompt, n_shared, n_copy, r.max_tokens, n_own, pool_.n_free());
  if (--hold.n_left == 0) drop_fork_hold_locked(it);
  update_gauges_locked();
  work_ = true;
  if (reserved_blocks != nullptr) *reserved_blocks = n_own;
  return {};
}

void DecodeEngine::hold_for_forks_locked(const Sequence& seq, std::vector<int32_t> tokens) {
  if (seq.admit.n_forks <= 0 || tokens.empty()) return;
  ForkHold hold;
  hold.owner = seq.admit.owner;
  hold.n_left = seq.admit.n_forks;
  hold.expires = DecodeClock::now() + config_.fork_hold;
  const int n_blocks = pool_.blocks_for(static_cast<int64_t>(tokens.size()) - 1);
  hold.blocks.assign(seq.table.begin(), seq.table.begin() + n_blocks);
  pool_.share(hold.blocks);
  hold.tokens = std::move(tokens);
  // admit() refuses an id that holds one; were one there, its blocks go back rather than leak.
  if (auto old = fork_holds_.find(seq.admit.request_id); old != fork_holds_.end()) drop_fork_hold_locked(old);
  fork_holds_[seq.admit.request_id] = std::move(hold);
  work_ = true;  // the engine thread arms the hold's expiry
}

void DecodeEngine::drop_fork_hold_locked(std::map<std::string, ForkHold>::iterator it) {
  pool_.release(it->second.blocks);
  fork_holds_.erase(it);
}

void DecodeEngine::release_fork_copy_locked(Sequence& s) {
  if (s.copy_from < 0) return;
  std::vector<int32_t> source{s.copy_from};
  pool_.release(source);
  s.copy_from = -1;
  s.n_copy = 0;
}

void DecodeEngine::copy_fork_prefix(const Sequence& s) {
  const ModelConfig& mc = model_.config();
  const int32_t dst = s.table[static_cast<size_t>(s.n_forked / config_.block_size)];
  const size_t bytes = static_cast<size_t>(s.n_copy) * mc.n_kv_heads * mc.head_dim * dtype_size(config_.kv_dtype);
  std::vector<std::byte> k(bytes), v(bytes);
  for (int layer = 0; layer < mc.n_layers; ++layer) {
    model_.backend().kv_export(*cache_, layer, &s.copy_from, 0, s.n_copy, k.data(), v.data());
    model_.backend().kv_import(*cache_, layer, &dst, 0, s.n_copy, k.data(), v.data());
  }
}

}  // namespace baton
