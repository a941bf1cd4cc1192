#include "model/output_constraints.h"

#include <algorithm>
#include <functional>
#include <list>
#include <mutex>

#include "grammar/json_schema.h"
#include "model/tokenizer.h"

namespace baton {
namespace {

Result<grammar::Grammar> compile(const OutputFormat& format) {
  if (format.kind == OutputFormat::Kind::kJsonObject) return grammar::json_object_grammar();
  return grammar::compile_json_schema(format.schema, format.prefix, format.suffix);
}

// The format as one string (lengths first: the parts cannot run into one another).
std::string format_key(const OutputFormat& f) {
  return std::to_string(static_cast<int>(f.kind)) + ":" + std::to_string(f.prefix.size()) + ":" +
         std::to_string(f.suffix.size()) + ":" + f.prefix + f.suffix + f.schema;
}

}  // namespace

Status validate_output_format(const OutputFormat& format) {
  if (format.kind == OutputFormat::Kind::kText) return {};
  // The hashes of the formats that compiled lately: the same one again is not compiled again
  // here. (A hash that collides lets a format through unchecked only as far as the workers, which
  // compile it under the same budget.)
  constexpr size_t kRecent = 256;
  static std::mutex mu;
  static std::list<size_t> recent;  // most recent first
  const size_t h = std::hash<std::string>{}(format_key(format));
  {
    std::lock_guard lock(mu);
    if (const auto it = std::find(recent.begin(), recent.end(), h); it != recent.end()) {
      recent.splice(recent.begin(), recent, it);
      return {};
    }
  }
  BATON_RETURN_IF_ERROR(compile(format).status());
  std::lock_guard lock(mu);
  recent.push_front(h);
  if (recent.size() > kRecent) recent.pop_back();
  return {};
}

OutputConstraints::OutputConstraints(const Tokenizer& tokenizer, int32_t n_vocab) {
  std::vector<std::string> bytes(static_cast<size_t>(std::max(n_vocab, tokenizer.n_vocab())));
  for (int32_t id = 0; id < tokenizer.n_vocab(); ++id) {
    const TokenType t = tokenizer.type(id);
    if (t == TokenType::kControl || t == TokenType::kUnknown || t == TokenType::kUnused) continue;
    bytes[static_cast<size_t>(id)] = tokenizer.token_bytes(id);
  }
  vocabulary_ = grammar::TokenVocabulary::create(std::move(bytes), tokenizer.stop_ids());
}

Status OutputConstraints::resolve(SamplingParams* params) {
  params->constraint.reset();
  if (params->format.kind == OutputFormat::Kind::kText) return {};
  const OutputFormat& f = params->format;
  // The tenant scope is part of the key: a client fills only its own scope's automaton (each has
  // a memory bound, past which its outputs end), never another tenant's.
  const std::string key =
      std::to_string(params->cache_scope.size()) + ":" + params->cache_scope + format_key(f);
  {
    std::lock_guard lock(mu_);
    for (auto it = cached_.begin(); it != cached_.end(); ++it) {
      if (it->first == key) {
        cached_.splice(cached_.begin(), cached_, it);
        params->constraint = it->second;
        return {};
      }
    }
  }
  // Compiled outside the lock: a large schema does not hold up requests whose schema is kept.
  BATON_ASSIGN_OR_RETURN(grammar::Grammar g, compile(params->format));
  auto constraint = std::make_shared<grammar::TokenConstraint>(std::move(g), vocabulary_);
  if (constraint->exhausted()) {
    return invalid_argument("the schema is too large for structured output: its automaton's start state needs more "
                            "than " + std::to_string(grammar::TokenConstraint::kMaxBytes >> 20) + " MiB");
  }
  std::lock_guard lock(mu_);
  cached_.emplace_front(key, constraint);
  // The most recent ones that fit both bounds are kept (the new one always). The automata grow as
  // they are used, so their sizes are summed again at each new one.
  size_t bytes = 0, n = 0;
  auto it = cached_.begin();
  for (; it != cached_.end(); ++it, ++n) {
    bytes += it->second->bytes();
    if (n > 0 && (bytes > kCachedBytes || n >= kCached)) break;
  }
  cached_.erase(it, cached_.end());
  params->constraint = std::move(constraint);
  return {};
}

Status resolve_format(OutputConstraints* constraints, const std::string& worker, SamplingParams* params) {
  if (params->format.kind == OutputFormat::Kind::kText) return {};
  if (constraints == nullptr) {
    return failed_precondition(worker + " has no vocabulary for structured output (response_format); send the request to "
                               "a worker started with its model's tokenizer");
  }
  return constraints->resolve(params);
}

}  // namespace baton
